"""A checkpoint write that fails outside DCP's writer (the checkpoints folder turned read-only mid-run,
memory exhausted while the checkpoint is committed), sync or in the background: one line naming the
path and what is intact, exit 7, the earlier checkpoint byte for byte as it was; and an unexpected
exception in train.py: its traceback, one line saying it is a bug, exit 70; out of memory in a step:
one line, exit 10."""

from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path

import pytest

from moevlm.config import compose_job
from moevlm.train.checkpoint import manager
from moevlm.train.exit_codes import ExitCode
from moevlm.train.trainer import Trainer

FAST = ["data.num_workers=1", "data.streams=1", "train.require_loss_decrease=false"]
REPO = Path(__file__).resolve().parents[2]


def snapshot(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def _chmod_works(folder: Path) -> bool:
    """False under root (or a file system that ignores modes): a read-only folder is still written."""
    probe = folder / "probe"
    probe.mkdir()
    probe.chmod(0o555)
    try:
        (probe / "x").write_text("x")
        return False
    except PermissionError:
        return True
    finally:
        probe.chmod(0o755)
        for p in probe.iterdir():
            p.unlink()
        probe.rmdir()


@pytest.mark.parametrize("how", ["read_only", "read_only_async", "memory_async"], ids=lambda s: s)
def test_a_checkpoint_write_failure_mid_run_is_one_line_and_exit_7(
    tmp_path, monkeypatch, capsys, how
):
    """Step 1's checkpoint is written; then the folder turns read-only (chmod, or under root an
    OSError(EROFS) from the commit's marker write) or memory runs out while checksumming step 2's."""
    run_dir = tmp_path / "run"
    ck = run_dir / "checkpoints"
    chmod = how.startswith("read_only") and _chmod_works(tmp_path)
    kept: dict = {}
    real_save, real_marker, real_sums = (
        manager.CheckpointManager.save,
        manager.write_json_atomic,
        manager.checksum_files,
    )

    def save(self, step, **kw):
        if step == 2:
            kept.update(snapshot(ck / "step_00000001"))
            if chmod:
                ck.chmod(0o555)
        return real_save(self, step, **kw)

    def marker(path, obj):
        if path.parent.name == "step_00000002" and how.startswith("read_only"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_marker(path, obj)

    def sums(path, names, *a, **kw):
        if Path(path).name == "step_00000002" and how == "memory_async":
            raise MemoryError()
        return real_sums(path, names, *a, **kw)

    monkeypatch.setattr(manager.CheckpointManager, "save", save)
    monkeypatch.setattr(manager, "write_json_atomic", marker)
    monkeypatch.setattr(manager, "checksum_files", sums)
    more = ["train.async_checkpoint=true"] if how.endswith("async") else []
    job = compose_job(
        [*FAST, "train.steps=3", "train.checkpoint_every=1", f"train.run_dir={run_dir}", *more]
    )
    try:
        trainer = Trainer(job)
        capsys.readouterr()
        code = trainer.run()
    finally:
        ck.chmod(0o755)
    out, err = capsys.readouterr()
    assert code == ExitCode.CHECKPOINT == 7, out + err
    lines = [x for x in (out + err).splitlines() if "stopping at step" in x]
    assert len(lines) == 1 and "Traceback" not in out + err, out + err
    why = "out of memory while committing it" if how == "memory_async" else "Errno"
    assert f"writing a checkpoint in {ck} failed at " in lines[0] and why in lines[0], lines
    assert f"{ck / 'step_00000001'} is intact (resume=auto continues from it" in lines[0]
    assert snapshot(ck / "step_00000001") == kept and kept
    assert [p.name for p in trainer.ckpt.complete()] == ["step_00000001"]


@pytest.mark.parametrize("where", ["device", "host"])
def test_out_of_memory_in_a_step_is_one_line_and_exit_10(tmp_path, monkeypatch, capsys, where):
    """Step 2 runs out of memory (torch's OutOfMemoryError as CUDA raises it; the CPU allocator's
    refusal): one line naming it, the intact step-1 checkpoint and what lowers the peak; exit 10."""
    import torch

    run_dir = tmp_path / "run"
    job = compose_job(
        [*FAST, "train.steps=3", "train.checkpoint_every=1", f"train.run_dir={run_dir}"]
    )
    trainer = Trainer(job)
    real_step = trainer.train_step

    def step(window, micro=None):
        if trainer.step == 1:
            if where == "device":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
            )
        return real_step(window, micro)

    monkeypatch.setattr(trainer, "train_step", step)
    capsys.readouterr()
    code = trainer.run()
    out, err = capsys.readouterr()
    assert code == ExitCode.OUT_OF_MEMORY == 10, out + err
    (line,) = [x for x in (out + err).splitlines() if "stopping at step" in x]
    assert "Traceback" not in out + err
    assert line.startswith(f"stopping at step 1: out of {where} memory during step 2 (")
    assert f"checkpoint {run_dir / 'checkpoints' / 'step_00000001'} is intact" in line
    assert "train.micro_batch_size" in line and "--fit" in line


def test_an_unexpected_exception_prints_its_traceback_and_exits_70(tmp_path, monkeypatch, capsys):
    """train.py (in process): a bug in set-up is not exit 1 (the loss did not fall)."""
    import runpy

    import moevlm.train.trainer as trainer_module

    def crash(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(trainer_module, "Trainer", crash)
    # Hydra's job logging adds handlers on this test's captured streams: gone with the test
    for logger in [logging.getLogger(), *logging.root.manager.loggerDict.values()]:
        if isinstance(logger, logging.Logger):
            monkeypatch.setattr(logger, "handlers", list(logger.handlers))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", f"train.run_dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as stop:  # as `python train.py ...` runs it
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    assert stop.value.code == ExitCode.BUG == 70
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback (most recent call last):" in err and "KeyError: 'a bug'" in err
    assert err[-1] == (
        "moevlm stopped on an unexpected KeyError: a bug (the traceback above says where; please "
        "report it); exit code 70"
    )
