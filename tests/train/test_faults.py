"""Pre-emption, interrupts, collective timeouts and the step watchdog (moevlm.train.faults).

Pure logic runs without processes (a fake clock); the exit paths that end a
process (second signal, watchdog abort) run in small subprocesses; the trainer
is interrupted in-process (and resumed to the uninterrupted losses) and under
torchrun with 2 gloo ranks: a SIGTERM to one rank's process tree stops both
after the same step with one checkpoint, and a SIGSTOPped rank makes the other
report the stall and exit with the timeout line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from moevlm.config import compose_job
from moevlm.data.sample_cache import sample_dir
from moevlm.train.checkpoint import CheckpointManager
from moevlm.train.exit_codes import MEANINGS, ExitCode
from moevlm.train.faults import WARMUP_STEPS, StepWatchdog, StopSignals, describe_failure
from moevlm.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
# data.streams=2 fixes the rows of each global batch for one process and for 2 data-parallel ranks alike
COMMON = [
    "data.num_workers=1",
    "data.streams=2",
    "train.global_batch_size=2",
    "train.log_every=1",
    "train.tensorboard=false",
    "train.require_loss_decrease=false",
    "train.checkpoint_at_end=false",
]
STEPS = 4


def losses(run_dir: Path) -> dict[int, float]:
    return {
        r["step"]: float(r["loss"])
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's per-step losses (one process, in-process)."""
    run_dir = tmp_path_factory.mktemp("ref")
    trainer = Trainer(compose_job(COMMON + [f"train.steps={STEPS}", f"train.run_dir={run_dir}"]))
    assert trainer.run() == 0
    return losses(run_dir), sample_dir()


# ------------------------------------------------------------------ pure logic
class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_exit_codes_are_the_readme_table():
    """The numbers are the interface scripts branch on: docs/faults.md's "Exit codes", one name each."""
    readme = " ".join((REPO / "docs/faults.md").read_text().split())
    assert {c.name: int(c) for c in ExitCode} == {
        "OK": 0,
        "NO_PROGRESS": 1,
        "CONFIG": 2,
        "NONFINITE": 3,
        "INTERRUPTED": 4,
        "COLLECTIVE": 5,
        "WATCHDOG": 6,
        "CHECKPOINT": 7,
        "DATA": 8,
        "DOES_NOT_FIT": 9,
        "OUT_OF_MEMORY": 10,
        "BUG": 70,
    }
    assert (
        "Exit codes: 0 done, 1 the loss did not fall" in readme
        and "8 the data cannot feed training" in readme
        and "70 an unexpected exception" in readme
    )
    # README.md's table is exit_codes.MEANINGS, row for row; docs/faults.md's lists the same codes
    assert _table(REPO / "README.md", "## Exit codes") == MEANINGS
    assert list(_table(REPO / "docs/faults.md", "## Exit codes")) == list(MEANINGS)


def _table(path: Path, heading: str) -> dict[str, str]:
    """{first cell: second cell} of the first Markdown table after `heading`."""
    text = path.read_text().split(heading, 1)[1]
    rows = [x for x in text.split("\n\n| ", 1)[1].split("\n\n")[0].splitlines()]
    cells = [
        [c.strip() for c in ("| " + r if i == 0 else r).strip("|").split("|")]
        for i, r in enumerate(rows)
    ]
    return {c[0]: c[1] for c in cells[2:]}


