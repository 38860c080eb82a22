"""bench/sweep_table.py on a real tiny CPU sweep (3 jobs, the last a config error that ends the sweep):
one row per job, the swept key's values from each job's config, medians from its metrics, and the
missing job listed, not dropped; the job order of a config's sweep (hydra.sweeper.params) first."""

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import sweep_table


def test_tiny_sweep_becomes_one_table(tmp_path):
    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "-m",
        "train.micro_batch_size=1,2,3",
        "train.steps=3",
        "data.num_workers=0",
        "train.checkpoint_at_end=false",
        "train.tensorboard=false",
        "train.require_loss_decrease=false",
        f"hydra.sweep.dir={sweep}",
    ]
    done = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 2 and "config error: train.global_batch_size=2" in done.stderr, (
        done.stderr[-2000:]
    )
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "sweep_table.py"),
            str(sweep),
            "--warmup",
            "1",
            "--out",
            str(tmp_path / "t.md"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    lines = (tmp_path / "t.md").read_text().splitlines()
    assert lines[2].startswith(
        "| job | train.micro_batch_size | status | steps | tokens/s | TFLOP/s |"
    )
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[4:]]
    assert [r[:4] for r in rows[:2]] == [["0", "1", "ok", "3"], ["1", "2", "ok", "3"]]
    assert all(float(r[4]) > 0 and float(r[5]) > 0 for r in rows[:2])  # tokens/s, TFLOP/s medians
    assert rows[2][:3] == [
        "2",
        "3",
        "missing (no run dir: failed before it started, or the sweep stopped)",
    ]
    assert len(rows) == 3


def test_a_configs_sweep_comes_before_the_command_lines(tmp_path):
    (tmp_path / "multirun.yaml").write_text(
        yaml.safe_dump(
            {
                "hydra": {
                    "sweeper": {"params": {"model.recompute": "none,full"}},
                    "overrides": {"task": ["train.steps=30", "train.compile=false,true"]},
                }
            }
        )
    )
    keys, jobs = sweep_table.planned_jobs(tmp_path)
    assert keys == ["model.recompute", "train.compile"]
    assert jobs == [
        {"model.recompute": "none", "train.compile": "False"},
        {"model.recompute": "none", "train.compile": "True"},
        {"model.recompute": "full", "train.compile": "False"},
        {"model.recompute": "full", "train.compile": "True"},
    ]
    table = sweep_table.build_table(tmp_path)
    assert table.count("missing") == 4 and "| 3 | full | True | missing" in table
