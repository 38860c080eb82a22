"""The one table of failure classes (moevlm.train.failures.FAILURES): each exception the product
raises for a failure maps, at set-up (train.py `_job`) and in the run (Trainer.run), to its documented
exit code, first line and printer; anything else is a bug (ExitCode.BUG and the bug line).  In process,
no launch: the launches that produce each code are tests/train/test_faults.py's PRODUCED_BY."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_faults import _table

from moevlm.data.errors import DataError, DataSetupError
from moevlm.errors import ConfigError
from moevlm.model.hf import CheckpointError as HFCheckpointError
from moevlm.parallel.build import ParallelNotBuilt
from moevlm.parallel.hf_io import ExportTargetError
from moevlm.train.exit_codes import MEANINGS, ExitCode, bug_line
from moevlm.train.export import ExportFailed
from moevlm.train.failures import (
    CONFIG_LINES,
    EACH_RANK,
    FAILURES,
    LOG,
    RUN,
    SETUP,
    STDERR,
    TRACEBACK,
    Failure,
    FailureContext,
    NonFiniteWeights,
    classify,
)
from moevlm.train.integrity import CheckpointError
from moevlm.train.metrics import LogWriteError
from moevlm.train.setup import DataResumeRefused

REPO = Path(__file__).resolve().parents[2]
C = ExitCode
CTX = FailureContext(
    step=5, doing="step 6 (forward/backward)", elapsed_s=3.0, timeout_s=60, intact=lambda: "ck/5"
)
DISK_FULL = OSError(errno.ENOSPC, "No space left on device", "/runs/a/tb/events")
GLOO_TIMEOUT = dist.DistError("[gloo] Timed out waiting 60000ms for recv operation")


def _in_a_save(cause: BaseException) -> CheckpointError:
    try:
        raise CheckpointError("the checkpoint's collective failed") from cause
    except CheckpointError as err:
        return err


# (exception, phase, code, first-line prefix, printer); the message is str(err) unless a rule words it
CASES = [
    (ConfigError("model.num_layers=0: must be >= 1\ndata.shards: missing"), SETUP, C.CONFIG, "config error", CONFIG_LINES),
    (DataSetupError("data.shards=/x is not there"), SETUP, C.CONFIG, "config error", CONFIG_LINES),
    (ExportTargetError("train.export_hf is the source"), SETUP, C.CONFIG, "config error", CONFIG_LINES),
    (HFCheckpointError("model.safetensors is truncated"), SETUP, C.CONFIG, "config error", CONFIG_LINES),
    (ParallelNotBuilt("tp with this family"), SETUP, C.CONFIG, "config error", CONFIG_LINES),
    (NonFiniteWeights(None), RUN, C.NONFINITE, "stopping at step 5", LOG),
    (_in_a_save(GLOO_TIMEOUT), RUN, C.COLLECTIVE, "", EACH_RANK),
    (DataResumeRefused("other shards"), SETUP, C.DATA, "data error", STDERR),
    (CheckpointError("step_4 fails verification"), SETUP, C.CHECKPOINT, "checkpoint error", STDERR),
    (CheckpointError("no room"), RUN, C.CHECKPOINT, "stopping at step 5", LOG),
    (LogWriteError("metrics.jsonl: disk full"), RUN, C.CHECKPOINT, "stopping at step 5", STDERR),
    (ExportFailed("train.export_hf refused"), RUN, C.CHECKPOINT, "stopping at step 5", STDERR),
    (DataError("no shard has a usable sample"), RUN, C.DATA, "stopping at step 5", EACH_RANK),
    (RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. "), RUN, C.DATA, "stopping at step 5", STDERR),
    (MemoryError(), RUN, C.OUT_OF_MEMORY, "stopping at step 5", STDERR),
    (torch.OutOfMemoryError("CUDA out of memory. Tried"), RUN, C.OUT_OF_MEMORY, "stopping at step 5", STDERR),
    (DISK_FULL, SETUP, C.CHECKPOINT, "set-up stopped", STDERR),
    (DISK_FULL, RUN, C.CHECKPOINT, "stopping at step 5", STDERR),
    (GLOO_TIMEOUT, SETUP, C.COLLECTIVE, "", STDERR),
    (GLOO_TIMEOUT, RUN, C.COLLECTIVE, "", EACH_RANK),
]  # fmt: skip


@pytest.mark.parametrize(
    "err,phase,code,prefix,where", CASES, ids=[f"{type(c[0]).__name__}-{c[1]}" for c in CASES]
)
def test_each_failure_class_has_its_code_line_and_printer(err, phase, code, prefix, where):
    got = classify(err, phase=phase, ctx=CTX)
    assert (got.code, got.prefix, got.where) == (code, prefix, where)
    assert got.line == (f"{prefix}: {got.message}" if prefix else got.message)
    assert "\n" not in got.line or where == CONFIG_LINES  # config_error_exit: a line each


def test_the_worded_lines_are_those_the_docs_name():
    oom = classify(MemoryError("can't allocate memory"), phase=RUN, ctx=CTX).line
    assert oom.startswith("stopping at step 5: out of host memory during step 6 (can't allocate")
    assert "checkpoint ck/5 is intact" in oom and "train.micro_batch_size" in oom
    lost = classify(GLOO_TIMEOUT, phase=SETUP, ctx=FailureContext(timeout_s=60)).line
    assert lost.startswith("collective failure during set-up (process group, run directory")
    assert "parallel.timeout_s=60s" in lost and f"exit code {C.COLLECTIVE:d}" in lost
    full = classify(DISK_FULL, phase=SETUP).line
    assert full.startswith("set-up stopped: ") and "/runs/a/tb/events" in full
    assert classify(DataResumeRefused("x"), phase=SETUP).code == DataResumeRefused.exit_code


def test_every_rule_is_exercised_and_every_code_is_documented():
    readme = _table(REPO / "README.md", "## Exit codes")
    docs = _table(REPO / "docs/faults.md", "## Exit codes")
    for rule in FAILURES:
        assert rule.setup is not None or rule.run is not None, rule.what
        assert any(rule.match(err, CTX) is not None for err, *_ in CASES), rule.what
        code = str(int(rule.code))
        assert code in MEANINGS and code in readme and code in docs, (rule.what, code)
    assert str(int(C.BUG)) in readme  # the code of everything the table does not expect


@pytest.mark.parametrize("phase", [SETUP, RUN])
@pytest.mark.parametrize(
    "err",
    [RuntimeError("boom"), KeyError("x"), ValueError("y"), ConfigError("late"), DataError("z")],
)
def test_an_exception_no_rule_of_its_phase_expects_is_a_bug(err, phase):
    if (phase, type(err)) in ((SETUP, ConfigError), (RUN, DataError)):
        return  # expected there
    got = classify(err, phase=phase, ctx=CTX)
    assert got == Failure(C.BUG, "", bug_line(err), TRACEBACK)
    assert got.code == 70 and "a bug" in got.line and type(err).__name__ in got.line


def test_a_failure_is_printed_where_its_row_says(capsys):
    logged: list[str] = []
    Failure(C.CHECKPOINT, "stopping at step 2", "no room", LOG).say(logged.append, "rank 1: ")
    Failure(C.DATA, "stopping at step 2", "no sample", EACH_RANK).say(logged.append, "rank 1: ")
    Failure(C.CHECKPOINT, "set-up stopped", "disk full", STDERR).say(None, "rank 1: ")
    assert logged == ["stopping at step 2: no room"]
    assert capsys.readouterr().err.splitlines() == [
        "rank 1: stopping at step 2: no sample",
        "set-up stopped: disk full",
    ]
