"""How a data worker process ends with the process that uses the loader, however that one ends.

    # in the worker, first thing (moevlm.data.loader.PackedDataset.__iter__)
    watch_parent(main_pid, through_fork_server=True)

The workers ignore the stop signals (SIGTERM, SIGINT, ...: moevlm.data.loader says why), so a
signal cannot end them; they end themselves once the training process is gone.

Design choices:
- With `forkserver` (the default start method) a worker's parent is the fork server, not the training
  process.  The fork server ends once every process holding the write end of its "alive" pipe has
  ended: the kernel closes the pipe, killed with SIGKILL included.  multiprocessing hands that end to
  every child the server forks (so the child could use the server too), which kept the server, and
  so the workers, alive after the training process died: each worker closes its copy (it starts no
  processes), then asks the kernel for SIGKILL when its parent ends (Linux
  `prctl(PR_SET_PDEATHSIG)`, through ctypes).  Training process gone -> fork server gone -> workers
  killed the moment the server's interpreter has shut down (about 1 s after a SIGKILL on a busy
  2-core machine: it holds torch from its preload), with no polling, and even while the dead training
  process is still an unreaped zombie (which a pid probe takes for alive).  Only under the fork server: the signal
  follows the parent *thread*, and the fork server forks from its one thread, whereas with
  `fork`/`spawn` the parent is whichever thread of the training process first iterated the loader,
  which may end long before the process.  The pipe end lives in a private attribute of
  multiprocessing.forkserver (Python 3.10-3.13): where it is not found, the probe below does the work.
- Everywhere (other start methods, other systems, a fork server kept alive by a pipe end that some
  other child of the training process inherited) a daemon thread in the worker probes the training
  process's pid once a second and exits the worker when it is gone.  A pid the kernel has reused for
  another process by then is taken for alive: the probe is the fallback, not the main path.
- SIGKILL, not a catchable signal: the workers ignore the stop signals, and a worker whose training
  process is gone has nobody to hand a row to, so nothing is lost (the loader's state lives in the
  training process).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

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
