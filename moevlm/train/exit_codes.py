"""The process exit codes of a training run: `Trainer.run` returns them, train.py exits with them.

`ExitCode` is an IntEnum, so `sys.exit(ExitCode.DATA)` exits 8 while the name says what happened;
the numbers are the public interface and never change; `MEANINGS` says each in a line.  A second
stop signal exits 128+signum (`second_signal`).  Why these numbers: docs/architecture.md.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0  # done
    NO_PROGRESS = 1  # the loss did not fall (train.require_loss_decrease)
    # config error, before anything is set up: one line per problem saying what to change (a run
    # directory in use by another launch, or not made by moevlm, included)
    CONFIG = 2
    # stopped on non-finite loss or gradients, or weights that are not finite (no checkpoint of them)
    NONFINITE = 3
    # a stop signal (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGQUIT): checkpoint written after the current
    # step; relaunch the same command
    INTERRUPTED = 4
    COLLECTIVE = 5  # a collective timed out or lost a peer rank (during a checkpoint save too)
    WATCHDOG = 6  # the step watchdog aborted a step or checkpoint (train.watchdog_abort_s)
    # a checkpoint could not be written (no disk room: the message names the folder, the bytes needed and
    # free; the earlier checkpoints are intact), the run's metrics could not be written (disk full), or
    # train.resume names one that fails verification
    CHECKPOINT = 7
    # the data cannot feed training (no shard of the data set has a usable sample: the skip counts by
    # reason), or a data worker died (one line: which, how, the likely cause); a relaunch resumes
    DATA = 8
    # a plan (parallel.fake_world, python -m moevlm.plan): a rank's peak exceeds the GPU's usable memory
    DOES_NOT_FIT = 9
    # the device or host ran out of memory during a step (one line: where, the checkpoint that is
    # intact, what lowers the peak); a checkpoint commit that runs out of memory is CHECKPOINT's
    OUT_OF_MEMORY = 10
    # an unexpected exception: a bug of moevlm (or of a library under it): its traceback, then one line
    # saying so.  70 is sysexits.h's EX_SOFTWARE; no expected outcome uses it
    BUG = 70


# The one table of what each code means (README.md's "Exit codes" table is checked against it by
# tests/train/test_faults.py): ExitCode's members, then the codes a signal or torchrun makes.
MEANINGS: dict[str, str] = {
    str(int(ExitCode.OK)): "done",
    str(int(ExitCode.NO_PROGRESS)): "the loss did not fall (`train.require_loss_decrease`)",
    str(int(ExitCode.CONFIG)): "config error (one line per problem), a run or sweep directory in "
    "use or not moevlm's, an export folder this run must not replace",
    str(int(ExitCode.NONFINITE)): "non-finite loss, gradients or weights: stopped",
    str(int(ExitCode.INTERRUPTED)): "interrupted by a stop signal, checkpoint written",
    str(int(ExitCode.COLLECTIVE)): "a collective timed out or lost a peer rank",
    str(int(ExitCode.WATCHDOG)): "the step watchdog aborted a step",
    str(int(ExitCode.CHECKPOINT)): "a write failed (checkpoint, metrics, TensorBoard, export: disk "
    "full, read-only, out of memory while committing; the line names the path and what is intact), "
    "or a named checkpoint fails verification, or a resume is refused (tokenizer or architecture "
    "changed: the line names train.resume_allow_changes)",
    str(int(ExitCode.DATA)): "the data cannot feed training, a data worker died, or a checkpoint's "
    "data state does not fit the shards (the line names the option that continues)",
    str(int(ExitCode.DOES_NOT_FIT)): "a plan found a rank that does not fit the GPU",
    str(int(ExitCode.OUT_OF_MEMORY)): "out of device or host memory during a step (the line names "
    "the intact checkpoint and what lowers the peak)",
    str(int(ExitCode.BUG)): "an unexpected exception (a bug): its traceback and one line",
    "128+signum": "a second stop signal: exited at once, no checkpoint (130 SIGINT, 143 SIGTERM)",
    "137": "a config error under torchrun (the launch's status; each rank's line is the same)",
}


def second_signal(signum: int) -> int:
    """A second stop signal exits at once without a checkpoint: 128+signum (130 SIGINT, 143 SIGTERM,
    129 SIGHUP, 138 SIGUSR1, 131 SIGQUIT)."""
    return 128 + signum


def bug_line(err: BaseException) -> str:
    """The one line printed after the traceback of an exception that no failure class expects."""
    return (
        f"moevlm stopped on an unexpected {type(err).__name__}: a bug (the traceback above says "
        f"where; please report it); exit code {ExitCode.BUG:d}"
    )
