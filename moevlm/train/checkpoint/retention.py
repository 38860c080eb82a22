"""Which checkpoints a root keeps: finding step directories, pruning, making disk room, setting aside.

    checkpoints/step_00000100/                ... complete or interrupted saves
    checkpoints/rejected/step_...             failed verification or a malformed marker
    checkpoints/abandoned-<UTC time>/step_... newer than a checkpoint a run restarted from

Rank 0's work on shared files, without collectives (the manager decides who calls and when).
Set-aside checkpoints are moved, never deleted, with the reason in their folder's README.txt.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

from moevlm.train import integrity
from moevlm.train.checkpoint.marker import (
    MARKER,
    STEP_DIR,
    fsync_dir,
    is_complete,
    malformed,
    remove_checkpoint,
    step_of,
    utc_now,
)
from moevlm.train.integrity import dir_bytes, gib

log = logging.getLogger(__name__)


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every `root/step_XXXXXXXX`, by step."""
    if not root.is_dir():
        return []
    found = [(m, p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted((int(m.group(1)), p) for m, p in found)


def complete(root: Path) -> list[Path]:
    """Complete checkpoint directories (with a marker; not yet verified), oldest first."""
    return [p for _, p in step_dirs(root) if is_complete(p)]


def set_aside(root: Path, paths: Iterable[Path], folder: str, reason: str) -> list[Path]:
    """Move checkpoint directories into `root/folder/`, with the reason in its README."""
    dest = root / folder
    dest.mkdir(parents=True, exist_ok=True)
    moved = []
    for p in paths:
        target = dest / p.name
        if target.exists():
            target = dest / f"{p.name}.{time.time_ns()}"
        os.replace(p, target)
        moved.append(target)
    with open(dest / "README.txt", "a") as f:
        f.write(f"{utc_now()} moved here: {', '.join(p.name for p in moved)}: {reason}\n")
    fsync_dir(root)
    return moved


def abandoned(root: Path) -> list[Path]:
    """Step directories in `root/abandoned-<UTC time>/`: the oldest folder first, by step."""
    out: list[Path] = []
    for folder in sorted(root.glob("abandoned-*")):
        if folder.is_dir():
            steps = [p for p in folder.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
            out += sorted(steps, key=step_of)
    return out


def prune(root: Path, keep: int, resumed_from: Path | None) -> None:
    """Remove complete checkpoints beyond the newest `keep` (keep <= 0: none) and interrupted saves
    older than the newest complete one; `resumed_from` stays until a newer one is complete.  A
    marker that is there but unusable is moved into `rejected/` instead."""
    dirs = step_dirs(root)
    done = [(s, p) for s, p in dirs if is_complete(p)]
    if not done:
        return
    doomed = [p for _, p in done[:-keep]] if keep > 0 else []
    newest = done[-1][0]
    resumed = resumed_from.absolute() if resumed_from is not None else None
    if resumed is not None and not any(s > step_of(resumed) for s, _ in done):
        doomed = [p for p in doomed if p.absolute() != resumed]  # until a newer one is complete
    doomed += [p for s, p in dirs if s < newest and not (p / MARKER).exists()]
    for p in doomed:
        log.info("pruning checkpoint %s", p)
        remove_checkpoint(p)
    for s, p in dirs:  # a marker that is there but unusable: kept for inspection, not deleted
        if s < newest and (why := malformed(p)):
            moved = set_aside(root, [p], "rejected", why)
            log.warning("checkpoint %s: %s; moved to %s", p, why, moved[0])


def make_room(root: Path, need: int, path: Path, resumed_from: Path | None) -> str | None:
    """None when `need` bytes fit in root's file system, pruning older checkpoints first if that
    makes room (never the newest complete one nor `resumed_from`); else the message to stop with."""
    free = integrity.free_bytes(root)
    if free >= need:
        return None
    dirs = step_dirs(root)
    done = [p for _, p in dirs if is_complete(p)]
    keep = {done[-1]} if done else set()
    if resumed_from is not None:
        keep.add(Path(resumed_from))
    # abandoned lines first (oldest first), then half-written ones, then older complete ones
    spare = (
        abandoned(root)
        + [p for _, p in dirs if not (p / MARKER).exists()]
        + [p for p in done if p not in keep]
    )
    sizes = {p: dir_bytes(p) for p in spare}
    if free + sum(sizes.values()) < need:
        last = f"; {done[-1].name} is intact (resume=auto continues from it)" if done else ""
        return (
            f"not enough disk space for checkpoint {path.name} in {root}: it needs about {gib(need)}, "
            f"{gib(free)} are free"
            + (
                f" and pruning older checkpoints would free only {gib(sum(sizes.values()))}"
                if spare
                else ""
            )
            + f"; free space there or set train.run_dir on a larger file system{last}"
        )
    for p in spare:
        if integrity.free_bytes(root) >= need:
            break
        log.warning(
            "pruning %s (%s) to make room for checkpoint %s (%s needed)",
            p,
            gib(sizes[p]),
            path.name,
            gib(need),
        )
        remove_checkpoint(p)
        if p.parent != root:
            with open(p.parent / "README.txt", "a") as f:
                f.write(f"{utc_now()} pruned {p.name} to make room for {path.name}\n")
    return None
