"""Faults the trainer turns into a checkpoint or one clear line, not a lost run or a silent hang:
stop signals, the stop agreement over ranks, failed collectives, and the step watchdog.

    faults = Faults(rank, world, timeout_s=600, watchdog=StepWatchdog(10, 60, None))
    faults.start()                       # in Trainer.run: signal handlers + watchdog thread
    faults.begin_step(n); faults.at("forward/backward"); ...; faults.end_step()
    if faults.stop_requested(device):    # collective, after each step
        save, print, return ExitCode.INTERRUPTED
    faults.close()                       # previous handlers back (library use, sweeps)
    checkpoint_write_line(err, root, intact)  # a checkpoint write's OSError / MemoryError, one line
    out_of_memory(err)                   # "device" / "host" when a step ran out of memory, else None
    oom_line(where, err, step, intact)   # its line: the intact checkpoint, what lowers the peak

Exit codes: moevlm.train.exit_codes.ExitCode.  Why it works this way: docs/architecture.md.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from typing import Callable, Optional

import torch
import torch.distributed as dist

from moevlm.signals import STOP_SIGNALS
from moevlm.train.exit_codes import ExitCode, second_signal
from moevlm.train.integrity import errors_in, looks_like_disk_full, one_line

REPEAT_WINDOW_S = 2.0
WARMUP_STEPS, WINDOW = 2, 20


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _dump_stacks() -> None:
    err = sys.stderr
    try:
        err.flush()
        faulthandler.dump_traceback(file=err, all_threads=True)
    except (AttributeError, ValueError, OSError):  # a replaced stderr without a file descriptor
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)


class StopSignals:
    """A stop signal (STOP_SIGNALS): the first asks to stop after the current step, a second (after the repeat window)
    exits at once with 128+signum.  Installed only from the main thread; `close` restores what was there."""

    def __init__(
        self,
        describe: Callable[[], str],
        prefix: str = "",
        signals=STOP_SIGNALS,
        repeat_window_s: float = REPEAT_WINDOW_S,
        clock=time.monotonic,
    ):
        self.describe, self.prefix, self.signals = describe, prefix, tuple(signals)
        self.repeat_window_s, self.clock = repeat_window_s, clock
        self.requested, self.first_at = 0, 0.0
        self.exiting = False  # set once the run is over: a first signal then changes nothing
        self._old: dict = {}
        self._pipe = self._thread = None
        self._old_fd = -1

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread() or self._pipe is not None:
            return False
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, _noted_by_thread) for s in self.signals}
        self._thread = threading.Thread(target=self._read, name="moevlm-signals", daemon=True)
        self._thread.start()
        return True

    def close(self) -> None:
        if self._pipe is None:
            return
        for s, h in self._old.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(self._old_fd)
        r, w = self._pipe
        os.write(w, b"\0")  # wakes the thread: 0 is no signal
        self._thread.join(timeout=5)
        os.close(r)
        os.close(w)
        self._pipe = self._thread = None

    def _read(self) -> None:
        r = self._pipe[0]
        while True:
            for signum in os.read(r, 64):
                if signum == 0:
                    return
                # a wakeup fd set before ours (an event loop) still hears of it
                if self._old_fd >= 0:
                    try:
                        os.write(self._old_fd, bytes([signum]))
                    except OSError:
                        pass
                if signum in self.signals:
                    self.on_signal(signum)

    def on_signal(self, signum: int) -> None:
        name, now = signal.Signals(signum).name, self.clock()
        if not self.requested and self.exiting:
            self.requested, self.first_at = signum, now
            _say(
                f"{self.prefix}received {name} while the run closes: finishing the exit; send it again to exit "
                "at once"
            )
        elif not self.requested:
            self.requested, self.first_at = signum, now
            _say(
                f"{self.prefix}received {name}: finishing {self.describe()}, then writing a checkpoint and "
                f"exiting (code {ExitCode.INTERRUPTED:d}; 0 if that was the last step); send it again to exit at once "
                "without a checkpoint"
            )
        elif now - self.first_at > self.repeat_window_s:
            _say(
                f"{self.prefix}received {name} again: exiting at once during {self.describe()}, without a "
                f"checkpoint (exit code {second_signal(signum)}); the last complete checkpoint is kept"
            )
            sys.stdout.flush()
            os._exit(second_signal(signum))


def _noted_by_thread(signum, frame) -> None:
    """The Python-level handler: the wakeup fd already told StopSignals' thread."""


