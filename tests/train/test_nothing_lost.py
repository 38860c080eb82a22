"""Nothing lost silently: metrics.jsonl deleted mid-run is written again with its earlier records and
logging goes on there (one line); a TensorBoard write failure stops the run with one line and exit 7
only after the checkpoint due at that step is written."""

from __future__ import annotations

import errno
import json
from pathlib import Path

from moevlm.config import compose_job
from moevlm.train.checkpoint import CheckpointManager
from moevlm.train.exit_codes import ExitCode
from moevlm.train.trainer import Trainer

FAST = [
    "data.num_workers=1",
    "data.streams=1",
    "train.log_every=1",
    "train.require_loss_decrease=false",
]


def _trainer(run_dir: Path, *more: str) -> Trainer:
    return Trainer(compose_job([*FAST, f"train.run_dir={run_dir}", *more]))


def test_metrics_deleted_mid_run_are_written_again_and_logging_goes_on(tmp_path, capsys):
    run_dir = tmp_path / "run"
    trainer = _trainer(run_dir, "train.steps=4", "train.tensorboard=false")
    real_step = trainer.train_step

    def step(window, micro=None):
        if trainer.step == 2:  # steps 1 and 2 are logged: the file goes
            (run_dir / "metrics.jsonl").unlink()
        return real_step(window, micro)

    trainer.train_step = step
    capsys.readouterr()
    assert trainer.run() == ExitCode.OK
    out, err = capsys.readouterr()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    said = [x for x in (out + err).splitlines() if "was deleted during the run" in x]
    want = (
        f"{run_dir / 'metrics.jsonl'} was deleted during the run: written again with its 2 earlier "
        "records, and logging goes on there"
    )
    assert said == [want], out + err
    assert "Traceback" not in out + err


def test_a_tensorboard_failure_never_skips_the_due_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    trainer = _trainer(
        run_dir, "train.steps=6", "train.checkpoint_every=2", "train.tensorboard=true"
    )
    tb = trainer.log._tb
    real_flush = tb.flush

    def flush():
        if trainer.step == 4:
            raise OSError(errno.EIO, "Input/output error")
        return real_flush()

    tb.flush = flush
    capsys.readouterr()
    assert trainer.run() == ExitCode.CHECKPOINT == 7
    out, err = capsys.readouterr()
    lines = [x for x in (out + err).splitlines() if "stopping at step" in x]
    want = (
        f"stopping at step 4: writing {run_dir / 'tb'} failed: OSError: [Errno 5] Input/output "
        "error; the checkpoints are intact (a relaunch with room resumes from the last one)"
    )
    assert lines == [want], out + err
    assert "Traceback" not in out + err
    ck = CheckpointManager(run_dir / "checkpoints")
    # step 4's checkpoint was due: written, complete, before the run stopped
    assert [p.name for p in ck.complete()][-1] == "step_00000004"
    assert ck.verify(ck.latest()) == []
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
