"""bench/dispatch.py runs on 2 gloo ranks at toy sizes and prints its table (a check that the script works;
no timing is asserted).  The real backends are absent here: their rows say why."""

import subprocess
import sys
from pathlib import Path

import pytest

# a 2-rank torchrun launch: left out of the fast tier (`-m "not slow"`)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_dispatch_bench_prints_every_row():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "bench/dispatch.py",
            "--tokens",
            "64",
            "--hidden",
            "32",
            "--experts",
            "8",
            "--topk",
            "2",
            "--iters",
            "1",
            "--capacity",
            "0.5",
            "4.0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [
        line
        for line in out.stdout.splitlines()
        if line.startswith(("| balanced", "| skewed", "| forced"))
    ]
    assert len(rows) == 3 * 3, out.stdout
    assert "deepep: not run:" in out.stdout and "hybridep: not run:" in out.stdout
    cap4 = [r for r in rows if "cap 4.0" in r]  # C = T: nothing can drop
    assert all("| 0.0% |" in r for r in cap4), cap4
