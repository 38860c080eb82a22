"""`CheckpointManager`: saves, finds, verifies, loads and prunes `root/step_XXXXXXXX` checkpoints.

Single process works without a process group; with one, `save`, `load`, `verify`,
`newest_verified` and `set_aside_after` are collective (every rank calls them) over
`process_group` or the default group.  Decisions about shared files are rank 0's, broadcast.
"""

from __future__ import annotations

import datetime
import logging
import os
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from moevlm.train import integrity
from moevlm.train.checkpoint import retention
from moevlm.train.checkpoint.base import check_base
from moevlm.train.checkpoint.dcp_io import (
    NO_DIST_WARNING,
    SafeReader,
    background_group,
    checkpoint_index,
    dcp_load,
    new_stager,
    write,
    write_async,
)
from moevlm.train.checkpoint.keys import SHOW, require
from moevlm.train.checkpoint.marker import (
    FORMAT,
    MARKER,
    format_problem,
    fsync_dir,
    malformed,
    new_marker,
    read_marker,
    remove_checkpoint,
    utc_now,
    write_json_atomic,
)
from moevlm.train.checkpoint.state_dicts import load_template, set_loaded, state_to_save
from moevlm.train.checkpoint.values import loaded_value, put, restore, value_template
from moevlm.train.integrity import (
    CheckpointError,
    checksum_files,
    file_problems,
    gib,
    looks_like_disk_full,
    one_line,
    state_bytes,
    stored_files,
)

log = logging.getLogger(__name__)