# each code of the README's table -> tests that assert a launch (or the code path that decides it)
# ends with it, and a word of that test's source that is the assertion
PRODUCED_BY = {
    "0": [
        (
            "tests/train/test_export.py",
            "test_a_refusal_at_the_end_of_a_run_is_one_line_and_exit_7",
            "== 0",
        )
    ],
    "1": [("tests/train/test_faults.py", "test_a_loss_that_did_not_fall_exits_1", "NO_PROGRESS")],
    "2": [
        ("tests/train/test_trainer.py", "test_config_error_exits_2_with_the_message_only", "== 2"),
        ("tests/train/test_sweep.py", "test_a_second_sweep_on_one_run_dir_is_refused", "== 2"),
        (
            "tests/train/test_launch_mistakes.py",
            "test_a_launch_environment_mistake_is_one_line_at_once",
            "== 2",
        ),
        (
            "tests/train/test_launch_mistakes.py",
            "test_train_py_says_a_truncated_weight_file_in_one_line",
            "== 2",
        ),
        (
            "tests/data/test_sample_cache_damage.py",
            "test_a_cache_that_is_a_file_is_one_line_and_exit_2",
            "== 2",
        ),
        (
            "tests/plan/test_cli_options.py",
            "test_a_bad_option_is_one_line_and_exit_2",
            "ExitCode.CONFIG",
        ),
        (
            "tests/data/test_build_shards_inputs.py",
            "test_a_non_regular_annotation_file_says_what_it_is",
            "== 2",
        ),
    ],
    "3": [
        ("tests/train/test_honest_end.py", "", "ExitCode.NONFINITE"),
        (
            "tests/train/test_ruined_runs.py",
            "test_a_huge_lr_exits_3_naming_why",
            "ExitCode.NONFINITE",
        ),
    ],
    "4": [
        (
            "tests/train/test_faults.py",
            "test_sigterm_checkpoints_after_the_step_and_a_relaunch_continues_exactly",
            "ExitCode.INTERRUPTED",
        )
    ],
    "5": [("tests/train/test_stop_faults.py", "", "ExitCode.COLLECTIVE")],
    "6": [
        (
            "tests/train/test_faults.py",
            "test_watchdog_abort_and_a_second_signal_end_the_process_with_their_codes",
            "ExitCode.WATCHDOG",
        )
    ],
    "7": [
        (
            "tests/train/test_write_failures.py",
            "test_a_checkpoint_write_failure_mid_run_is_one_line_and_exit_7",
            "ExitCode.CHECKPOINT",
        ),
        (
            "tests/train/test_export.py",
            "test_a_refusal_at_the_end_of_a_run_is_one_line_and_exit_7",
            "== 7",
        ),
        (
            "tests/train/test_nothing_lost.py",
            "test_a_tensorboard_failure_never_skips_the_due_checkpoint",
            "ExitCode.CHECKPOINT",
        ),
    ],
    "8": [
        ("tests/train/test_worker_death.py", "", "ExitCode.DATA"),
        (
            "tests/train/test_checkpoint_integrity.py",
            "test_data_problems_on_resume_or_in_training_end_in_one_line",
            "exit_code == ExitCode.DATA",
        ),
    ],
    "9": [("tests/plan/test_cli.py", "", "ExitCode.DOES_NOT_FIT")],
    "10": [
        (
            "tests/train/test_write_failures.py",
            "test_out_of_memory_in_a_step_is_one_line_and_exit_10",
            "ExitCode.OUT_OF_MEMORY",
        )
    ],
    "70": [
        (
            "tests/train/test_write_failures.py",
            "test_an_unexpected_exception_prints_its_traceback_and_exits_70",
            "ExitCode.BUG",
        ),
        ("tests/train/test_sweep.py", "test_each_outcome_is_recorded_and_the_sweep_goes_on", "70"),
    ],
    "128+signum": [
        (
            "tests/train/test_faults.py",
            "test_watchdog_abort_and_a_second_signal_end_the_process_with_their_codes",
            "128 + signal.SIGTERM",
        )
    ],
    "137": [
        (
            "tests/train/test_torchrun_config_error.py",
            "test_config_error_is_the_last_line_under_torchrun",
            "returncode == -9",
        )
    ],
}


def test_every_listed_code_is_produced_by_a_test():
    """A code of the README's table that no test produces fails here; so does a test named below that
    is gone or no longer asserts its code."""
    assert set(PRODUCED_BY) == set(MEANINGS), set(MEANINGS) ^ set(PRODUCED_BY)
    for code, tests in PRODUCED_BY.items():
        assert tests, code
        for path, name, word in tests:
            source = (REPO / path).read_text()
            if name:  # the test's own body holds the assertion
                assert f"def {name}(" in source, (code, path, name)
                source = source.split(f"def {name}(", 1)[1].split("\ndef ", 1)[0]
            assert word in source, (code, path, name, word)


