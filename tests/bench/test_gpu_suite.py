"""bench/gpu_suite.sh --smoke on the CPU runs every step (env, the gpu-marked tests, kernels with its FP8 table, the
plan beside a measured step, a short training run and its table, e2e) into one folder with a summary, and
bench/e2e.py --preset tiny prints the ours-vs-HF and real-vs-mock ratios after checking both models' losses
agree; with a spent --budget every step is skipped and said so in the summary, written all the same.  Slow: one test of ~75 s on a
quiet 2-core machine (most of it the e2e step and the test collection of `pytest -m gpu`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# the whole smoke suite in subprocesses: left out of the fast tier (`-m "not slow"`)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = ("env", "pytest", "kernels", "plan", "train_eager", "e2e")


def test_gpu_suite_smoke_runs_every_step(tmp_path):
    out = tmp_path / "suite"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_suite.sh"), "--smoke", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    summary = (out / "summary.md").read_text()
    assert done.returncode == 0, summary + done.stdout[-3000:] + done.stderr[-3000:]
    rows = [
        line.split("|")[1:3]
        for line in summary.split("\n## ")[0].splitlines()  # the steps' table, not the sections
        if line.startswith("| ")
        and "| seconds |" not in line
        and line.split("|")[1].strip() in STEPS
    ]
    assert [(n.strip(), s.strip().startswith("ok")) for n, s in rows] == [
        (n, True) for n in STEPS
    ], summary
    # the FP8 table: 4 smoke rows of 18 cells, checked before timing
    kernels = (out / "kernels.log").read_text()
    assert (
        "| fp8 ours fwd TF/s |" in kernels
        and "torch._scaled_grouped_mm MXFP8: absent on cpu" in kernels
    )
    assert (
        len(
            [
                line
                for line in kernels.splitlines()
                if line.startswith("| smoke |") and line.count("|") == 19
            ]
        )
        == 4
    )
    assert "smoke: the torch mxfp8 column's operands through backend='emulate'" in kernels
    e2e = (out / "e2e.log").read_text()
    assert "LM loss on one micro-batch before any step: ours" in e2e  # compared before timing
    assert "ours/HF: tokens/s" in e2e and "| image_free |" in e2e and "| random_pixels |" in e2e
    assert "ours/HF: tokens/s" in summary and "random_pixels vs real" in summary
    records = [
        json.loads(line)
        for line in (out / "work" / "train_eager" / "metrics.jsonl").read_text().splitlines()
    ]
    # the data.mock of the run, in every record
    assert records and all(r["mock"] == "none" for r in records)


def test_gpu_suite_budget_spent_skips_every_step(tmp_path):
    out = tmp_path / "suite"
    done = subprocess.run(
        [
            "bash",
            str(REPO / "bench" / "gpu_suite.sh"),
            "--smoke",
            "--budget",
            "0",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    summary = (out / "summary.md").read_text()
    assert done.returncode == 1, done.stdout + done.stderr
    assert "budget 0 s" in summary
    for name in STEPS:
        assert f"| {name} | skipped (budget: 0 s left) |" in summary, summary
    bad = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_suite.sh"), "--budget", "ten"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and "--budget takes whole seconds, got ten" in bad.stderr
