"""The process exit codes of a training run: `Trainer.run` returns them, train.py exits with them.

Design choices:
- One IntEnum, so a code compares, formats and exits as the plain number (`sys.exit(ExitCode.DATA)`
  exits 8) while the name says what happened.  The numbers are the public interface: scripts and
  schedulers branch on them, so they never change.
- 1 is Python's own code for an uncaught exception as well as "the loss did not fall": a wrapper that
  must tell them apart reads the log.  4-8 are the next free small numbers: a wrapper script can tell
  "checkpoint written, relaunch" (4) from a kill (128+signum, the shells' convention, kept for the
  second signal that skips the checkpoint) and from a crash.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0  # done
    NO_PROGRESS = 1  # the loss did not fall (train.require_loss_decrease)
    CONFIG = (
        2  # config error, before anything is set up: one line per problem saying what to change
    )
    NONFINITE = 3  # stopped on non-finite loss or gradients (checkpoint written)
    INTERRUPTED = (
        4  # SIGTERM/SIGINT: checkpoint written after the current step; relaunch the same command
    )
    COLLECTIVE = 5  # a collective timed out (parallel.timeout_s) or lost a peer rank; one line names the phase
    WATCHDOG = 6  # the step watchdog aborted a step or checkpoint (train.watchdog_abort_s)
    # a checkpoint could not be written (no disk room: the message names the folder, the bytes needed and
    # free; the earlier checkpoints are intact) or train.resume names one that fails verification
    CHECKPOINT = 7
    DATA = 8  # the data cannot feed training (every sample skipped: the skip counts by reason)


def second_signal(signum: int) -> int:
    """A second SIGTERM/SIGINT exits at once without a checkpoint: 128+signum (130, 143)."""
    return 128 + signum