def test_a_loss_that_did_not_fall_exits_1():
    """The end of a run with train.require_loss_decrease (moevlm.train.report.summary): 1 and the FAIL
    line when the mean of the last 3 updating steps is not below the first 3's."""
    from types import SimpleNamespace

    from moevlm.train.report import summary

    said = []
    tr = SimpleNamespace(
        updated_losses=[6.9, 6.9, 6.9, 7.0, 7.1, 7.1],
        plan=SimpleNamespace(train=SimpleNamespace(require_loss_decrease=True)),
        log=SimpleNamespace(info=said.append),
        loader=SimpleNamespace(stats=lambda: {}),
        compiled=None,
    )
    assert summary(tr, 1.0, 6) == ExitCode.NO_PROGRESS == 1
    assert said[-1] == "FAIL: loss did not fall (first 3 steps 6.9000, last 3 7.0667)"
    tr.updated_losses = tr.updated_losses[::-1]
    assert summary(tr, 1.0, 6) == ExitCode.OK


def test_watchdog_reports_a_slow_step_once_after_warmup_and_aborts_past_abort_s():
    clock, reports, aborts = Clock(), [], []
    w = StepWatchdog(10, 5, 100, clock=clock, report=reports.append, abort=aborts.append)
    # warm-up steps are slow (compile)
    for step, seconds in enumerate([50.0, 30.0, 1.0, 2.0, 1.5], start=1):
        w.begin_step(step)
        clock.now += seconds
        w.poll()
        w.end_step()
    assert reports == [] and aborts == []  # 50 s and 30 s were warm-up: not timed, not reported
    assert list(w.times) == [1.0, 2.0, 1.5] and w.limit() == 15.0  # 10 x median 1.5
    w.begin_step(6)
    w.at("forward/backward")
    clock.now += 14.0
    w.poll()
    assert reports == []
    clock.now += 2.0  # 16 s > 15 s
    w.poll()
    w.poll()
    assert len(reports) == 1 and "step 6 (forward/backward) has run 16s" in reports[0]
    clock.now += 90.0  # 106 s > abort_s
    w.poll()
    assert (
        len(aborts) == 1
        and "step 6 (forward/backward) has run 106s > train.watchdog_abort_s=100s" in aborts[0]
    )
    assert f"exit code {ExitCode.WATCHDOG:d}" in aborts[0]


def test_watchdog_minimum_warmup_and_phases_outside_steps():
    clock, reports, aborts = Clock(), [], []
    w = StepWatchdog(10, 60, 200, clock=clock, report=reports.append, abort=aborts.append)
    for step in range(1, WARMUP_STEPS + 1):
        w.begin_step(step)
        clock.now += 0.1
        w.end_step()
    assert w.limit() is None  # nothing timed yet: never reported, however long
    w.begin_step(WARMUP_STEPS + 1)
    clock.now += 150
    w.poll()
    assert reports == [] and aborts == []
    w.end_step()
    assert w.limit() == 1500  # 10 x 150
    w.at("checkpoint save", 3)  # outside a step: its own clock, never compared to steps
    clock.now += 199
    w.poll()
    assert reports == [] and aborts == [] and w.describe() == "checkpoint save after step 3"
    clock.now += 2
    w.poll()
    assert "checkpoint save after step 3 has run 201s" in aborts[0]
    fast = StepWatchdog(10, 60, None, clock=clock, report=reports.append)
    for step in range(1, 5):
        fast.begin_step(step)
        clock.now += 0.01
        fast.end_step()
    assert fast.limit() == 60  # the minimum, not 10 x 0.01 s
    fast.at(
        "stop-flag all-reduce", 4, watched=True
    )  # a collective between steps: held to the step limit
    clock.now += 61
    fast.poll()
    assert (
        len(reports) == 1
        and "watchdog: stop-flag all-reduce after step 4 has run 61s, over 10" in reports[0]
    )
    fast.at("logging")  # an unwatched phase: its own clock, not reported
    clock.now += 100
    fast.poll()
    assert len(reports) == 1


def test_stop_signals_first_asks_repeat_within_window_is_the_same_and_handlers_come_back(capsys):
    clock = Clock()
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    s = StopSignals(lambda: "step 7 (forward/backward)", clock=clock)
    assert s.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 60  # the reading thread notes it; wide for a busy machine
        while not s.requested and time.time() < deadline:
            time.sleep(0.01)
        assert s.requested == signal.SIGTERM
        clock.now += 1.0
        s.on_signal(signal.SIGINT)  # within the repeat window (a launcher forwarding it): no exit
    finally:
        s.close()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert signal.set_wakeup_fd(-1) == -1  # the wakeup fd was restored too
    err = capsys.readouterr().err
    assert (
        err.count("received") == 1
        and "received SIGTERM: finishing step 7 (forward/backward)" in err
    )
    box = []
    t = threading.Thread(target=lambda: box.append(StopSignals(str).install()))
    t.start()
    t.join()
    assert box == [False]  # only the main thread installs handlers


