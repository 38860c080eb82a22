"""Every way a run stops has its documented exit code and one line: mistakes Hydra itself would catch,
the other stop signals (SIGHUP, SIGUSR1, SIGQUIT), a full disk under the metrics, a peer lost while a
checkpoint is written."""

from __future__ import annotations

import errno
import os
import signal
import time

import pytest
from test_trainer import FAST, launch

from moevlm.config import compose_job
from moevlm.train.checkpoint import CheckpointError, CheckpointManager
from moevlm.train.exit_codes import ExitCode
from moevlm.train.faults import STOP_SIGNALS, StopSignals
from moevlm.train.trainer import Trainer


@pytest.mark.slow
def test_mistakes_hydra_catches_are_config_errors(tmp_path):
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("mine\n")
    cases = {
        "train.steps=abc": "config error: Error merging override train.steps=abc; Value 'abc' of type "
        "'str' could not be converted to Integer",
        # (Hydra's own words were "In 'config': Could not find 'experiment/nope'", without the list)
        "+experiment=nope": "config error: +experiment=nope is not a recipe of conf/experiment/ "
        "(experiment: gb200_3d,",
        f"train.run_dir={a_file}": f"config error: train.run_dir={a_file} is a file, not a directory",
    }
    for arg, first_line in cases.items():
        proc = launch([arg, "train.steps=1" if "steps" not in arg else "train.seed=0"])
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode == ExitCode.CONFIG, out
        assert first_line in out and "Traceback" not in out and "HYDRA_FULL_ERROR" not in out, out
    assert a_file.read_text() == "mine\n"


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT])
def test_every_stop_signal_asks_for_a_checkpoint(sig, capsys):
    assert sig in STOP_SIGNALS
    stop = StopSignals(lambda: "step 7")
    assert stop.install()
    try:
        os.kill(os.getpid(), sig)
        deadline = time.time() + 60  # the reading thread notes it; wide margin for a busy machine
        while not stop.requested and time.time() < deadline:
            time.sleep(0.01)
    finally:
        stop.close()
    assert stop.requested == sig
    name = signal.Signals(sig).name
    assert (
        f"received {name}: finishing step 7, then writing a checkpoint" in capsys.readouterr().err
    )


def _trainer(tmp_path, steps=3) -> Trainer:
    return Trainer(
        compose_job(
            FAST + [f"train.run_dir={tmp_path}", f"train.steps={steps}", "train.checkpoint_every=1"]
        )
    )


def test_a_full_disk_under_the_metrics_is_one_line_and_exit_7(tmp_path, capsys):
    trainer = _trainer(tmp_path)
    file = trainer.log._file
    real_write = file.write

    class FullDisk:
        def write(self, text):
            if trainer.step >= 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(text)

        def __getattr__(self, name):
            return getattr(file, name)

    trainer.log._file = FullDisk()
    assert trainer.run() == ExitCode.CHECKPOINT
    err = capsys.readouterr().err
    assert (
        f"stopping at step 2: writing {tmp_path / 'metrics.jsonl'} failed: the disk is full" in err
    )
    assert "Traceback" not in err
    ck = CheckpointManager(tmp_path / "checkpoints")
    assert ck.latest().name == "step_00000001" and ck.verify(ck.latest()) == []


def test_a_peer_lost_during_a_save_is_a_collective_failure(tmp_path, capsys):
    trainer = _trainer(tmp_path, steps=2)

    def lost_peer(*args, **kwargs):
        try:
            raise RuntimeError(
                "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4711"
            )
        except RuntimeError as err:
            raise CheckpointError("writing checkpoint step_00000001 failed: ...") from err

    trainer.ckpt.save = lost_peer
    assert trainer.run() == ExitCode.COLLECTIVE
    err = capsys.readouterr().err
    assert "collective failure during checkpoint save" in err
    assert "a collective lost its connection to a peer rank" in err


def test_a_full_disk_under_any_other_write_is_one_line_and_exit_7(tmp_path, capsys):
    """E.g. a profile table or a file of the run directory: not a traceback and exit 1."""
    trainer = _trainer(tmp_path, steps=2)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "profile.txt"))

    trainer.save = full
    assert trainer.run() == ExitCode.CHECKPOINT
    err = capsys.readouterr().err
    assert f"stopping at step 1: writing {tmp_path / 'profile.txt'} failed: the disk is full" in err
