"""The one table of failure classes: each exception a run fails with -> its exit code and first line.

    failure = classify(err, phase=RUN, ctx=FailureContext(step=7, intact=lambda: newest))
    failure.code, failure.line      # ExitCode.CHECKPOINT, "stopping at step 7: writing a checkpoint ..."
    failure.say(log.info, "rank 1: ")   # printed where its row says (the run's log, each rank's stderr)

`FAILURES` has a row per class, the first match wins; each row says, for set-up (train.py `_job`) and
for the run (`Trainer.run`), the line's prefix and who prints it, or None where that phase does not
expect it: an exception no row of its phase expects is a bug (ExitCode.BUG, after its traceback).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from moevlm.data.errors import DataError
from moevlm.data.lifetime import worker_death
from moevlm.errors import ConfigError
from moevlm.model.hf import CheckpointError as HFCheckpointError
from moevlm.parallel.build import ParallelNotBuilt
from moevlm.train.exit_codes import ExitCode, bug_line
from moevlm.train.export import ExportFailed
from moevlm.train.faults import describe_failure, oom_line, out_of_memory
from moevlm.train.integrity import CheckpointError, looks_like_disk_full, write_failed_line
from moevlm.train.metrics import LogWriteError
from moevlm.train.setup import DataResumeRefused

SETUP, RUN = "set-up", "run"  # the phases: the Trainer's construction, Trainer.run
# who prints a line: the run's log (rank 0's console), each rank's stderr (EACH_RANK: naming the rank
# when there are several), moevlm.train.torchrun_exit.config_error_exit (CONFIG_LINES), a traceback
LOG, STDERR, EACH_RANK, CONFIG_LINES, TRACEBACK = (
    "log",
    "stderr",
    "each rank",
    "config",
    "traceback",
)
STOPPING = "stopping at step {step}"  # the run's prefix; "": the message is the whole line
SETUP_DOING = "set-up (process group, run directory, sample data, checkpoint load)"


class NonFiniteWeights(RuntimeError):
    """The weights themselves are not finite: no checkpoint of them is written."""

    def __init__(self, newest: Path | None):
        super().__init__(self.message(newest))

    @staticmethod
    def message(newest: Path | None) -> str:
        last = f"the newest checkpoint is {newest}" if newest else "there is no earlier checkpoint"
        return (
            "the weights are non-finite (an update made them so: lower optim.lr or check the data); "
            f"no checkpoint of them is written ({last})"
        )


@dataclass(frozen=True)
class FailureContext:
    """What a message names: the step (None at set-up), what was being done and for how long (a
    collective's), parallel.timeout_s, and `intact()`: the newest complete checkpoint (None: none)."""

    step: int | None = None
    doing: str = SETUP_DOING
    elapsed_s: float | None = None
    timeout_s: float = 600.0
    intact: Callable[[], object] = lambda: None


@dataclass(frozen=True)
class Failure:
    """A classified failure: the exit code, the first line (`prefix: message`, the message alone when
    `prefix` is ""), and who prints it (LOG, STDERR, EACH_RANK, CONFIG_LINES, TRACEBACK)."""

    code: ExitCode
    prefix: str
    message: str
    where: str

    @property
    def line(self) -> str:
        return f"{self.prefix}: {self.message}" if self.prefix else self.message

    def say(self, log: Callable[[str], None] | None = None, rank_prefix: str = "") -> None:
        """Print the line where it belongs (LOG: `log`; EACH_RANK: after `rank_prefix`)."""
        if self.where == LOG and log is not None:
            log(self.line)
        else:
            print(
                (rank_prefix if self.where == EACH_RANK else "") + self.line,
                file=sys.stderr,
                flush=True,
            )


Match = Callable[[BaseException, FailureContext], "str | None"]


class Rule(NamedTuple):
    """A failure class: `match(err, ctx)` is its message (None: not this class); its exit code; in
    each phase (the line's prefix, who prints it), or None where the phase does not expect it."""

    what: str
    match: Match
    code: ExitCode
    setup: tuple[str, str] | None
    run: tuple[str, str] | None


def _is(*classes: type) -> Match:
    return lambda err, ctx: str(err) if isinstance(err, classes) else None


def _collective(err: BaseException, ctx: FailureContext) -> str | None:
    return describe_failure(err, ctx.doing, ctx.elapsed_s, ctx.timeout_s)


def _collective_in(cls: type) -> Match:
    return lambda err, ctx: _collective(err, ctx) if isinstance(err, cls) else None


def _oom(err: BaseException, ctx: FailureContext) -> str | None:
    where = out_of_memory(err)
    return None if where is None else oom_line(where, err, ctx.step, ctx.intact())


def _disk_full(err: BaseException, ctx: FailureContext) -> str | None:
    return write_failed_line(err) if looks_like_disk_full(err) else None


def _worker_death(err: BaseException, ctx: FailureContext) -> str | None:
    return worker_death(err)


C, S = ExitCode, STOPPING
# what, match, code, at set-up (prefix, who prints), in the run (prefix, who prints)
FAILURES: tuple[Rule, ...] = (
    Rule("a setting is wrong", _is(ConfigError, HFCheckpointError, ParallelNotBuilt), C.CONFIG, ("config error", CONFIG_LINES), None),
    Rule("the weights are not finite", _is(NonFiniteWeights), C.NONFINITE, None, (S, LOG)),
    Rule("a peer lost during a save", _collective_in(CheckpointError), C.COLLECTIVE, None, ("", EACH_RANK)),
    Rule("resumed data does not fit", _is(DataResumeRefused), C.DATA, ("data error", STDERR), (S, LOG)),
    Rule("a checkpoint write or load", _is(CheckpointError), C.CHECKPOINT, ("checkpoint error", STDERR), (S, LOG)),
    Rule("a metrics or export write", _is(LogWriteError, ExportFailed), C.CHECKPOINT, None, (S, STDERR)),
    Rule("the data cannot feed", _is(DataError), C.DATA, None, (S, EACH_RANK)),
    Rule("a data worker died", _worker_death, C.DATA, None, (S, STDERR)),
    Rule("out of memory in a step", _oom, C.OUT_OF_MEMORY, None, (S, STDERR)),
    Rule("another write: disk full", _disk_full, C.CHECKPOINT, ("set-up stopped", STDERR), (S, STDERR)),
    Rule("a collective failed", _collective, C.COLLECTIVE, ("", STDERR), ("", EACH_RANK)),
)  # fmt: skip


def classify(err: BaseException, *, phase: str, ctx: FailureContext | None = None) -> Failure:
    """The failure `err` is in `phase` (SETUP or RUN): the first row of FAILURES for that phase that
    matches it, else ExitCode.BUG with moevlm.train.exit_codes.bug_line."""
    ctx = ctx or FailureContext()
    for rule in FAILURES:
        said = rule.setup if phase == SETUP else rule.run
        if said is not None and (message := rule.match(err, ctx)) is not None:
            prefix, where = said
            return Failure(rule.code, prefix.format(step=ctx.step), message, where)
    return Failure(ExitCode.BUG, "", bug_line(err), TRACEBACK)
