"""The process exit codes of a training run: `Trainer.run` returns them, train.py exits with them.

`ExitCode` is an IntEnum, so `sys.exit(ExitCode.DATA)` exits 8 while the name says what happened;
the numbers are the public interface and never change.  A second stop signal exits 128+signum
(`second_signal`).  Why these numbers: docs/architecture.md.
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


def second_signal(signum: int) -> int:
    """A second stop signal exits at once without a checkpoint: 128+signum (130 SIGINT, 143 SIGTERM,
    129 SIGHUP, 138 SIGUSR1, 131 SIGQUIT)."""
    return 128 + signum
