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
    assert codes == [1, 2, 70, 0]  # a crash is a bug: 70, never 1 (the loss did not fall)
    got = read_statuses(root)
    assert {j: (r["status"], r["exit_code"], r["reason"]) for j, r in got.items()} == {
        0: ("failed", 1, "FAIL: loss did not fall (first 3 steps 6.9, last 3 7.1)"),
        1: ("failed", 2, "config error: model.num_layers=0 must be an integer >= 1"),
        2: ("failed", 70, "ValueError: a bug with two lines"),
        3: ("ok", 0, None),
    }
    assert got[3]["run_dir"] == str(root / "3") and got[3]["overrides"] == ["job=3"]
    err = capsys.readouterr().err
    assert "Traceback" in err and "sweep job 2 failed (exit 70: ValueError: a bug" in err
    assert "moevlm stopped on an unexpected ValueError: a bug" in err
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


# ------------------------------------------------ sweeps are ours alone: a folder and status files each
def _frozen_clock(monkeypatch):
    """Hydra's ${now:} resolver (which names the default sweep folder) reads this frozen clock: every
    sweep started now starts "in the same second"."""
    import datetime as dt

    import hydra.core.utils as hydra_utils

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 11, 29, 3, 30, 0)

    monkeypatch.setattr(hydra_utils, "datetime", Frozen)
    hydra_utils.setup_globals()


def _sweep_config(tmp_path, run_dir=""):
    from omegaconf import OmegaConf

    pattern = str(tmp_path / "multirun" / "${now:%Y-%m-%d}" / "${now:%H-%M-%S}")
    return OmegaConf.create({"train": {"run_dir": run_dir}, "hydra": {"sweep": {"dir": pattern}}})


def _train(lr):
    """A job as the trainer runs it: claims its run directory, "resumes" a finished run there (0 steps,
    exit 0: the issue's failure when two sweeps shared a folder), else trains and records its lr."""

    def job(run_dir):
        from moevlm.train.run_dir import RunDir

        claim = RunDir.claim(run_dir)
        done = claim.path / "done.json"
        if not done.exists():
            done.write_text(json.dumps({"lr": lr}))
        claim.release()
        return 0

    return job


def test_two_sweeps_in_the_same_second_get_two_folders(tmp_path, monkeypatch, capsys):
    from moevlm.train.sweep import claimed_root

    _frozen_clock(monkeypatch)
    first, second = _sweep_config(tmp_path), _sweep_config(tmp_path)
    assert first.hydra.sweep.dir == second.hydra.sweep.dir  # the clock is frozen
    named = first.hydra.sweep.dir
    a, b = SweepStatus(), SweepStatus()
    a.on_multirun_start(first)
    root_a = a.claim.path
    b.on_multirun_start(second)
    root_b = b.claim.path
    assert (str(root_a), str(root_b)) == (named, named + "-1") and claimed_root() == root_b
    # Hydra's launcher writes multirun.yaml in, and train.py's jobs run under, the folder claimed
    assert (first.hydra.sweep.dir, second.hydra.sweep.dir) == (str(root_a), str(root_b))
    for root, lr in ((root_a, 1e-3), (root_b, 3e-4)):  # interleaved as two live sweeps would be
        for job in (0, 1):
            assert run_job(lambda: _train(lr)(root / str(job)), root, job, root / str(job), []) == 0
    for root, lr in ((root_a, 1e-3), (root_b, 3e-4)):
        records = read_statuses(root)
        assert sorted(records) == [0, 1] and {r["status"] for r in records.values()} == {"ok"}
        for job, record in records.items():  # every ok job trained in a folder of its own sweep
            assert record["run_dir"] == str(root / str(job))
            assert json.loads((root / str(job) / "done.json").read_text()) == {"lr": lr}
    a.on_multirun_end(first)
    b.on_multirun_end(second)
    out = capsys.readouterr().out
    assert f"all ok (table: python bench/sweep_table.py {root_a})" in out
    assert f"all ok (table: python bench/sweep_table.py {root_b})" in out


SWEEP_HOLD = (
    "import sys, time; from omegaconf import OmegaConf; from moevlm.train.sweep import SweepStatus, "
    "run_job; c = OmegaConf.create({'train': {'run_dir': sys.argv[1]}, 'hydra': {'sweep': {'dir': "
    "'unused'}}}); s = SweepStatus(); s.on_multirun_start(c); run_job(lambda: 0, s.claim.path, 0, "
    "s.claim.path / '0', []); print('held', flush=True); time.sleep(120)"
)


def test_a_second_sweep_on_one_run_dir_is_refused(tmp_path, capsys):
    """Sweep A (another process) holds train.run_dir: sweep B is refused with one line and exit 2, and
    A's status files are left as they were; once A has ended, B may use the folder."""
    import subprocess

    root = tmp_path / "lr_sweep"
    holder = subprocess.Popen(
        [sys.executable, "-c", SWEEP_HOLD, str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = (root / "status" / "0.json").read_bytes()
        config = _sweep_config(tmp_path, run_dir=str(root))
        b = SweepStatus()
        with pytest.raises(SystemExit) as stop:
            b.on_multirun_start(config)
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(
            f"config error: train.run_dir={root} is in use by another launch (host "
        )
        assert f"pid {holder.pid}" in err[0]
        assert (root / "status" / "0.json").read_bytes() == before
    finally:
        holder.kill()
        holder.wait()
    b = SweepStatus()
    b.on_multirun_start(config)  # A has ended: B takes the folder and starts with no records
    assert b.claim.path == root and read_statuses(root) == {}
    b.on_multirun_end(config)
    # a hydra.sweep.dir the user named is taken as named too (a relaunch resumes its jobs), not moved
    from omegaconf import OmegaConf

    named = OmegaConf.create({"train": {"run_dir": ""}, "hydra": {"sweep": {"dir": str(root)}}})
    c = SweepStatus()
    c.on_multirun_start(named)
    assert c.claim.path == root
    c.on_multirun_end(named)


def test_a_failed_job_is_never_reported_ok(tmp_path, capsys):
    """Even if its record were overwritten with `ok`, the sweep's code says a job of this sweep failed."""
    config = _sweep_config(tmp_path, run_dir=str(tmp_path / "s"))
    callback = SweepStatus()
    callback.on_multirun_start(config)
    root = callback.claim.path
    assert run_job(_config_error, root, 0, root / "0", []) == 2
    record = json.loads((root / "status" / "0.json").read_text())
    (root / "status" / "0.json").write_text(json.dumps({**record, "status": "ok", "exit_code": 0}))
    with pytest.raises(SystemExit) as stop:
        callback.on_multirun_end(config)
    assert stop.value.code == 2
    assert "but a job of this sweep failed (exit 2)" in capsys.readouterr().err
