"""The run directory belongs to one run: claimed and locked by the launch that uses it.

    run = RunDir.claim(path, default=True)      # rank 0: pick, check, lock; others: RunDir.joined(path)
    ...                                         # validate, build, resume
    run.write_config(yaml_text)                 # only once the resume checks passed
    run.release()                               # at exit; the kernel releases it if the process dies

A directory is taken when it is empty or holds the marker `.moevlm-run`; the lock is an flock on
`.moevlm-run.lock`, held by rank 0's process.  `OURS` names what moevlm writes there (the marker
and lock, `config.yaml`, `config.previous.yaml`, `metrics.jsonl`, `checkpoints/`, `tb/`,
`profile/`, `wandb/`), none of which may be a symlink.  Why: docs/architecture.md.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from moevlm.errors import ConfigError

MARKER, LOCK = ".moevlm-run", ".moevlm-run.lock"
OURS = (
    MARKER,
    LOCK,
    "config.yaml",
    "config.previous.yaml",
    "metrics.jsonl",
    "checkpoints",
    "tb",
    "profile",
    "wandb",
)
JOB_GROUPS = {"model", "data", "parallel", "optim", "train"}  # what a moevlm config.yaml holds


class RunDirError(ConfigError):
    """The run directory cannot be used by this launch; the message says why and what to do (train.py
    prints it as a config error, exit 2)."""


_HELD: dict[Path, int] = {}  # this process's locks: a second Trainer in one process reuses its lock


@dataclass
class RunDir:
    path: Path
    _fd: int | None = None

    @classmethod
    def claim(
        cls, path: str | os.PathLike, *, default: bool = False, what: str = "train.run_dir"
    ) -> RunDir:
        """Rank 0's claim: create (a fresh name if `default`), check it is a moevlm run or empty, lock it.
        `what` names the option that chose `path` in the refusals (a sweep's folder: moevlm.train.sweep)."""
        path = _create_unique(Path(path), what) if default else Path(path)
        path = path.absolute()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise RunDirError(
                f"{what}={path} is a file, not a directory; name a directory"
            ) from None
        except OSError as err:
            raise RunDirError(f"{what}={path} cannot be created: {err.strerror}") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise RunDirError(f"{what}={path} is not writable by this user; name another directory")
        _check_ownership(path, what)
        run = cls(path, _HELD.get(path) or _lock(path, what))
        _HELD[path] = run._fd
        _write_text(
            path / MARKER, json.dumps({"made_by": "moevlm", "created": _now()}) + "\n", keep=True
        )
        return run

    @classmethod
    def joined(cls, path: str | os.PathLike) -> RunDir:
        """A rank other than 0: rank 0 claimed `path` for the launch."""
        return cls(Path(path).absolute())

    def write_config(self, text: str) -> None:
        """The job's config.yaml; the one it replaces (if different) is kept as config.previous.yaml."""
        current = self.path / "config.yaml"
        if current.exists() and _read_text(current) != text:
            _write_text(self.path / "config.previous.yaml", _read_text(current))
        _write_text(current, text)

    def release(self) -> None:
        if self._fd is not None and _HELD.get(self.path) == self._fd:
            del _HELD[self.path]
            os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None


def holder(path: Path) -> str:
    """Who holds the lock of run directory `path`, as its holder wrote it ('' if unknown)."""
    try:
        info = json.loads(_read_text(path / LOCK) or "{}")
    except (OSError, ValueError):
        return ""
    keys = ("host", "pid", "launch", "started")
    return ", ".join(f"{k} {info[k]}" for k in keys if info.get(k) not in (None, ""))


# ----------------------------------------------------------------- internals
def _create_unique(path: Path, what: str) -> Path:
    """`path`, or `path-1`, `path-2`, ... : the first that this call creates."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for n in range(10_000):
        candidate = path if n == 0 else path.with_name(f"{path.name}-{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise RunDirError(f"no free directory name beside {path}; set {what}")


def _check_ownership(path: Path, what: str) -> None:
    links = [name for name in OURS if (path / name).is_symlink()]
    if links:
        raise RunDirError(
            f"{what}={path} holds symbolic links where moevlm writes ({', '.join(links)}): "
            "moevlm never writes through a link; remove them or name another directory"
        )
    if (
        (path / MARKER).is_file()
        or not any(path.iterdir())
        or _made_by_old_moevlm(path)
        or _old_sweep(path)
    ):
        return
    raise RunDirError(
        f"{what}={path} exists, is not empty and was not made by moevlm (no {MARKER} file): "
        "nothing in it was touched; name a new or empty directory"
    )


def _made_by_old_moevlm(path: Path) -> bool:
    """A run directory written before the marker existed: its config.yaml holds the job's groups."""
    try:
        config = yaml.safe_load(_read_text(path / "config.yaml"))
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(config, dict) and JOB_GROUPS <= set(config)


def _old_sweep(path: Path) -> bool:
    """A sweep folder written before the marker existed: job folders, status/ and Hydra's multirun.yaml."""
    names = {p.name for p in path.iterdir()}
    return "status" in names and all(n.isdigit() or n in ("status", "multirun.yaml") for n in names)


def _lock(path: Path, what: str) -> int:
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        who = holder(path) or "another process"
        raise RunDirError(
            f"{what}={path} is in use by another launch ({who}): two runs in one directory "
            "would overwrite each other's checkpoints and metrics; wait for it to end, or name "
            f"another {what}"
        ) from None
    info = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "launch": os.environ.get("TORCHELASTIC_RUN_ID", ""),
        "started": _now(),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    return fd


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _read_text(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        return f.read()


def _write_text(path: Path, text: str, keep: bool = False) -> None:
    """Write `path` without following a link there (`keep`: leave an existing file as it is)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_EXCL if keep else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(text)


__all__ = ["OURS", "RunDir", "RunDirError", "holder"]
