"""Checkpoint files: checksums, verification and disk room (no process groups here).

sums = checksum_files(path, names)       # {name: {"bytes": n, "crc32": "1a2b3c4d"}}
problems = file_problems(path, sums)     # [] when every file is there, of its size and checksum
need = state_bytes(state)                # bytes DCP will write for this rank's state
free_bytes(root)                         # free space of the file system holding `root`
looks_like_disk_full(e)                  # ENOSPC/EDQUOT anywhere in a write's exception chain
"""

from __future__ import annotations

import errno
import os
import shutil
import zlib
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, damaged, cannot be written, or does not fit what is loaded into it."""


CHUNK = 8 << 20
THREADS = 4
MARGIN, PER_ITEM, PER_CHECKPOINT = 1.01, 4096, 64 << 10  # see state_bytes


def crc32_file(path: str | os.PathLike) -> str:
    """The CRC-32 of a file's bytes as 8 hex digits (read in chunks)."""
    crc, buf = 0, bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def checksum_files(
    root: str | os.PathLike, names: Iterable[str], threads: int = THREADS
) -> dict[str, dict]:
    """{name: {"bytes", "crc32"}} of the files `names` in `root`."""
    root, names = Path(root), list(names)
    with ThreadPoolExecutor(max(1, min(threads, len(names)))) as ex:
        crcs = list(ex.map(lambda n: crc32_file(root / n), names))
    return {n: {"bytes": (root / n).stat().st_size, "crc32": c} for n, c in zip(names, crcs)}


def file_problems(
    root: str | os.PathLike,
    expected: Mapping[str, Mapping[str, Any]],
    names: Iterable[str] | None = None,
    threads: int = THREADS,
) -> list[str]:
    """What is wrong with the files `names` (default: all of `expected`) of `root`: missing,
    another size (truncated or grown), another checksum (bytes changed); [] when all are sound."""
    root = Path(root)
    names = sorted(expected) if names is None else list(names)
    problems, to_read = [], []
    for name in names:
        want = expected[name]
        try:
            size = (root / name).stat().st_size
        except OSError as e:
            problems.append(f"{name}: missing ({e.strerror})")
            continue
        if size != want["bytes"]:
            problems.append(
                f"{name}: {size} bytes, {want['bytes']} when saved ("
                f"{'truncated' if size < want['bytes'] else 'grown'})"
            )
        else:
            to_read.append(name)
    with ThreadPoolExecutor(max(1, min(threads, len(to_read) or 1))) as ex:
        for name, got in zip(to_read, ex.map(lambda n: _crc_or_error(root / n), to_read)):
            if got != expected[name]["crc32"]:
                problems.append(
                    f"{name}: "
                    + (
                        got
                        if got.startswith("unreadable")
                        else f"checksum {got}, {expected[name]['crc32']} when saved (bytes changed)"
                    )
                )
    return sorted(problems)


def _crc_or_error(path: Path) -> str:
    try:
        return crc32_file(path)
    except OSError as e:
        return f"unreadable ({e.strerror})"


def stored_files(path: str | os.PathLike, skip: Iterable[str] = ()) -> list[str]:
    """The regular files of a checkpoint directory that its checksums cover, sorted."""
    skip = set(skip)
    return sorted(
        p.name
        for p in Path(path).iterdir()
        if p.is_file() and p.name not in skip and not p.name.endswith(".tmp")
    )


def state_bytes(state: Any) -> int:
    """Bytes DCP writes for a nested state dict: the tensors (a DTensor's local shard) and byte
    strings, plus a margin per item (DCP frames each one with torch.save's zip records, ~1.5 KB,
    and lists it in .metadata)."""
    nbytes, items = _payload(state)
    return int(nbytes * MARGIN) + items * PER_ITEM + PER_CHECKPOINT


def _payload(state: Any) -> tuple[int, int]:
    if isinstance(state, Mapping):
        parts = [_payload(v) for v in state.values()]
    elif isinstance(state, (list, tuple)):
        parts = [_payload(v) for v in state]
    elif isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size(), 1
    elif isinstance(state, (bytes, bytearray)):
        return len(state), 1
    else:
        return 0, 0
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes (for this user) on the file system that holds `path` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes of the files under `path` (what deleting it frees, roughly)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def errors_in(e: BaseException) -> list[BaseException]:
    """`e` first, then its causes and contexts, and the per-rank exceptions a DCP CheckpointException
    gathered (each once: cycles are cut)."""
    out, todo = [], [e]
    while todo:
        x = todo.pop()
        if x is None or any(x is y for y in out):
            continue
        out.append(x)
        if isinstance(x, CheckpointException):
            todo += [f[0] if isinstance(f, tuple) else f for f in x.failures.values()]
        todo += [x.__cause__, x.__context__]
    return out


_DISK_FULL = (
    "no space left",
    "disk quota",
    "unexpected pos",
)  # torch's zip writer reports a short write so


def looks_like_disk_full(e: BaseException) -> bool:
    return any(
        isinstance(x, OSError)
        and x.errno in (errno.ENOSPC, errno.EDQUOT)
        or any(t in str(x).lower() for t in _DISK_FULL)
        for x in errors_in(e)
    )


def write_failed_line(e: BaseException, path=None) -> str:
    """The line for a write of the run other than a checkpoint's (metrics, TensorBoard, a profile table,
    set-up) that failed, a full disk most often; `path`: what was written, else the error's file name."""
    path = path or next(
        (x.filename for x in errors_in(e) if isinstance(x, OSError) and x.filename), None
    )
    why = "the disk is full" if looks_like_disk_full(e) else one_line(e)
    return (
        f"{f'writing {path}' if path else 'a write'} failed: {why}; the checkpoints are intact (a "
        "relaunch with room resumes from the last one)"
    )


def one_line(e: BaseException) -> str:
    """The innermost error of a (DCP) exception, in one line."""
    inner = [x for x in errors_in(e) if not isinstance(x, CheckpointException)] or [e]
    return f"{type(inner[0]).__name__}: {str(inner[0]).splitlines()[0] if str(inner[0]) else ''}"
