"""Run a check on N gloo ranks in one launch (CPU, fresh forked ranks, file rendezvous).

    run_ranks(my_checks, 4, tmp_path, extra_arg)   # my_checks(rank, extra_arg) on every rank

`my_checks` must be a module-level function (it is pickled to the ranks).  An exception on any rank
fails the launch with that rank's traceback; a rank killed by a signal fails it with the signal.

Rank i is forked from launcher i: a process of the test session that imported torch and moevlm once
and then only waits (one thread, no op run, no process group), so a launch costs a fork, not an
interpreter start and `import torch` per rank.  One launcher per rank index keeps what separate
interpreters differ in (the str hash seed); each rank is given the test's environment, sys.path, cwd,
stdout and stderr at launch time, and fresh torch, numpy and random seeds (numpy's BLAS runs one
thread, as torch's ops do in a rank).  The launchers restart when the environment changes and end
with the session.  GLOO_RANKS_SPAWN=1 launches with mp.spawn (and runs run_forked's calls in turn).

    run_forked(fn, [(a,), (b,)])   # [fn(a), fn(b)], shared by two forked workers (no process group)
"""

import atexit
import datetime
import json
import os
import pickle
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist


class RankFailed(AssertionError):
    """A rank raised (its traceback is the message) or was killed."""


def run_ranks(check, world: int, tmp_path, *args, timeout_s: int = 120) -> None:
    init = str(tmp_path / "rdzv")
    if os.environ.get("GLOO_RANKS_SPAWN") == "1":
        import torch.multiprocessing as mp

        mp.spawn(_rank, args=(check, world, init, args, timeout_s), nprocs=world, join=True)
        return
    _launch(world, pickle.dumps((_rank, (check, world, init, args, timeout_s))))