class CheckpointManager:
    """Saves, finds, verifies, loads and prunes `root/step_XXXXXXXX` checkpoints
    (docs/architecture.md, "Checkpoints")."""

    def __init__(
        self,
        root: str | os.PathLike,
        keep: int = 3,
        process_group: dist.ProcessGroup | None = None,
        async_save: bool = False,
        timeout: datetime.timedelta | None = None,
        base: dict | None = None,
        record: dict | None = None,
    ):
        self.root = Path(root)
        # what each marker records of the launch (moevlm.train.checkpoint.record): its config, the
        # model's architecture, the tokenizer's fingerprint; compared when a later launch resumes
        self.record = record
        # LoRA (moevlm.train.checkpoint.base): checkpoints hold the trainable parameters and their
        # optimizer state alone, and name the frozen base in the marker; None: the whole model
        self.base = base
        self.keep = keep
        self.process_group = process_group
        self.async_save = async_save
        # async saves: (directory, future of its background finish); the thread; CUDA's stager
        self._pending: tuple[Path, Future] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stager: Any = None
        # their collectives run beside the training's: a gloo group of their own (collective)
        self._async_group = background_group(process_group, timeout) if async_save else None
        self.resumed_from: Path | None = (
            None  # kept by pruning until a newer checkpoint is complete
        )
        self.rejected: list[tuple[Path, list[str]]] = []  # (moved to, problems) by newest_verified
        self._verified: set[Path] = set()

    # -- process group
    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group) if self.distributed else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group) if self.distributed else 1

    def _group(self, group: Any) -> Any:
        """`group` where given (the background group of async saves), else the manager's."""
        return group if group is not None else self.process_group

    def _barrier(self, group: Any = None) -> None:
        if self.distributed:
            dist.barrier(group=self._group(group))

    def _from_rank0(self, value: Any, group: Any = None) -> Any:
        """Rank 0's `value` on every rank (decisions about shared files are rank 0's)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, group=self._group(group), group_src=0)
        return box[0]

    def _gathered(self, value: Any, group: Any = None) -> list[Any]:
        if not self.distributed:
            return [value]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, value, group=self._group(group))
        return out

    # -- finding
    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def complete(self) -> list[Path]:
        """Complete checkpoint directories (with a marker; not yet verified), oldest first."""
        return retention.complete(self.root)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None (`newest_verified` also checks its files)."""
        done = self.complete()
        return done[-1] if done else None

    # -- verifying
    def verify(self, path: str | os.PathLike) -> list[str]:
        """What is wrong with checkpoint `path` ([] if it is sound; collective: every rank reads a
        share of its files and gets the same list)."""
        path = Path(path)
        try:
            marker = read_marker(path)
        except CheckpointError as e:
            return self._from_rank0([str(e)])
        if marker["format"] != FORMAT:
            return [format_problem(path, marker)]
        files = marker.get("files")
        if files is None:
            if self.rank == 0:
                log.warning(
                    "checkpoint %s has no checksums (written before they were added): not verified",
                    path,
                )
            return []
        names = sorted(files)
        mine = file_problems(path, files, names[self.rank :: self.world_size])
        # the index too, as the load would read it (nothing in it is run)
        if self.rank == 0 and not mine:
            try:
                SafeReader(path).read_metadata()
            except CheckpointError as e:
                mine.append(str(e))
        problems = sorted(p for part in self._gathered(mine) for p in part)
        if not problems:
            self._verified.add(path.absolute())
        return problems

    def newest_verified(self) -> Path | None:
        """The newest checkpoint that verifies (collective).  Newer ones that fail are moved into
        `root/rejected/` and listed in `self.rejected` with their problems; so are step directories
        whose marker is malformed (not JSON, wrong types, missing keys, an empty file list)."""
        bad = self._from_rank0(
            [(p, why) for _, p in retention.step_dirs(self.root) if (why := malformed(p))]
            if self.rank == 0
            else None
        )
        for path, why in bad:
            self._reject(path, [why])
        for path in reversed(self._from_rank0(self.complete())):
            problems = self.verify(path)
            if not problems:
                return path
            self._reject(path, problems)
        return None

    def _reject(self, path: Path, problems: list[str]) -> None:
        """Move `path` into `root/rejected/` (rank 0), logged in one line; collective."""
        if self.rank == 0:
            moved = self.set_aside(
                [path], "rejected", "failed verification: " + "; ".join(problems[:SHOW])
            )
            log.warning(
                "checkpoint %s failed verification (%s); moved to %s",
                path,
                "; ".join(problems[:SHOW]),
                moved[0],
            )
        self.rejected.append((self.root / "rejected" / path.name, problems))
        self._barrier()

    def set_aside(self, paths: Iterable[Path], folder: str, reason: str) -> list[Path]:
        """Move checkpoint directories into `root/folder/` (rank 0 only), with the reason in its README."""
        return retention.set_aside(self.root, paths, folder, reason)

    def set_aside_after(self, step: int, keep: Path | None = None) -> list[Path]:
        """Start one line of history at `step` (collective): move the step directories from `step` on
        (except `keep`, the checkpoint resumed from) into `root/abandoned-<time>/`.  Returns them."""
        moved = None
        if self.rank == 0:
            keep = keep.absolute() if keep is not None else None
            doomed = [
                p for s, p in retention.step_dirs(self.root) if s >= step and p.absolute() != keep
            ]
            if doomed:
                why = f"a run restarted from step {step}" + (f" ({keep})" if keep else "")
                moved = self.set_aside(doomed, "abandoned-" + utc_now(compact=True), why)
        return self._from_rank0(moved) or []

    # -- saving
    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        extra: Mapping[str, Any] | None = None,
        per_rank: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write checkpoint `step` (collective); returns its directory once it is complete, or with
        `async_save` once its state is copied to host memory and its write has started in the
        background (after waiting for the previous one: `wait`)."""
        self.wait()
        path = self.step_dir(step)
        extra, per_rank = dict(extra or {}), dict(per_rank or {})
        state = state_to_save(model, optimizer, extra, per_rank, self.rank, self.base is not None)
        need = sum(self._gathered(state_bytes(state)))
        problem = self._from_rank0(
            retention.make_room(self.root, need, path, self.resumed_from)
            if self.rank == 0
            else None
        )
        if problem:
            raise CheckpointError(problem)
        if self.rank == 0:
            self._clear(path)
        self._barrier()
        names = (sorted(extra), sorted(per_rank))
        if not self.async_save:
            try:
                write(state, path, self.process_group, self.distributed)
            except (Exception, CheckpointException) as e:  # (DCP's is a BaseException)
                raise self._write_failed(e, path, need) from e
            self._commit(step, path, names, self.process_group)
            return path
        upload = self._write_async(state, path, need)
        del state  # the staged copy is what is written
        self._pending = (
            path,
            self._executor.submit(self._finish_async, upload, step, path, need, names),
        )
        return path

    def wait(self) -> Path | None:
        """Block until the save in flight (async_save) is complete: written, checksummed, marked,
        older ones pruned.  Returns its directory (None when none was in flight); a failed write
        raises its CheckpointError here, once (collective like `save`)."""
        if self._pending is None:
            return None
        path, future = self._pending
        self._pending = None
        future.result()
        return path

    @property
    def pending(self) -> Path | None:
        """The directory of the save in flight (async_save), complete or not yet; None when none."""
        return self._pending[0] if self._pending is not None else None

    def close(self) -> None:
        """`wait` for the save in flight, then release the background thread and staging buffers."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _commit(self, step: int, path: Path, names: tuple[list, list], group: Any) -> None:
        """After every rank's write: the checksums (files split over the ranks), the marker and
        pruning (rank 0).  `group`: the process group (the background one for async saves)."""
        self._barrier(group)
        files_of = stored_files(path, skip=[MARKER]) if self.rank == 0 else None
        stored = self._from_rank0(files_of, group)
        files: dict[str, dict] = {}
        mine = checksum_files(path, stored[self.rank :: self.world_size])
        for part in self._gathered(mine, group):
            files.update(part)
        if self.rank == 0:
            write_json_atomic(
                path / MARKER,
                {
                    **new_marker(step, self.world_size, *names),
                    **({"base": self.base} if self.base is not None else {}),
                    **(self.record or {}),
                    "checksum": "crc32",
                    "files": dict(sorted(files.items())),
                },
            )
            retention.prune(self.root, self.keep, self.resumed_from)
        self._verified.add(path.absolute())
        self._barrier(group)

    def _write_async(self, state: dict, path: Path, need: int) -> Future:
        """The state copied to host memory now, written by DCP's thread over the background group;
        the future of that write."""
        if self._executor is None:
            self._start_background(state)
        try:
            return write_async(state, path, self._async_group, self.distributed, self._stager)
        except (Exception, CheckpointException) as e:
            raise self._write_failed(e, path, need) from e

    def _start_background(self, state: dict) -> None:
        """The thread that finishes async saves, and the stager (its host buffers are refilled by
        every later save)."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="moevlm-checkpoint")
        if not self.distributed:
            # DCP warns on every single-process save, here from its own thread (dcp_io.quiet_no_dist)
            warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
        self._stager = new_stager(state)

    def _finish_async(
        self, upload: Future, step: int, path: Path, need: int, names: tuple[list, list]
    ) -> None:
        """The background thread: DCP's write, then `_commit` over the background group."""
        try:
            upload.result()
        except (Exception, CheckpointException) as e:
            raise self._write_failed(e, path, need) from e
        self._commit(step, path, names, self._async_group)

    def _write_failed(self, e: BaseException, path: Path, need: int) -> CheckpointError:
        """The error of a failed write, after removing its partial directory (rank 0)."""
        if self.rank == 0:
            remove_checkpoint(path)
        free = integrity.free_bytes(self.root)
        full = looks_like_disk_full(e) or free < need
        last = self.latest()
        return CheckpointError(
            f"writing checkpoint {path.name} in {self.root} failed"
            + (
                f": the disk is full (about {gib(need)} needed, {gib(free)} free now)"
                if full
                else f": {one_line(e)}"
            )
            + "; the partial directory was removed"
            + (f" and {last.name} is intact (resume=auto continues from it)" if last else "")
        )

    def _clear(self, path: Path) -> None:
        if path.exists():
            log.warning("replacing existing checkpoint directory %s", path)
            remove_checkpoint(path)
        self.root.mkdir(parents=True, exist_ok=True)
        path.mkdir()
        fsync_dir(self.root)

    # -- loading
    def load(
        self,
        path: str | os.PathLike,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        extra: Mapping[str, Any] | None = None,
        per_rank: Iterable[str] = (),
        verify: bool = True,
    ) -> dict[str, Any]:
        """Load checkpoint `path` in place (collective), verifying its files first (unless this
        manager verified or wrote it already, or verify=False).

        Model and optimizer are loaded in place; `extra` values with
        load_state_dict are loaded in place, others are only named.  Returns
        {"step", "world_size" (at save), "extra": {name: object or saved value},
        "per_rank": {name: this rank's saved value, None if this rank did not
        exist at save time}}.
        """
        path = Path(path)
        marker = read_marker(path)
        if marker["format"] != FORMAT:
            raise ValueError(format_problem(path, marker))
        check_base(marker, self.base, path)
        if verify and path.absolute() not in self._verified:
            problems = self.verify(path)
            if problems:
                raise CheckpointError(
                    f"checkpoint {path} failed verification ({len(problems)} problem(s): "
                    f"{'; '.join(problems[:SHOW])}); name an earlier checkpoint, or use resume=auto, which "
                    "skips damaged ones"
                )
        saved = checkpoint_index(path)
        extra, names = dict(extra or {}), list(per_rank)
        state, originals = load_template(
            model,
            optimizer,
            extra,
            names,
            marker,
            saved,
            path,
            self.rank,
            self._keys_of_every_rank,
            self.base is not None,
        )
        dcp_load(state, path, process_group=self.process_group, no_dist=not self.distributed)
        set_loaded(state, originals, model, optimizer, self.base is not None)
        mine = state.get("per_rank", {}).get(f"rank{self.rank}", {})
        return {
            "step": marker["step"],
            "world_size": marker["world_size"],
            "extra": {
                n: restore(extra[n], loaded_value(state["extra"], n, f"extra.{n}", path))
                for n in extra
            },
            "per_rank": {
                n: loaded_value(mine, n, f"per_rank.rank{self.rank}.{n}", path)
                if n in mine
                else None
                for n in names
            },
        }

    def _keys_of_every_rank(self, model_sd: Mapping[str, Any]) -> set[str]:
        if not self.distributed:
            return set(model_sd)
        every: list = [None] * self.world_size
        dist.all_gather_object(every, sorted(model_sd), group=self.process_group)
        return set().union(*every)

    def load_all_ranks(self, path: str | os.PathLike, name: str) -> list[Any]:
        """Every saved rank's `per_rank[name]`, in rank order (not collective)."""
        path = Path(path)
        world = read_marker(path)["world_size"]
        saved = checkpoint_index(path)
        require([name], saved, "per_rank.rank0", path)
        keys = {
            r: f"per_rank.rank{r}.{name}"
            for r in range(world)
            if f"per_rank.rank{r}.{name}" in saved
        }
        state: dict[str, Any] = {"per_rank": {f"rank{r}": {} for r in keys}}
        for r, key in keys.items():
            put(state["per_rank"][f"rank{r}"], name, value_template(saved, key, path))
        dcp_load(state, path, no_dist=True)
        return [
            loaded_value(state["per_rank"][f"rank{r}"], name, keys[r], path) if r in keys else None
            for r in range(world)
        ]
