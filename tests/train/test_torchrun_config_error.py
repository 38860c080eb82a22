"""A config mistake launched with torchrun on 2 CPU ranks (gloo): the `config error:` line, printed once,
is the last thing the launch prints (no ChildFailedError traceback or failure table after it), the
exit status is non-zero, and no rank is left running (moevlm/train/torchrun_exit.py)."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

# a 2-rank torchrun launch: left out of the fast tier (`-m "not slow"`)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_config_error_is_the_last_line_under_torchrun(tmp_path):
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "TORCHRUN_TAG": tag}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    # 3 rows cannot be split over 2 data-parallel ranks: found by validation on every rank
    args = [
        str(REPO / "train.py"),
        "train.global_batch_size=3",
        f"train.run_dir={tmp_path / 'run'}",
    ]
    proc = subprocess.run(
        [*cmd, *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    lines = [x for x in proc.stdout.splitlines() if x.strip()]
    assert proc.returncode == -9, (proc.returncode, proc.stdout[-3000:])
    assert lines[-1].startswith("config error: train.global_batch_size=3 must be a multiple"), lines
    assert proc.stdout.count("config error:") == 1
    assert "Traceback" not in proc.stdout and "ChildFailedError" not in proc.stdout
    assert not (tmp_path / "run").exists()
    deadline = time.monotonic() + 120  # a hang bound: a busy machine ends processes slowly
    while _tagged(f"TORCHRUN_TAG={tag}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _tagged(f"TORCHRUN_TAG={tag}"), "a rank outlived the launch"


def _tagged(item: str) -> set[int]:
    """Running processes whose environment holds `item` (the ranks inherit the launch's)."""
    out = set()
    for entry in os.listdir("/proc"):
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if item.encode() in env and state != "Z":
            out.add(int(entry))
    return out
