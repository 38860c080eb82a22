"""A config error under torchrun: the `config error:` line is the last thing the launch prints.

    config_error_exit(lines, same_on_every_rank=True)   # prints (on the ranks that say it), exits 2

Outside torchrun (python train.py, srun), and for one job of a sweep (`end_launch=False`: the sweep
records the failure and goes on), this prints the lines and exits 2.  Under torchrun on Linux the
rank that says the error also ends torchrun's agent with SIGKILL before any worker exits, so the
agent prints no traceback or failure table after it, and ends the node's other workers; the
launch's exit status is then 137.  Why: docs/architecture.md.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import NoReturn

from moevlm.train.exit_codes import ExitCode

# the node's other workers exit by themselves within this once the agent is gone
SIBLING_GRACE_S = 3.0
# a rank that prints nothing waits at most this long for the agent to be ended
QUIET_WAIT_S = 20.0
_POLL_S = 0.02


def config_error_exit(lines, same_on_every_rank: bool = True, end_launch: bool = True) -> NoReturn:
    """Prints `config error: <line>` for each line on the ranks that say it, ends torchrun's agent
    (under torchrun, unless `end_launch` is false: a sweep's job, after which the sweep goes on), exits
    2 (SystemExit outside torchrun)."""
    agent = torchrun_agent() if end_launch else None
    rank_var = "LOCAL_RANK" if agent is not None else "RANK"
    says = not same_on_every_rank or os.environ.get(rank_var, "0") == "0"
    if says:
        for line in lines:
            print(f"config error: {line}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if agent is None:
        sys.exit(ExitCode.CONFIG)
    if says:
        end_agent(agent)
    else:
        _wait(lambda: os.getppid() != agent, QUIET_WAIT_S)
    # not sys.exit: with the agent gone, anything Python's shutdown prints (a warning, a thread's
    # error) would come after the shell's prompt
    os._exit(ExitCode.CONFIG)


def torchrun_agent() -> int | None:
    """The pid of the torchrun agent that started this process, or None (not under torchrun, or not
    on a system where the parent can be checked)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    agent = os.getppid()
    try:
        with open(f"/proc/{agent}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return None
    return agent if b"torch.distributed.run" in cmd or b"torchrun" in cmd else None


def end_agent(agent: int) -> None:
    """SIGKILL for the agent (before it sees a worker exit), then its other workers once they had
    SIBLING_GRACE_S to end by themselves."""
    siblings = [p for p in children(agent) if p != os.getpid()]
    try:
        os.kill(agent, signal.SIGKILL)
    except OSError:
        return
    _wait(lambda: not any(_running(p) for p in siblings), SIBLING_GRACE_S)
    for pid in siblings:
        if _running(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc/<pid>/stat)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _stat(int(entry))[1:] == [str(pid)]:
            out.append(int(entry))
    return out


def _stat(pid: int) -> list[str]:
    """[state, ppid] of a process, or [] when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the command name (in parentheses) may hold spaces
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []
    return fields[:2]


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    st = _stat(pid)
    return bool(st) and st[0] != "Z"


def _wait(done, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(_POLL_S)