class StepWatchdog:
    """Reports a step far slower than the recent ones, aborts any phase past `abort_s`.
    `poll` holds the logic (tests drive it with a fake clock); `start` runs it every `every_s` in a thread."""

    def __init__(
        self,
        factor: float,
        min_s: float,
        abort_s: Optional[float],
        *,
        prefix: str = "",
        clock=time.monotonic,
        report: Callable[[str], None] | None = None,
        abort: Callable[[str], None] | None = None,
    ):
        self.factor, self.min_s, self.abort_s, self.prefix, self.clock = (
            factor,
            min_s,
            abort_s,
            prefix,
            clock,
        )
        self.report = report or self._report
        self.abort = abort or self._abort
        self.times: deque[float] = deque(maxlen=WINDOW)
        self.steps_done = 0
        self.step, self.phase, self.in_step, self.watched = 0, "set-up", False, False
        self.started = clock()
        self.reported = False
        self._stop = threading.Event()
        self._thread = None

    # ------------------------------------------------------- main thread
    def begin_step(self, step: int) -> None:
        self.step, self.in_step, self.reported = step, True, False
        self.phase, self.started = "data", self.clock()

    def at(self, phase: str, step: int | None = None, *, watched: bool = False) -> None:
        """What the trainer is doing now; outside a step it starts a new phase (with its own clock), which is
        held to the step limit when `watched` (a collective that normally takes milliseconds)."""
        if not self.in_step:
            self.started, self.reported, self.watched = self.clock(), False, watched
            if step is not None:
                self.step = step
        self.phase = phase

    def end_step(self) -> None:
        self.steps_done += 1
        if self.steps_done > WARMUP_STEPS:
            self.times.append(self.clock() - self.started)
        self.in_step = False
        self.at("logging")

    def describe(self) -> str:
        return (
            f"step {self.step} ({self.phase})"
            if self.in_step
            else f"{self.phase} after step {self.step}"
        )

    def elapsed(self) -> float:
        return self.clock() - self.started

    # ------------------------------------------------------- the check
    def limit(self) -> float | None:
        """Seconds a step may run before it is reported; None while warming up or when off."""
        if self.factor <= 0 or not self.times:
            return None
        return max(self.factor * statistics.median(self.times), self.min_s)

    def poll(self) -> None:
        elapsed, what = self.elapsed(), self.describe()
        if self.abort_s is not None and elapsed > self.abort_s:
            self.abort(
                f"{self.prefix}watchdog: {what} has run {elapsed:.0f}s > train.watchdog_abort_s="
                f"{self.abort_s:g}s: aborting with exit code {ExitCode.WATCHDOG:d}; a relaunch resumes from the "
                "last checkpoint (a stopped, crashed or much slower peer rank, or a hung filesystem, is "
                "the usual cause)"
            )
            return
        limit = self.limit()
        watched = self.in_step or self.watched
        if watched and not self.reported and limit is not None and elapsed > limit:
            self.reported = True
            self.report(
                f"{self.prefix}watchdog: {what} has run {elapsed:.0f}s, over {self.factor:g} x the median "
                f"step ({statistics.median(self.times):.2f}s) and train.watchdog_min_s={self.min_s:g}s; "
                "Python stacks of all threads follow (a stopped or slow peer rank shows as a wait in a "
                "collective; parallel.timeout_s ends it, train.watchdog_abort_s aborts)"
            )

    def _report(self, line: str) -> None:
        _say(line)
        _dump_stacks()

    def _abort(self, line: str) -> None:
        _say(line)
        if not self.reported:
            _dump_stacks()
        sys.stdout.flush()
        os._exit(ExitCode.WATCHDOG)

    # ------------------------------------------------------- the thread
    def start(self, every_s: float = 1.0) -> None:
        if self._thread is None and (self.factor > 0 or self.abort_s is not None):
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._loop, args=(every_s,), name="moevlm-watchdog", daemon=True
            )
            self._thread.start()

    def _loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.poll()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None


