"""How the loader's worker processes end with the process that uses the loader, however it ends, and
what the trainer is told when one dies first.

    watch_parent(main_pid, through_fork_server=True)   # in each worker, first thing
    close_at_exit(loader)                              # loaders still open are closed at interpreter exit
    line = worker_death(err, workers)                  # torch's dead-worker error as one line (or None)
    dead = dead_workers(workers, grace_s)              # the workers that have ended

The workers ignore the stop signals, so none ends them: they end with the training process (its fork
server's parent-death signal, and a once-a-second pid probe as the fallback).
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing.connection as mp_connection  # (imports multiprocessing.util: its exit hook first)
import os
import re
import signal
import threading
import time
import weakref

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PROBE_EVERY_S = 1.0


def die_with_parent() -> bool:
    """Asks the kernel to SIGKILL this process when its parent ends (Linux); False where it cannot."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def watch_parent(main_pid: int, *, through_fork_server: bool) -> None:
    """Ends this worker once the process `main_pid` (the loader's user) is gone: the parent-death
    signal where the parent is the fork server, and a once-a-second pid probe everywhere."""
    if through_fork_server and _drop_fork_server_pipe():
        die_with_parent()
    threading.Thread(target=_exit_without, args=(main_pid,), daemon=True).start()


def _drop_fork_server_pipe() -> bool:
    """Closes this forkserver child's copy of the server's alive pipe, so that the server ends with the
    training process; False where multiprocessing keeps it elsewhere (nothing changed)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if not isinstance(fd, int):
        return False
    os.close(fd)
    server._forkserver_alive_fd = None
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        # a reused pid of another user: ours is gone
        return False
    return True


def _exit_without(pid: int, every_s: float = PROBE_EVERY_S) -> None:
    """Worker thread: ends this process once the process `pid` is gone (checked at once, then every
    `every_s`; the first check catches a parent that ended before the death signal was asked for)."""
    while _alive(pid):
        time.sleep(every_s)
    os._exit(0)


_OPEN: weakref.WeakSet = weakref.WeakSet()  # loaders with workers, closed at interpreter exit


def close_at_exit(loader) -> None:
    """Closes `loader` (its `close()`) at interpreter exit if it is still open then."""
    _OPEN.add(loader)


# registered after multiprocessing's own exit hook (imported above), so it runs before that one
# terminates and joins the workers, which ignore SIGTERM
@atexit.register
def _close_open_loaders() -> None:
    for loader in list(_OPEN):
        loader.close()


_DIED = re.compile(r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) (.*)")


def worker_death(err: BaseException, workers=()) -> str | None:
    """One line for torch's error about a dead DataLoader worker (None for any other error): which
    worker, how it ended (its exit code or signal, from `workers`' processes where known) and the likely
    cause."""
    match = _DIED.search(str(err))
    if match is None:
        return None
    pids, how = match.group(1).strip(), match.group(2).strip().split(". ")[0].rstrip(".")
    codes = [w.exitcode for w in workers if str(w.pid) in pids.split(", ") and w.exitcode]
    if codes and codes[0] < 0:
        how = f"was killed by {signal.Signals(-codes[0]).name}"
    elif codes:
        how = f"exited with code {codes[0]}"
    if "Killed" in how or "SIGKILL" in how or "exited unexpectedly" == how:
        free = _available_gib()
        cause = (
            "most likely the kernel's out-of-memory killer (see dmesg"
            + (f"; {free:.1f} GiB available now" if free is not None else "")
            + "): lower data.num_workers, data.prefetch_factor or data.image.max_pixels"
        )
    elif "Bus error" in how:
        cause = "most likely shared memory (/dev/shm) ran out: enlarge it or lower data.num_workers"
    else:
        cause = "run with data.num_workers=0 to see the error in this process"
    return (
        f"data worker (pid {pids}) {how}: {cause}; the run stops, and a relaunch resumes exactly from "
        "the last checkpoint"
    )


# a killed worker is reaped within milliseconds; a busy machine may take more
WORKER_REAP_GRACE_S = 30.0


def dead_workers(workers, grace_s: float) -> list:
    """The workers that have ended, waiting up to `grace_s` for one to be reported (its exit reaches
    the trainer only once its parent, the fork server, reaps it); empty if all are alive by then."""
    workers = list(workers)
    deadline = time.monotonic() + grace_s
    while True:
        dead = [w for w in workers if not w.is_alive()]
        if dead or not workers or time.monotonic() >= deadline:
            return dead
        mp_connection.wait([w.sentinel for w in workers], timeout=0.1)


def _available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(x.split()[1]) for x in f if x.startswith("MemAvailable:"))
        return kib / 2**20
    except (OSError, StopIteration, ValueError):
        return None
