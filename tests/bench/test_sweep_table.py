"""bench/sweep_table.py on a real tiny CPU sweep (3 jobs, the first a config error): the sweep runs the
other two and ends with the failed job's code and one summary line; one row per job, the swept key's
values from each job's config, medians from its metrics, the failure with its code and reason from its
status record.  Without a launch: the job order of a config's sweep (hydra.sweeper.params) first, a sweep
narrowed on the command line lists only its jobs, and the running / killed / not-run records."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import sweep_table

GBS = "config error: train.global_batch_size=2 must be a multiple of micro_batch_size x dp = 3 x 1 = 3"


def _rows(text: str) -> list[list[str]]:
    """The table's rows, cut at the `|` that are not escaped."""
    lines = text.splitlines()
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))] for line in lines[4:]]


@pytest.mark.slow
def test_a_sweep_outlives_its_failed_job_and_the_table_shows_it(tmp_path):
    sweep = tmp_path / "sweep"
    # one torch thread: the tiny model gains nothing from a second (tests/train/conftest.py)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "-m",
        "train.micro_batch_size=3,1,2",
        "train.steps=2",
        "data.num_workers=0",
        "train.checkpoint_at_end=false",
        "train.tensorboard=false",
        f"hydra.sweep.dir={sweep}",
    ]
    done = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    # the first job's code; its line, then the others ran; one summary line naming the failure
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"sweep job 0 failed (exit 2: {GBS}" in done.stderr and "going on" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    (last,) = [line for line in done.stderr.splitlines() if line.startswith("sweep: ")]
    assert last.startswith(f"sweep: 3 jobs, 1 failed, 2 ok: job 0 (failed, exit 2: {GBS}")
    assert f"python bench/sweep_table.py {sweep}" in last
    status = {int(p.stem): json.loads(p.read_text()) for p in (sweep / "status").glob("*.json")}
    assert {j: (r["status"], r["exit_code"]) for j, r in status.items()} == {
        0: ("failed", 2),
        1: ("ok", 0),
        2: ("ok", 0),
    }
    assert status[0]["reason"].startswith(GBS) and status[1]["reason"] is None
    assert (
        status[2]["run_dir"] == str(sweep / "2")
        and "train.micro_batch_size=2" in (status[2]["overrides"])
    )
    assert not (sweep / "0").exists() and (sweep / "1" / "metrics.jsonl").is_file()

    assert sweep_table.main([str(sweep), "--warmup", "1", "--out", str(tmp_path / "t.md")]) == 0
    text = (tmp_path / "t.md").read_text()
    assert text.splitlines()[2].startswith(
        "| job | train.micro_batch_size | status | steps | tokens/s | TFLOP/s |"
    )
    rows = _rows(text)
    assert len(rows) == 3
    assert rows[0][:2] == ["0", "3"] and rows[0][2].startswith(f"failed (exit 2: {GBS}")
    assert [r[:4] for r in rows[1:]] == [["1", "1", "ok", "2"], ["2", "2", "ok", "2"]]
    assert all(float(r[4]) > 0 and float(r[5]) > 0 for r in rows[1:])  # tokens/s, TFLOP/s medians


def test_a_sweep_narrowed_on_the_command_line_lists_only_its_jobs(tmp_path):
    """sweep_tuning's comment: a key on the command line replaces the config's list in its place, as
    Hydra's basic sweeper runs it; a folder of an earlier sweep is not a job; each record's status."""
    (tmp_path / "multirun.yaml").write_text(
        yaml.safe_dump(
            {
                "hydra": {
                    "sweeper": {
                        "params": {
                            "train.micro_batch_size": "1,2",
                            "model.recompute": "none,selective,full",
                            "train.compile": "false,true",
                        }
                    },
                    "overrides": {
                        "task": ["+experiment=sweep_tuning", "train.compile=true", "optim.lr=1,2"]
                    },
                }
            },
            sort_keys=False,
        )
    )
    keys, jobs = sweep_table.planned_jobs(tmp_path)
    assert keys == ["train.micro_batch_size", "model.recompute", "optim.lr"]
    assert len(jobs) == 12 and jobs[1] == {
        "train.micro_batch_size": "1",
        "model.recompute": "none",
        "optim.lr": "2",
    }
    (tmp_path / "12").mkdir()  # an earlier, wider sweep's job in the same folder
    status = tmp_path / "status"
    status.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    records = {
        0: {"status": "ok", "exit_code": 0},
        1: {"status": "failed", "exit_code": 1, "reason": "FAIL: loss did not fall | x"},
        2: {"status": "running", "pid": os.getpid(), "host": sweep_table.socket.gethostname()},
        3: {"status": "running", "pid": dead.pid, "host": sweep_table.socket.gethostname()},
        4: {"status": "running", "pid": 1, "host": "elsewhere"},
        5: {"status": "interrupted", "exit_code": 4, "reason": "interrupted by SIGTERM"},
    }
    for job, record in records.items():
        (status / f"{job}.json").write_text(json.dumps(record))
    rows = _rows(sweep_table.build_table(tmp_path))
    assert [r[0] for r in rows] == [str(i) for i in range(12)]
    assert [r[4] for r in rows[:7]] == [
        "ok",
        "failed (exit 1: FAIL: loss did not fall \\| x)",
        f"running (pid {os.getpid()})",
        f"killed (pid {dead.pid} gone, no exit recorded)",
        "running or killed (pid 1 on elsewhere)",
        "interrupted (exit 4: interrupted by SIGTERM)",
        "not run (the sweep stopped before it)",
    ]


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