class Faults:
    """The trainer's view: signals, the watchdog's phase, the stop agreement and collective failures."""

    def __init__(self, rank: int, world: int, timeout_s: float, watchdog: StepWatchdog):
        self.rank, self.world, self.timeout_s, self.watchdog = rank, world, timeout_s, watchdog
        self.prefix = f"rank {rank}: " if world > 1 else ""
        self.signals = StopSignals(watchdog.describe, self.prefix)
        self.begin_step, self.at, self.end_step = (
            watchdog.begin_step,
            watchdog.at,
            watchdog.end_step,
        )

    def start(self) -> None:
        self.signals.install()
        self.watchdog.start()

    def closing(self) -> None:
        """The run is over (the trainer closes its loader and process group): signals no longer ask for a
        checkpoint, the watchdog stops."""
        self.signals.exiting = True
        self.watchdog.close()

    def close(self) -> None:
        self.signals.close()
        self.watchdog.close()

    def stop_requested(self, device: torch.device) -> int:
        """Collective over every rank: the largest signal number any rank received (0: none)."""
        flag = self.signals.requested
        if self.world > 1 and dist.is_initialized():
            self.at("stop-flag all-reduce", watched=True)
            t = torch.tensor([flag], dtype=torch.int32, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
        return flag


_TIMEOUT = ("timed out", "timeout")
_PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "socket closed",
    "remote process exited",
)


def describe_failure(
    err: BaseException, doing: str, elapsed_s: float | None, timeout_s: float
) -> str | None:
    """The line for an error that says a collective failed (gloo's, torch.distributed's), else None."""
    chain = errors_in(err)
    text = " ".join(f"{type(c).__name__}: {c}" for c in chain).lower()
    distributed = (
        any(isinstance(c, dist.DistError) for c in chain) or "gloo" in text or "nccl" in text
    )
    if any(k in text for k in _TIMEOUT) and (distributed or "collective" in text):
        what = f"a collective got no answer within parallel.timeout_s={timeout_s:g}s"
    elif any(k in text for k in _PEER_LOST) and distributed:
        what = "a collective lost its connection to a peer rank"
    else:
        return None
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    during = doing if elapsed_s is None else f"{doing}, {elapsed_s:.0f}s in"
    return (
        f"collective failure during {during}: {what}. Likely cause: another rank stopped, "
        f"crashed or is much slower (see its log: out of memory, a node failure, a hung filesystem); exit code "
        f"{ExitCode.COLLECTIVE:d}, a relaunch resumes from the last checkpoint. [{type(err).__name__}: {first}]"
    )


def checkpoint_write_line(err: BaseException, root, intact) -> str:
    """The line for a checkpoint write that failed outside DCP's writer (the folder, the marker, the
    checksums: a read-only or full file system, memory exhausted while committing): what failed, and
    `intact`, the newest complete checkpoint (None: none yet)."""
    path = next((x.filename for x in errors_in(err) if isinstance(x, OSError) and x.filename), root)
    why = (
        "the disk is full"
        if looks_like_disk_full(err)
        else "out of memory while committing it"
        if any(isinstance(x, MemoryError) for x in errors_in(err))
        else one_line(err)
    )
    kept = (
        f"{intact} is intact (resume=auto continues from it"
        if intact
        else "no earlier checkpoint (a relaunch starts over"
    )
    return (
        f"writing a checkpoint in {root} failed at {path}: {why}; {kept}; a checkpoint "
        "folder without its marker is never loaded)"
    )


def out_of_memory(err: BaseException) -> str | None:
    """ "device" or "host" when `err` is running out of memory (torch's OutOfMemoryError, the CPU
    allocator's refusal, MemoryError), else None."""
    if isinstance(err, torch.OutOfMemoryError):
        return "device"
    if isinstance(err, MemoryError) or "can't allocate memory" in str(err):
        return "host"
    return None


def oom_line(where: str, err: BaseException, step: int | None, intact) -> str:
    """The line for running out of `where` ("device" / "host") memory during step `step` + 1: the
    error's first line, `intact` (the newest complete checkpoint, None: none yet), what lowers the peak."""
    first = next((x for x in str(err).splitlines() if x.strip()), type(err).__name__)
    kept = f"checkpoint {intact} is intact" if intact else "no checkpoint was written yet"
    return (
        f"out of {where} memory during step {step + 1} ({first.strip()[:200]}); {kept}; "
        "lower train.micro_batch_size or data.pack.seq_len, or recompute more (model.recompute); "
        "`python -m moevlm.plan ... --fit GPU` proposes the cheapest change"
    )
