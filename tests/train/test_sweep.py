"""moevlm.train.sweep in one process: whatever a sweep job does (returns a code after its message, exits,
crashes, is interrupted), its record says so with the reason and the sweep goes on, except after a stop
signal; the summary names the failures and carries the first failed job's code.  (The whole path through
train.py and Hydra: tests/bench/test_sweep_table.py.)"""

import json
import sys

import pytest

from moevlm.train.sweep import SweepStatus, read_statuses, run_job, summary, sweep_probes


def _fail_loss():
    print("step 6/6 | loss 7.1")
    print("FAIL: loss did not fall (first 3 steps 6.9, last 3 7.1)")
    return 1


def _config_error():
    print("config error: model.num_layers=0 must be an integer >= 1", file=sys.stderr)
    sys.exit(2)


def _crash():
    raise ValueError("a bug\nwith two lines")


def _progress_then_ok():
    sys.stderr.write("\r 50%|#####     | 1/2\r100%|##########| 2/2")
    print("done: 2 steps")
    return 0


def test_each_outcome_is_recorded_and_the_sweep_goes_on(tmp_path, capsys):
    root = tmp_path / "sweep"
    jobs = [_fail_loss, _config_error, _crash, _progress_then_ok]
    codes = [run_job(fn, root, i, root / str(i), [f"job={i}"]) for i, fn in enumerate(jobs)]
    assert codes == [1, 2, 1, 0]
    got = read_statuses(root)
    assert {j: (r["status"], r["exit_code"], r["reason"]) for j, r in got.items()} == {
        0: ("failed", 1, "FAIL: loss did not fall (first 3 steps 6.9, last 3 7.1)"),
        1: ("failed", 2, "config error: model.num_layers=0 must be an integer >= 1"),
        2: ("failed", 1, "ValueError: a bug with two lines"),
        3: ("ok", 0, None),
    }
    assert got[3]["run_dir"] == str(root / "3") and got[3]["overrides"] == ["job=3"]
    err = capsys.readouterr().err
    assert "Traceback" in err and "sweep job 2 failed (exit 1: ValueError: a bug" in err
    line, code = summary(root)
    assert code == 1 and line.startswith(
        "sweep: 4 jobs, 3 failed, 1 ok: job 0 (failed, exit 1: FAIL"
    )
    assert "job 1 (failed, exit 2: config error: model.num_layers=0" in line
    assert sys.stdout is not None and type(sys.stdout).__name__ != "_Tee"  # the streams are back

    # the callback: the sweep's code and line at its end; the next sweep starts with no records
    config = {"train": {"run_dir": str(root)}, "hydra": {"sweep": {"dir": str(tmp_path)}}}
    from omegaconf import OmegaConf

    config = OmegaConf.create(config)
    with pytest.raises(SystemExit) as stop:
        SweepStatus().on_multirun_end(config)
    assert stop.value.code == 1 and capsys.readouterr().err.strip() == line
    SweepStatus().on_multirun_start(config)
    assert read_statuses(root) == {}
    assert summary(root) == (
        f"sweep: 0 jobs, all ok (table: python bench/sweep_table.py {root})",
        0,
    )


@pytest.mark.parametrize("code", [4, 130])
def test_an_interrupted_job_ends_the_sweep(tmp_path, capsys, code):
    with pytest.raises(SystemExit) as stop:
        run_job(lambda: code, tmp_path, 0, tmp_path / "0", [])
    assert stop.value.code == code
    record = json.loads((tmp_path / "status" / "0.json").read_text())
    assert record["status"] == "interrupted" and record["exit_code"] == code
    assert "the jobs after it were not run" in capsys.readouterr().err


def test_another_rank_writes_nothing_and_exits_with_its_own_code(tmp_path, monkeypatch, capsys):
    """Under torchrun every rank runs the sweep; rank 0 keeps the records, the others their own codes."""
    from omegaconf import OmegaConf

    monkeypatch.setenv("RANK", "1")
    config = OmegaConf.create(
        {"train": {"run_dir": ""}, "hydra": {"sweep": {"dir": str(tmp_path)}}}
    )
    callback = SweepStatus()
    callback.on_multirun_start(config)
    assert run_job(lambda: 0, tmp_path, 0, tmp_path / "0", []) == 0
    assert run_job(_config_error, tmp_path, 1, tmp_path / "1", []) == 2
    assert not (tmp_path / "status").exists() and "sweep job" not in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        callback.on_multirun_end(config)
    assert stop.value.code == 2


def test_sweep_probes_use_each_value_once():
    assert sweep_probes(["a.x=1,2,3", "b.y=4,5", "+experiment=e", "c.z='{p,q}'"]) == [
        ["a.x=1", "b.y=4", "+experiment=e", "c.z='{p,q}'"],
        ["a.x=2", "b.y=4", "+experiment=e", "c.z='{p,q}'"],
        ["a.x=3", "b.y=4", "+experiment=e", "c.z='{p,q}'"],
        ["a.x=1", "b.y=5", "+experiment=e", "c.z='{p,q}'"],
    ]
    assert sweep_probes(["a.x=interval(1,4)"]) == []  # Hydra's basic sweeper says what it cannot do