def test_collective_failures_are_recognised_and_others_are_not():
    timeout = RuntimeError(
        "[gloo/transport/tcp/pair.cc:534] Timed out waiting 5000ms for recv operation to complete"
    )
    line = describe_failure(timeout, "step 12 (forward/backward)", 5.2, 5)
    assert line.startswith(
        "collective failure during step 12 (forward/backward), 5s in: a collective got no "
        "answer within parallel.timeout_s=5s. Likely cause: another rank stopped, crashed"
    )
    lost = RuntimeError(
        "[gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.2]:12345"
    )
    assert "lost its connection to a peer rank" in describe_failure(
        lost, "checkpoint save", None, 600
    )
    assert describe_failure(ValueError("shapes do not match"), "step 1", 1, 600) is None
    assert describe_failure(TimeoutError("reading the shard timed out"), "step 1", 1, 600) is None
    assert (
        describe_failure(
            RuntimeError("DataLoader timed out after 5 seconds (worker 0)"), "step 1", 1, 600
        )
        is None
    )
    nccl = RuntimeError("NCCL communicator was aborted on rank 3 after a collective timeout")
    assert "no answer within" in describe_failure(nccl, "step 1 (forward/backward)", 600, 600)


# ------------------------------------------------------------------ processes ending themselves
def _python(code: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_watchdog_abort_and_a_second_signal_end_the_process_with_their_codes():
    abort = _python(
        "import time\nfrom moevlm.train.faults import StepWatchdog\n"
        "w = StepWatchdog(10, 60, 0.5)\nw.begin_step(3)\nw.at('forward/backward')\n"
        "w.start(every_s=0.05)\ntime.sleep(60)"
    )
    second = _python(
        "import os, signal, time\nfrom moevlm.train.faults import StopSignals\n"
        "s = StopSignals(lambda: 'step 4 (forward/backward)', repeat_window_s=0.5)\ns.install()\n"
        "print('ready', flush=True)\ntime.sleep(60)"
    )
    assert second.stdout.readline().strip() == "ready"
    second.send_signal(signal.SIGTERM)
    time.sleep(1.0)  # past the repeat window
    t0 = time.time()
    second.send_signal(signal.SIGTERM)
    # at once: well before the script's 60 s sleep ends (a wide bound: a busy machine delays the exit)
    out = second.communicate(timeout=40)[0]
    assert second.returncode == 128 + signal.SIGTERM and time.time() - t0 < 30, out
    assert "received SIGTERM: finishing step 4 (forward/backward), then writing a checkpoint" in out
    assert (
        "received SIGTERM again: exiting at once during step 4 (forward/backward), without a checkpoint "
        "(exit code 143)" in out
    )
    out = abort.communicate(timeout=60)[0]
    assert abort.returncode == ExitCode.WATCHDOG, out
    assert (
        "watchdog: step 3 (forward/backward) has run 1s > train.watchdog_abort_s=0.5s: aborting"
        in out
    )
    assert "Thread 0x" in out and "in <module>" in out  # every thread's stack (faulthandler)


def test_data_workers_and_fork_server_outlive_a_stop_signal(reference):
    """Ctrl-C and a scheduler's SIGTERM reach every process of the job: the loader's fork server and workers
    ignore them (the trainer still needs its step's rows), and end with the trainer (moevlm.data.loader)."""
    from moevlm.config import validate
    from moevlm.data.loader import build_loader

    _, shards = reference
    job = compose_job(COMMON + [f"data.shards={shards}"])
    loader = build_loader(OmegaConf.to_object(job.data), validate(job).model)
    try:
        next(loader)
        servers = [p for p in _children(os.getpid()) if b"forkserver" in _cmdline(p)]
        helpers = servers + [c for p in servers for c in _children(p)]
        # the fork server and the data worker
        assert len(servers) == 1 and len(helpers) >= 2, helpers
        for pid in helpers:
            os.kill(pid, signal.SIGINT)
            os.kill(pid, signal.SIGTERM)
        time.sleep(1.0)
        assert not any(_gone(p) for p in helpers)
        for _ in range(3):
            assert next(loader)["input_ids"].numel() > 0
    finally:
        loader.close()


def _cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


# ------------------------------------------------------------------ the trainer
@pytest.mark.parametrize("background", [False, True])
def test_sigterm_checkpoints_after_the_step_and_a_relaunch_continues_exactly(
    reference, tmp_path, capsys, background
):
    """background: train.async_checkpoint with a checkpoint after every step (step 1's may still be
    written when the signal comes): the stop waits for it and for step 2's, both complete."""
    want, shards = reference
    more = ["train.async_checkpoint=true", "train.checkpoint_every=1"] if background else []
    job = compose_job(
        COMMON
        + [f"train.steps={STEPS}", f"train.run_dir={tmp_path}", f"data.shards={shards}", *more]
    )
    trainer = Trainer(job)
    before = signal.getsignal(signal.SIGTERM)

    def preempt(tr):  # the scheduler's SIGTERM lands inside step 2
        if tr.step + 1 == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.time() + 60  # the reading thread notes it; wide for a busy machine
            while not tr.faults.signals.requested and time.time() < deadline:
                time.sleep(0.01)

    trainer.grad_hook = preempt
    assert trainer.run() == ExitCode.INTERRUPTED
    assert signal.getsignal(signal.SIGTERM) is before  # a library caller's handler is back
    captured = capsys.readouterr()
    assert "received SIGTERM: finishing step 2 (gradient reduction and clipping)" in captured.err
    ckpt = tmp_path / "checkpoints" / "step_00000002"
    assert (
        f"interrupted by SIGTERM: stopped after step 2/{STEPS} with checkpoint {ckpt}; to continue, relaunch "
        "the same command (train.resume=auto"
    ) in captured.out
    done = [p.name for p in CheckpointManager(tmp_path / "checkpoints").complete()]
    assert done == ["step_00000001", ckpt.name] if background else [ckpt.name]
    assert sorted(losses(tmp_path)) == [1, 2]
    assert Trainer(job).run() == 0  # the same command again
    got = losses(tmp_path)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-6, (got, want)


# ------------------------------------------------------------------ torchrun, 2 ranks
def _torchrun(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(REPO / "train.py"),
            *COMMON,
            *args,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


TORCHRUN_TRACEBACK = 'Traceback (most recent call last):\n  File "<frozen runpy>"'


def exit_codes(out: str) -> dict[int, int]:
    """Each failed rank's exit code, from torchrun's failure report."""
    found = re.findall(r"rank\s+:\s*(\d+) \(local_rank[^\n]*\n\s*exitcode\s+:\s*(-?\d+)", out)
    return {int(r): int(c) for r, c in found}


def _gone(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _rank_pid(torchrun_pid: int, rank: int, timeout_s: float = 120) -> int:
    """torchrun's worker for `rank`: its direct child whose environment says RANK=<rank>."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for pid in _children(torchrun_pid):
            try:
                env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return pid
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} worker under torchrun pid {torchrun_pid}")


def _tree(pid: int) -> list[int]:
    """pid and its descendants (a rank, its fork server and data workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def _wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {n}: {proc.communicate()[0][-3000:]}")


def _reader(proc: subprocess.Popen) -> tuple[list[str], threading.Thread]:
    lines: list[str] = []
    t = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    t.start()
    return lines, t


def _kill_tree(proc: subprocess.Popen) -> None:
    for pid in _tree(proc.pid)[::-1]:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    proc.wait(timeout=60)


@pytest.mark.slow
def test_two_ranks_sigterm_on_one_rank_stops_both_after_the_same_step(reference, tmp_path):
    """Only rank 1's process tree (the rank, its fork server, its data worker) gets SIGTERM, as a scheduler
    signals one node: both ranks stop after the same step, write one checkpoint, exit 4; a relaunch (here one
    process: the checkpoint reshards) continues to the uninterrupted losses."""
    want, shards = reference
    run_dir = tmp_path / "run"
    proc = _torchrun([f"train.steps={STEPS}", f"train.run_dir={run_dir}", f"data.shards={shards}"])
    try:
        rank1 = _rank_pid(proc.pid, 1)
        _wait_for_steps(run_dir, 1, proc)
        for pid in _tree(rank1):
            os.kill(pid, signal.SIGTERM)
        out = proc.communicate(timeout=300)[0]
    finally:
        _kill_tree(proc)
    # "finishing step N (phase)" inside a step, "finishing <phase> after step N" between two: either
    # way rank 1 finishes what it is doing, then both checkpoint and stop (below)
    assert "rank 1: received SIGTERM: finishing " in out, out[-3000:]
    assert "rank 0: received" not in out
    (ckpt,) = CheckpointManager(run_dir / "checkpoints").complete()
    stopped = int(ckpt.name.split("_")[1])
    assert 1 <= stopped < STEPS
    assert (
        f"interrupted by SIGTERM: stopped after step {stopped}/{STEPS} with checkpoint {ckpt}"
        in out
    )
    # each rank's (torchrun's report)
    assert exit_codes(out) == {0: ExitCode.INTERRUPTED, 1: ExitCode.INTERRUPTED}, out[-3000:]
    assert "Traceback" not in out[: out.find(TORCHRUN_TRACEBACK)]  # no rank printed one
    assert sorted(losses(run_dir)) == list(range(1, stopped + 1))
    job = compose_job(
        COMMON + [f"train.steps={STEPS}", f"train.run_dir={run_dir}", f"data.shards={shards}"]
    )
    assert Trainer(job).run() == 0
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-6, (
        got,
        want,
    )  # (measured: 0.0; pinned data streams)


@pytest.mark.slow
def test_two_ranks_a_stopped_peer_is_reported_then_ends_in_the_timeout_line(reference, tmp_path):
    """Rank 1 SIGSTOPped after step 3: rank 0's watchdog reports the stalled step (line + stacks), then the
    collective times out (parallel.timeout_s) and rank 0 exits 5 with one line naming the phase."""
    _, shards = reference
    timeout_s = 8
    run_dir = tmp_path / "run"
    proc = _torchrun(
        [
            "train.steps=50",
            f"train.run_dir={run_dir}",
            f"data.shards={shards}",
            f"parallel.timeout_s={timeout_s}",
            "train.watchdog_factor=2",
            "train.watchdog_min_s=1",
        ]
    )
    lines, reader = _reader(proc)
    rank1 = None
    try:
        rank0, rank1 = _rank_pid(proc.pid, 0), _rank_pid(proc.pid, 1)
        _wait_for_steps(run_dir, WARMUP_STEPS + 1, proc)  # the watchdog has a timed step
        os.kill(rank1, signal.SIGSTOP)
        t0 = time.time()
        deadline = t0 + timeout_s + 60
        while time.time() < deadline and not any("collective failure" in x for x in lines):
            time.sleep(0.05)
        waited = time.time() - t0
        while time.time() < deadline and not _gone(rank0):
            time.sleep(0.05)
        # torchrun sees rank 0's exit first (it then waits 30 s for the stopped rank 1)
        time.sleep(1.0)
    finally:
        if rank1 is not None:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                os.kill(rank1, sig)
        try:
            proc.wait(timeout=60)
        finally:
            _kill_tree(proc)
        reader.join(timeout=30)
    out = "".join(lines)
    failure = [x for x in lines if "collective failure" in x]
    assert failure, out[-4000:]
    # the stop lands inside a step or in the stop-flag all-reduce that follows it: both are named
    assert failure[0].startswith(
        (
            "rank 0: collective failure during step ",
            "rank 0: collective failure during stop-flag all-reduce after step ",
        )
    ), failure[0]
    assert (
        f"no answer within parallel.timeout_s={timeout_s}s. Likely cause: another rank stopped, crashed"
        in failure[0]
    )
    # the stalled step started at most one step before the stop
    assert waited < timeout_s + 30, waited
    report = out.index("rank 0: watchdog: ")
    # reported (with stacks) first
    assert report < out.index(failure[0]) and "Thread 0x" in out[report:]
    assert exit_codes(out)[0] == ExitCode.COLLECTIVE, out[-3000:]
    print(
        out[report : out.index("\n", report)],
        f"\n{failure[0].strip()}\n(after {waited:.1f}s of SIGSTOP)",
    )
