"""A data worker never outlives or hangs its trainer: a SIGKILLed worker (as the out-of-memory killer
ends one) stops the run in seconds with one line and exit 8, and the relaunch resumes exactly; a stop
signal sent while the loader's fork server starts still reaches the trainer; torch's error texts map to
one line each."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver as forkserver
import os
import signal
import time
from pathlib import Path

import pytest
from test_faults import _children, _gone
from test_trainer import FAST, last_loss_per_step, launch, read_metrics, uncheckpointed

from moevlm.config import compose_job
from moevlm.data import loader as loader_module
from moevlm.data.loader import PackedLoader, worker_death
from moevlm.train.exit_codes import ExitCode
from moevlm.train.trainer import Trainer


def _a_worker_of(trainer_pid: int) -> int | None:
    """A data worker of the trainer: a child of its fork server (the trainer's forkserver child)."""
    for server in _children(trainer_pid):
        try:
            if b"forkserver" not in Path(f"/proc/{server}/cmdline").read_bytes():
                continue
        except OSError:
            continue
        workers = _children(server)
        if workers:
            return workers[0]
    return None


@pytest.mark.slow
def test_a_killed_worker_ends_the_run_in_seconds_and_the_relaunch_resumes_exactly(tmp_path, capsys):
    common = ["train.steps=10", "train.checkpoint_every=1", "train.tensorboard=false"]
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    # the run whose worker is killed is train.py's; the uninterrupted reference and the relaunch (the
    # same command again) run in this process
    assert Trainer(compose_job(uncheckpointed(common) + [f"train.run_dir={ref_dir}"])).run() == 0
    job = launch(common + [f"train.run_dir={cut_dir}"])
    deadline, worker = time.time() + 300, None
    while time.time() < deadline and job.poll() is None and worker is None:
        if (cut_dir / "metrics.jsonl").exists() and len(read_metrics(cut_dir)) >= 3:
            worker = _a_worker_of(job.pid)
        time.sleep(0.05)
    assert worker is not None, "no worker found while the run was going"
    # the trainer cannot finish its steps before the worker is gone
    os.kill(job.pid, signal.SIGSTOP)
    os.kill(worker, signal.SIGKILL)
    while not _gone(worker):  # reaped, or a zombie
        time.sleep(0.01)
    killed = time.time()
    os.kill(job.pid, signal.SIGCONT)
    out = job.communicate(timeout=300)[0]
    ended_after = time.time() - killed
    assert job.returncode == ExitCode.DATA, out
    lines = [
        x for x in out.splitlines() if f"data worker (pid {worker}) was killed by SIGKILL" in x
    ]
    assert lines and lines[0].startswith("stopping at step ") and "Traceback" not in out, out
    assert ended_after < 120  # about 1 s measured; a wide margin for a busy CI machine
    capsys.readouterr()
    assert Trainer(compose_job(common + [f"train.run_dir={cut_dir}"])).run() == 0
    out = capsys.readouterr().out
    assert "resumed from" in out, out
    got, want = last_loss_per_step(cut_dir), last_loss_per_step(ref_dir)
    assert sorted(got) == sorted(want) == list(range(1, 11))
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-6


def test_a_stop_signal_while_the_fork_server_starts_reaches_the_trainer(tmp_path, monkeypatch):
    trainer = Trainer(compose_job(FAST + [f"train.run_dir={tmp_path}", "train.steps=4"]))
    start, sent = forkserver._forkserver.ensure_running, []

    def signalled_while_starting():
        if not sent:
            sent.append(os.getpid())
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, at this worst moment
        return start()

    # both doors to the server's start: the instance's method (what starting a worker calls) and the
    # module's alias of it (what a loader calls to start the server ahead of its workers)
    monkeypatch.setattr(forkserver._forkserver, "ensure_running", signalled_while_starting)
    monkeypatch.setattr(forkserver, "ensure_running", signalled_while_starting)
    assert trainer.run() == ExitCode.INTERRUPTED and sent
    assert trainer.step < 4 and (tmp_path / "checkpoints" / f"step_{trainer.step:08d}").is_dir()


class _Proc:
    def __init__(self, pid, exitcode):
        self.pid, self.exitcode = pid, exitcode


def test_torch_worker_errors_become_one_line():
    killed = worker_death(
        RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly"), [_Proc(4242, -9)]
    )
    assert killed.startswith(
        "data worker (pid 4242) was killed by SIGKILL: most likely the kernel's "
    )
    bus = worker_death(
        RuntimeError("DataLoader worker (pid 77) is killed by signal: Bus error. It is")
    )
    assert "is killed by signal: Bus error: most likely shared memory (/dev/shm) ran out" in bus
    code = worker_death(
        RuntimeError("DataLoader worker (pid(s) 5) exited unexpectedly"), [_Proc(5, 3)]
    )
    assert "exited with code 3: run with data.num_workers=0" in code
    assert worker_death(RuntimeError("CUDA out of memory")) is None


def _kill_self_after(seconds: float) -> None:
    time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGKILL)


class _TornIterator:
    """A test double of torch's worker iterator at the moment a worker dies with its batch in transit:
    the batch's shared-memory handle comes from the dead worker's socket, whose connection resets."""

    def __init__(self, workers):
        self._workers = workers

    def __next__(self):
        raise ConnectionResetError(104, "Connection reset by peer")


def test_a_worker_dying_with_its_batch_in_transit_is_the_same_one_line(monkeypatch):
    fork = multiprocessing.get_context("fork")
    # the worker is still alive when the socket's error arrives (its parent has not reaped it yet)
    dying = fork.Process(target=_kill_self_after, args=(0.5,), daemon=True)
    alive = fork.Process(target=time.sleep, args=(60,), daemon=True)
    dying.start(), alive.start()
    try:
        loader = PackedLoader.__new__(PackedLoader)
        loader._it = _TornIterator([alive, dying])
        batch, line = loader._next_row()
        assert batch is None and loader._it is None
        assert line.startswith(f"data worker (pid {dying.pid}) was killed by SIGKILL: most likely")
        assert "relaunch resumes exactly" in line
        assert not alive.is_alive()  # the loader stopped the other workers (a relaunch starts anew)
        alive = fork.Process(target=time.sleep, args=(60,), daemon=True)
        alive.start()
        # a reset with every worker alive is not a worker's death: raised as it was, after the grace
        monkeypatch.setattr(loader_module, "WORKER_REAP_GRACE_S", 0.3)
        loader._it = _TornIterator([alive])
        with pytest.raises(ConnectionResetError):
            loader._next_row()
    finally:
        for w in (dying, alive):
            if w.is_alive():
                w.kill()
            w.join()