def run_forked(fn, calls: list[tuple], workers: int = 2, keep_errors: bool = False) -> list:
    """[fn(*call) for call in calls], the calls shared by `workers` processes forked as the ranks are
    (no process group; each takes the next call not yet taken, seeded 0 as a test starts; torch
    threads split between them).  For single-process work that would leave a core idle (fake-tensor
    dry runs, the Triton interpreter); `fn` must be module-level and its results picklable.  A call
    that raises fails the whole call, or with `keep_errors` leaves a `CallFailed` in its place (the
    others still run): `result(x)` raises it where the result is used."""
    workers = max(1, min(workers, len(calls)))
    with tempfile.TemporaryDirectory(prefix="forked-") as out:
        if os.environ.get("GLOO_RANKS_SPAWN") == "1":
            _worker(0, 1, fn, calls, out, keep_errors)
        else:
            _launch(workers, pickle.dumps((_worker, (workers, fn, calls, out, keep_errors))))
        results = []
        for i in range(len(calls)):
            with open(os.path.join(out, f"{i}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


class CallFailed:
    """A `run_forked` call that raised: its traceback."""

    def __init__(self, text: str):
        self.traceback = text


def result(value):
    """`value`, or the failure of the forked call that should have made it."""
    if isinstance(value, CallFailed):
        raise RankFailed(f"the forked call failed:\n{value.traceback}")
    return value


def selected(request, argname: str) -> list:
    """The values of the parameter `argname` among the tests of the requesting module that this session
    runs (after -k and -m): a module fixture computes only those."""
    return [
        item.callspec.params[argname]
        for item in request.session.items
        if item.module is request.module
        and argname in getattr(getattr(item, "callspec", None), "params", {})
    ]


def _worker(index: int, workers: int, fn, calls: list[tuple], out: str, keep_errors: bool) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    try:
        for i, call in enumerate(calls):
            try:  # the first worker to create its claim runs call i
                os.close(os.open(os.path.join(out, f"{i}.claim"), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
            torch.manual_seed(0)
            try:
                value = fn(*call)
            except Exception:
                if not keep_errors:
                    raise
                value = CallFailed(traceback.format_exc())
            with open(os.path.join(out, f"{i}.pkl"), "wb") as f:
                pickle.dump(value, f)
    finally:
        torch.set_num_threads(threads)


def _rank(rank: int, check, world: int, init_file: str, args: tuple, timeout_s: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        torch.set_num_threads(1)  # N ranks share 2 cores
        check(rank, *args)
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalization: a gloo worker thread may still be releasing the last
    # collective's tensors, which takes the GIL, and a thread doing so while Python finalizes aborts
    # the rank with SIGABRT ("terminate called without an active exception").  An exception above
    # still reaches the launcher (it never gets here).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_max_over_ranks(values: dict, out: str) -> None:
    """Every rank's `values` (name -> float, the same names everywhere), their max over the world written
    by rank 0 to `out` as JSON (read back with `json.loads`)."""
    t = torch.tensor([values[k] for k in sorted(values)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(dict(zip(sorted(values), t.tolist()))))


# ------------------------------------------------------------------ the test session's side
# What the launchers import before waiting: what a rank of these tests imports anyway.
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "torch.testing",
    "pytest",
    "moevlm.config",
    "moevlm.train.trainer",
    "moevlm.plan.dry_run",
    "moevlm.plan.measure",
    "moevlm.dispatch.alltoall",
)
# environment read when used, not at import (the ranks are given the session's at launch time): a
# change of any other variable restarts the launchers.  The trainer sets CUBLAS_WORKSPACE_CONFIG.
_VOLATILE = ("PYTEST_CURRENT_TEST", "CUBLAS_WORKSPACE_CONFIG")
_launchers: list = []
_launchers_env: dict = {}


def _environment() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _VOLATILE}


def _launch(world: int, payload: bytes) -> None:
    global _launchers_env
    if _environment() != _launchers_env:
        _close_launchers()
        _launchers_env = _environment()
    while len(_launchers) < world:
        _launchers.append(_Launcher(len(_launchers)))
    request = pickle.dumps(
        {"env": dict(os.environ), "path": list(sys.path), "cwd": os.getcwd(), "payload": payload}
    )
    busy = {}
    try:
        for rank in range(world):
            _launchers[rank].send(b"R" + struct.pack("<I", rank) + request, fds=[1, 2])
            busy[rank] = _launchers[rank]
        failed = None
        with selectors.DefaultSelector() as sel:
            for rank, launcher in busy.items():
                sel.register(launcher.sock, selectors.EVENT_READ, rank)
            while busy:
                for key, _ in sel.select():
                    rank = key.data
                    reply = busy.pop(rank).receive()
                    sel.unregister(key.fileobj)
                    if reply is not None and failed is None:
                        failed = rank, reply
                        for other in busy.values():  # the others wait in a collective: stop them
                            other.send(b"K")
        if failed is not None:
            rank, why = failed
            raise RankFailed(f"\n\n-- rank {rank} of {world} {why}")
    except BaseException:
        if busy:  # interrupted: the launchers go, with their ranks
            _close_launchers()
        raise


@atexit.register
def _close_launchers() -> None:
    """Every launcher told to leave first, then each waited for: they leave together."""
    for launcher in _launchers:
        launcher.sock.close()
    while _launchers:
        _launchers.pop().close()


class _Launcher:
    """Launcher `index` (a `python -c` process running `_serve`), over a Unix socket."""

    def __init__(self, index: int):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        boot = f"import sys; sys.path[:] = {list(sys.path)!r}; import gloo_ranks; gloo_ranks._serve({theirs.fileno()})"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", boot],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            # numpy's OpenBLAS would start its thread pool at import: the launcher stays one thread
            env=dict(os.environ, OPENBLAS_NUM_THREADS="1"),
        )
        theirs.close()

    def send(self, message: bytes, fds=()) -> None:
        socket.send_fds(self.sock, [struct.pack("<Q", len(message))], list(fds))
        self.sock.sendall(message)

    def receive(self):
        """None when the rank succeeded, else why it failed."""
        try:
            return pickle.loads(_read_message(self.sock))
        except EOFError:
            self.proc.wait()
            self.log.seek(0)
            log = self.log.read().decode(errors="replace")[-4000:]
            return f"lost its launcher (exit status {self.proc.returncode}):\n{log}"

    def close(self) -> None:
        self.sock.close()  # the launcher kills its rank and leaves at end of input
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _read_message(sock: socket.socket, fds: int = 0):
    """One message of `send` (and the file descriptors that came with it when `fds`)."""
    head, got, *_ = socket.recv_fds(sock, 8, fds) if fds else (sock.recv(8), [])
    head += _read_exactly(sock, 8 - len(head)) if head else b""
    if not head:
        raise EOFError
    body = _read_exactly(sock, struct.unpack("<Q", head)[0])
    return (body, got) if fds else body


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


# ------------------------------------------------------------------ the launcher's side
def _serve(fd: int) -> None:
    """Import PRELOAD, then per request fork the rank, wait for it (or a kill) and reply."""
    _die_with_parent(signal.SIGTERM)
    sock = socket.socket(fileno=fd)
    for name in PRELOAD:
        __import__(name)
    _warm_up()
    with tempfile.TemporaryDirectory(prefix="gloo-ranks-") as errors:
        _serve_requests(sock, errors)
    # the session is gone or done: leave without finalizing torch's modules (seconds of CPU a launcher)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _warm_up() -> None:
    """What every rank's first Trainer would otherwise pay for once per launch (about 0.7 CPU-s a
    rank, measured): torch.use_deterministic_algorithms imports torch._inductor (and _dynamo), the
    first Hydra compose discovers its plugins and builds its parser, PIL registers its image plugins
    on the first open.  None of it starts a thread or leaves state a rank would not set up itself
    (Hydra's ConfigStore holds the job schema, as after any compose; `_not_fresh` checks before every
    fork)."""
    try:  # only a saving: a launcher that cannot warm up still serves (its ranks pay as before)
        import PIL.Image
        import torch._inductor  # noqa: F401

        from moevlm.config import compose_job

        PIL.Image.init()
        compose_job([])
    except Exception:  # noqa: BLE001
        traceback.print_exc()


def _serve_requests(sock: socket.socket, errors: str) -> None:
    while True:
        try:
            message, fds = _read_message(sock, fds=2)
        except EOFError:
            return
        if message[:1] != b"R":
            for passed in fds:
                os.close(passed)
            continue  # a kill for a rank that has already ended
        rank = struct.unpack("<I", message[1:5])[0]
        err_file = os.path.join(errors, f"rank{rank}.txt")
        problems = _not_fresh()
        pid = os.fork() if not problems else -1
        if pid == 0:
            _child(sock, rank, pickle.loads(message[5:]), fds, err_file)
        for passed in fds:
            os.close(passed)
        if problems:
            _reply(sock, f"not started: the launcher is not fresh: {problems}")
            continue
        if not _wait(sock, pid):
            return
        _, status = os.waitpid(pid, 0)
        why = None
        if os.path.exists(err_file):
            with open(err_file) as f:
                why = "terminated with the following error:\n" + f.read()
            os.unlink(err_file)
        elif os.WIFSIGNALED(status):
            why = f"terminated with signal {signal.Signals(os.WTERMSIG(status)).name}"
        elif os.WEXITSTATUS(status) != 0:
            why = f"terminated with exit code {os.WEXITSTATUS(status)}"
        _reply(sock, why)


def _not_fresh() -> list[str]:
    problems = []
    if len(os.listdir("/proc/self/task")) != 1:
        problems.append(f"{len(os.listdir('/proc/self/task'))} threads")
    if dist.is_initialized():
        problems.append("a process group")
    if torch.are_deterministic_algorithms_enabled() or not torch.is_grad_enabled():
        problems.append("torch flags changed")
    if torch.get_default_dtype() != torch.float32:
        problems.append("default dtype changed")
    return problems


def _wait(sock: socket.socket, pid: int) -> bool:
    """Until the rank `pid` ends; a kill from the session kills it first.  False when the session
    is gone (the rank is killed and reaped)."""
    with selectors.DefaultSelector() as sel:
        pidfd = os.pidfd_open(pid)
        sel.register(pidfd, selectors.EVENT_READ)
        sel.register(sock, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in sel.select():
                    if key.fileobj == pidfd:
                        return True
                    kill = sock.recv(9, socket.MSG_PEEK)
                    if not kill:  # the session is gone
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        return False
                    if len(kill) == 9:
                        _read_message(sock)
                        os.kill(pid, signal.SIGKILL)
        finally:
            os.close(pidfd)


def _reply(sock: socket.socket, why) -> None:
    body = pickle.dumps(why)
    sock.sendall(struct.pack("<Q", len(body)) + body)


def _child(sock: socket.socket, rank: int, request: dict, fds, err_file: str) -> None:
    """The forked rank: the session's stdout, stderr, environment, sys.path and cwd, fresh seeds."""
    try:
        sock.close()
        _die_with_parent(signal.SIGKILL)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = request["path"]
        os.chdir(request["cwd"])
        torch.seed()  # (random reseeds itself at fork)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        target, args = pickle.loads(request["payload"])
        target(rank, *args)
    except BaseException:  # noqa: BLE001 (any exception fails the launch with its traceback)
        with open(err_file, "w") as f:
            f.write(traceback.format_exc())
    finally:  # _rank leaves by itself; a worker ends here (exit status 0 unless it wrote an error)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if os.path.exists(err_file) else 0)


def _die_with_parent(sig: int) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(1)
