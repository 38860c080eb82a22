"""torch.distributed.checkpoint (DCP) calls as checkpoints make them: writing, synchronously or in the
background, and reading without running code from the checkpoint.

    write(state, path, process_group, distributed)          # dcp.save
    write_async(state, path, group, distributed, stager)    # dcp.async_save: a future of the write
    dcp_load(state, path, process_group=..., no_dist=...)   # dcp.load, refusing any pickled object
    checkpoint_index(path)                                   # flattened key -> DCP storage metadata
"""

from __future__ import annotations

import datetime
import inspect
import os
import pickle
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

try:  # (recent torch: a stager that keeps its host buffers between saves)
    from torch.distributed.checkpoint.staging import DefaultStager as _DefaultStager
    from torch.distributed.checkpoint.staging import StagingOptions as _StagingOptions
except ImportError:  # pragma: no cover
    _DefaultStager = _StagingOptions = None

from moevlm.train.integrity import CheckpointError, one_line

NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


@contextmanager
def quiet_no_dist() -> Iterator[None]:
    """DCP warns on every single-process save/load, even when asked for one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
        yield


# ------------------------------------------------------------ writing

# TEST ONLY (tests/train/test_checkpoint.py, test_trainer.py): a folder F.  A rank writing checkpoint
# directory S while F/hold.S exists, having written its data files (DCP's index not yet), creates
# F/held.S and waits until hold.S is removed: a kill or a check lands mid-write without a race.
HOLD_ENV = "MOEVLM_TEST_HOLD_CHECKPOINT_WRITE"


class _Writer(FileSystemWriter):
    """DCP's FileSystemWriter with the test-only pause of HOLD_ENV (no pause when it is unset)."""

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        out = super().write_data(*args, **kwargs)
        if folder := os.environ.get(HOLD_ENV):
            hold = Path(folder) / f"hold.{Path(self.path).name}"
            if hold.exists():
                (hold.parent / f"held.{Path(self.path).name}").touch()
                while hold.exists():
                    time.sleep(0.02)
        return out


def write(state: dict, path: Path, process_group: Any, distributed: bool) -> None:
    """dcp.save of `state` into `path` (collective with a process group)."""
    with quiet_no_dist():
        dcp.save(
            state,
            storage_writer=_Writer(path),
            process_group=process_group,
            no_dist=not distributed,
        )


def write_async(state: dict, path: Path, group: Any, distributed: bool, stager: Any) -> Future:
    """dcp.async_save: the state copied to host memory now (into the stager's buffers, where there
    is one), written by DCP's thread over `group`; the future of that write."""
    kwargs = {"async_stager": stager} if stager is not None else {}
    got = dcp.async_save(
        state,
        storage_writer=_Writer(path),
        process_group=group,
        no_dist=not distributed,
        **kwargs,
    )
    # (an AsyncSaveResponse where the stager is itself asynchronous: ours is not)
    return getattr(got, "upload_completion", got)


def background_group(
    group: dist.ProcessGroup | None, timeout: datetime.timedelta | None
) -> dist.ProcessGroup | None:
    """A gloo group over the ranks of `group` (None: every rank) for the collectives of async saves,
    which run in a background thread while training's run on `group` (collective; None without a
    process group).  DCP's async save wants a CPU backend; a group of its own keeps the two
    threads' collectives from interleaving."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    return dist.new_group(ranks, timeout=timeout, backend="gloo")


def _takes_stager() -> bool:
    return "async_stager" in inspect.signature(dcp.async_save).parameters


def new_stager(state: dict) -> Any:
    """Host buffers for async saves (pinned when `state` is on CUDA), made at the first save and
    refilled by the next ones; None where this torch has no such stager."""
    on_cuda = any(
        isinstance(t, torch.Tensor) and t.is_cuda for part in state.values() for t in part.values()
    )
    if _DefaultStager is not None and _takes_stager():
        return _DefaultStager(
            _StagingOptions(
                use_pinned_memory=on_cuda,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=on_cuda,
            )
        )
    return None


# ------------------------------------------------- reading without running code


# What DCP's `.metadata` pickle refers to (torch 2.x): its dataclasses, torch.Size, dtypes and
# layouts, and the path it was saved at.  Anything else is refused before it is looked up.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", *(n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype))},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a DCP index never holds")


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` (a pickle) is read by an unpickler that only builds DCP's
    own metadata classes: a crafted index is refused instead of run."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{path} is not a DCP index this version reads ({one_line(e)}): refused, nothing "
                "in it was run; the checkpoint was damaged, tampered with or not written by moevlm"
            ) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not a DCP index")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads DCP's non-tensor items (the optimizer's lr, betas, flags...)
    with torch.load(weights_only=True) instead of weights_only=False: plain data only."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: list[str] = []

    def load_bytes(self, read_item: Any, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception:
            self.refused.append(fqn)
            raise
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def dcp_load(state: dict, path: Path, **kwargs: Any) -> None:
    """dcp.load through `SafeReader` and `_SafePlanner`; a refused item is a CheckpointError."""
    planner = _SafePlanner()
    try:
        with quiet_no_dist():
            dcp.load(state, storage_reader=SafeReader(path), planner=planner, **kwargs)
    except (Exception, CheckpointException) as e:  # (DCP's is a BaseException)
        if planner.refused or "weights only load failed" in str(e).lower():
            what = planner.refused[0] if planner.refused else "an item"
            raise CheckpointError(
                f"checkpoint {path}: {what} is not plain data (a pickled object "
                "torch.load(weights_only=True) refuses): refused, nothing in it was run; the "
                "checkpoint was tampered with or not written by moevlm"
            ) from None
        raise


def checkpoint_index(path: Path) -> dict[str, Any]:
    """DCP's metadata: flattened key -> TensorStorageMetadata (has .size) or BytesStorageMetadata."""
    return dict(SafeReader(path).read_metadata().state_dict_metadata)
