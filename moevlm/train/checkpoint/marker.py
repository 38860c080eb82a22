"""A checkpoint directory's completion marker, and the durable file operations around it.

    checkpoints/step_00000100/__0_0.distcp ... .metadata  COMPLETE.json
    COMPLETE.json = {"format": 2, "step": 100, "world_size": 2, "time": <unix s>,
                     "time_utc": "...", "extra": [names], "per_rank": [names],
                     "checksum": "crc32", "files": {name: {"bytes": n, "crc32": hex}},
                     "config", "architecture", "tokenizer": the launch (checkpoint/record.py)}

A directory is a complete checkpoint when `read_marker` accepts its marker; the marker is written
last (atomically) and removed first.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from moevlm.files import fsync_path as fsync_dir  # (the checkpoint's name for it)
from moevlm.train.integrity import CheckpointError, one_line

MARKER = "COMPLETE.json"
FORMAT = 2  # 2: expert gate_up stored as (E, D, 2, F) (moevlm.parallel.weights.storage_view)
STEP_DIR = re.compile(r"step_(\d+)$")


def step_of(path: Path) -> int:
    m = STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else -1


def utc_now(compact: bool = False) -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y%m%dT%H%M%SZ") if compact else now.isoformat(timespec="seconds")


def write_json_atomic(path: Path, obj: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def new_marker(
    step: int, world_size: int, extra: Iterable[str], per_rank: Iterable[str]
) -> dict[str, Any]:
    """The marker's fields before its checksums."""
    now = time.time()
    return {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "time": now,
        "time_utc": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(),
        "extra": sorted(extra),
        "per_rank": sorted(per_rank),
    }


def _not_a_checkpoint(path: Path) -> str:
    """Why `path` is no checkpoint, with what to set instead (in the job's keys)."""
    if not path.exists():
        return (
            f"{path} does not exist: train.resume takes auto, none or a checkpoint directory "
            "(<train.run_dir>/checkpoints/step_NNNNNNNN)"
        )
    steps = sorted(p.name for p in path.glob("step_*") if p.is_dir())
    if steps:
        return (
            f"{path} holds checkpoints ({', '.join(steps[-3:])}...) but is not one: name one, e.g. "
            f"train.resume={path / steps[-1]}, or use train.resume=auto with that run's "
            "train.run_dir"
        )
    if (path / "checkpoints").is_dir():
        return (
            f"{path} is a run directory, not a checkpoint: train.run_dir={path} train.resume=auto "
            f"resumes from its newest checkpoint that verifies, or name one with "
            f"train.resume={path / 'checkpoints'}/step_NNNNNNNN"
        )
    return (
        f"{path} is not a complete checkpoint (no {MARKER}): its save was interrupted or it is not "
        "a checkpoint directory; train.resume=auto resumes from the newest complete one in "
        "train.run_dir"
    )


def _marker_problem(marker: Any, path: Path) -> str | None:
    """What is wrong with the shape of a parsed marker (None when nothing)."""
    if not isinstance(marker, dict):
        return f"it holds a JSON {type(marker).__name__}, not an object"
    absent = [k for k in ("format", "step", "world_size") if k not in marker]
    if absent:
        return f"it has no {', '.join(absent)} (not a marker this version wrote)"
    for key, low in (("format", 1), ("step", 0), ("world_size", 1)):
        v = marker[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            return f"its {key} is {v!r}, not an integer >= {low}"
    if STEP_DIR.match(path.name) and marker["step"] != step_of(path):
        return f"its step is {marker['step']}, its directory's {step_of(path)}"
    for key in ("extra", "per_rank"):
        v = marker.get(key, [])
        if not isinstance(v, list) or not all(isinstance(n, str) for n in v):
            return f"its {key} is {v!r}, not a list of names"
    if "files" not in marker:
        return None  # written before checksums: loads with a warning
    files = marker["files"]
    if not isinstance(files, dict) or not files:
        return f"its file list is {'empty' if files in ({}, []) else repr(files)[:80]}"
    for name, f in files.items():
        if "/" in name or name in ("", ".", "..") or name == MARKER:
            return f"its file list names {name!r}, not a file of the checkpoint"
        if not (
            isinstance(f, dict)
            and isinstance(f.get("bytes"), int)
            and not isinstance(f.get("bytes"), bool)
            and isinstance(f.get("crc32"), str)
        ):
            return f"its entry for {name} is {f!r}, not {{'bytes': int, 'crc32': hex}}"
    return None


def read_marker(path: str | os.PathLike) -> dict[str, Any]:
    """The completion marker of checkpoint `path`; CheckpointError (one line) if it is missing,
    unreadable or malformed."""
    path = Path(path)
    marker = path / MARKER
    try:
        text = marker.read_text()
    except FileNotFoundError:
        raise CheckpointError(_not_a_checkpoint(path)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{marker} is unreadable ({one_line(e)})") from None
    try:
        got = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{marker} is not JSON ({one_line(e)})") from None
    problem = _marker_problem(got, path)
    if problem:
        raise CheckpointError(f"{marker} is malformed: {problem}")
    return got


def format_problem(path: Path, marker: Mapping[str, Any]) -> str:
    return (
        f"{path} was written in checkpoint format {marker['format']}; this version reads "
        f"format {FORMAT}; export it to Hugging Face format with the version that wrote it"
    )


def is_complete(path: Path) -> bool:
    try:
        read_marker(path)
    except CheckpointError:
        return False
    return True


def malformed(path: Path) -> str | None:
    """Why the marker `path` has is unusable; None when it has none (an interrupted save) or a
    sound one."""
    if not (path / MARKER).exists():
        return None
    try:
        read_marker(path)
    except CheckpointError as e:
        return str(e)
    return None


def remove_checkpoint(path: Path) -> None:
    """Marker first (durably), then the files: never a half-deleted complete checkpoint."""
    marker = path / MARKER
    if marker.exists():
        marker.unlink()
        fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)
