"""Training checkpoints on torch.distributed.checkpoint (DCP).

    ckpt = CheckpointManager(run_dir / "checkpoints", keep=3)
    if (path := ckpt.latest()) is not None:
        got = ckpt.load(path, model=model, optimizer=opt, extra={"scheduler": sched},
                        per_rank=["rng"])            # names (a dict works: its keys)
        step = got["step"]; set_rng_state(got["per_rank"]["rng"])
        data_states = ckpt.load_all_ranks(path, "data")   # every saved rank's value
    ...
    ckpt.save(step, model=model, optimizer=opt, extra={"scheduler": sched},
              per_rank={"data": loader.state_dict(), "rng": rng_state()})
    ckpt = CheckpointManager(root, keep=3, async_save=True)   # written in the background:
    ckpt.save(step, ...)      # returns once the state is in host memory and the write has begun
    ckpt.wait()               # complete (also done by the next save); ckpt.close() at the end

On disk (one directory per step; DCP's files plus our marker):

    checkpoints/step_00000100/__0_0.distcp ... .metadata  COMPLETE.json
    COMPLETE.json = {"format": 2, "step": 100, "world_size": 2, "time": <unix s>,
                     "time_utc": "...", "extra": [names], "per_rank": [names],
                     "checksum": "crc32", "files": {name: {"bytes": n, "crc32": hex}}}
    step_.../ keys: model.*, optim.* (DCP), extra.<name> and per_rank.rank<r>.<name>
                    (uint8 tensor: the value as JSON), extra.<name>.<i>, ... (its tensors)
    checkpoints/rejected/step_...           failed verification or a malformed marker
                                            (moved, never deleted)
    checkpoints/abandoned-<UTC time>/step_... newer than a checkpoint a run restarted from

Design choices:
- Model and optimizer go through DCP's state-dict API (`get_model_state_dict`,
  `get_optimizer_state_dict`, `set_*`): keys are parameter FQNs and values may
  be DTensors (FSDP2, TP), so DCP reshards on load; a checkpoint saved under
  one layout or world size loads under another.
- An offloaded optimizer (`parallel.optimizer_offload` under DDP or one process,
  moevlm.parallel.optimizer_offload) is saved and loaded through its
  `checkpoint_view()`: host masters named like the model's parameters, so its
  keys, shapes and placements are the device optimizer's and a checkpoint
  resumes with the setting on or off; after a load its masters are read back
  from the loaded weights (`load_masters()`).
- `extra` (identical on all ranks, e.g. the LR scheduler) and `per_rank`
  (data-loader state, RNG) are small Python values (an object's state_dict()
  if it has one) made of None, bool, int, float, str, list, tuple, dict,
  tensors and ndarrays; anything else is a TypeError at save.  Each is stored
  as DCP tensors: its JSON (tuples, non-string keys, tensors and ndarrays
  tagged) as one uint8 tensor, its tensors and ndarrays (as bytes) beside it,
  so DCP needs no template of its structure beyond what its index says.
  `extra` is written by rank 0 only (key `extra.<name>`); per-rank values under
  `per_rank.rank<r>.<name>`, read back by the same rank, or all of them at once
  with `load_all_ranks`.
- Loading never runs code from the checkpoint.  Our values are JSON and
  tensors; DCP reads tensors with torch.load(weights_only=True); its non-tensor
  items (the optimizer's lr, betas, flags) are read by our planner with
  weights_only=True too (DCP's default planner uses weights_only=False); and
  DCP's `.metadata` index, a pickle that FileSystemReader loads with
  pickle.load (torch offers no safe option), is read by our reader with an
  unpickler that only builds DCP's own metadata classes, torch.Size, dtypes and
  paths.  Anything else (a crafted item, a crafted index) is a CheckpointError
  naming it, before it runs.  Checksums are no defence here (a forger
  recomputes them); what is trusted is the data itself: a checkpoint can still
  hold weights or a data position one did not want.
- Checkpoints of earlier moevlm versions stored `extra`/`per_rank` values as
  pickles (DCP byte items); they are refused with the key and the advice to
  resume with the version that wrote them or to start fresh.
- Atomic commit: DCP writes into `step_XXXXXXXX`; after every rank has returned
  from `dcp.save` (barrier), rank 0 writes `COMPLETE.json` (tmp file, fsync,
  os.replace, fsync of the directory).  A directory without a well-formed marker
  (a JSON object with integer format, step >= 0 and world_size >= 1, the step
  of its directory, and a non-empty file list of sizes and CRCs when there is
  one) is never returned by `latest()` and `load()` refuses it in one line;
  `newest_verified()` and pruning move one whose marker is there but malformed
  into `rejected/` (a missing marker is an interrupted save).  Deleting goes the
  other way: marker first, then the files, so a half-deleted checkpoint is
  never "complete".
- Integrity (moevlm.train.integrity): after DCP has written, every stored file
  gets its size and CRC-32 in the marker (files split over the ranks, results
  gathered).  `verify()` checks them (collective, the same verdict on every
  rank); `load()` verifies first unless this manager has already;
  `newest_verified()` goes from the newest complete checkpoint down, moves a
  failing one aside into `rejected/` (logged, kept for inspection) and returns
  the first that verifies.  An explicitly named checkpoint that fails is an
  error, never silently replaced by another.  Markers without "files"
  (written before checksums) load with a warning; one of another format is set
  aside by `newest_verified()` and a ValueError for `load()`.
- One line of history: `set_aside_after(step, keep)` moves checkpoints of a
  line a run abandoned (steps after the one it restarts from, or all of them
  for a fresh start in a used directory) into `abandoned-<time>/`, so pruning
  by step never deletes the new line's checkpoints and `latest()` never picks
  the old line's.
- Pruning (rank 0, after each save): complete checkpoints beyond the newest
  `keep` (by step; keep <= 0 keeps all), and incomplete directories older than
  the newest complete one.  The checkpoint a run resumed from (`resumed_from`)
  stays until a newer one is complete (written and checksummed).
- Disk room: before writing, the checkpoint's size (tensor and byte values of
  all ranks, plus a margin) is compared with the free space of `root`; if
  pruning would make room, checkpoints are pruned in this order: those in
  `abandoned-*/` (oldest folder first), interrupted saves, then older complete
  ones, oldest first (never the newest complete one, nor `resumed_from`; never
  `rejected/`); otherwise the save
  stops with a CheckpointError naming the folder, the bytes needed and free.
  A write that fails anyway (the estimate was short, another writer filled
  the disk) removes its partial directory and raises the same way; the
  previous checkpoints are untouched, so a relaunch resumes from them.
- Asynchronous saves (`async_save`, train.async_checkpoint): `save` does the
  same checks and room-making, then `dcp.async_save` copies the state to host
  memory (into buffers DCP's DefaultStager makes at the first save and refills
  at the next ones, pinned on CUDA; on CPU a fresh copy each time cost far
  more, in page faults) and DCP's thread writes it;
  our own thread waits for that write, then does what a sync save does after
  it (checksums, marker, pruning).  So the marker never precedes the data, and
  an interrupted background write leaves a directory without one (never
  resumed; pruned later).  The background collectives (DCP's plan and index,
  our checksum gather) run on a gloo group made for them at construction
  (DCP's async save wants a CPU backend, and sharing training's group from a
  second thread would interleave collectives).  One save in flight: `save`
  first `wait`s for the previous one, so the room check sees it on disk and
  the host copy is never doubled.  A failed write is the sync path's
  CheckpointError, raised by the next `save`, `wait` or `close`.  The staged
  copy is taken before `save` returns, so training may change the weights at
  once.  `HOLD_ENV` is a test-only pause inside the write (see there).
- Single process works without a process group (DCP's `no_dist`); with one,
  `save` and `load` are collective (every rank calls them) and use
  `process_group` or the default group.  `load_all_ranks` is not collective.
"""

from __future__ import annotations

import datetime
import inspect
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

try:  # (recent torch: a stager that keeps its host buffers between saves)
    from torch.distributed.checkpoint.staging import DefaultStager as _DefaultStager
    from torch.distributed.checkpoint.staging import StagingOptions as _StagingOptions
except ImportError:  # pragma: no cover
    _DefaultStager = _StagingOptions = None
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    StateDictOptions,
)

from moevlm.parallel.weights import to_storage_layout
from moevlm.train import integrity
from moevlm.train.checkpoint_keys import SHOW as _SHOW
from moevlm.train.checkpoint_keys import check_model_keys, check_optimizer_keys, require
from moevlm.train.integrity import (
    CheckpointError,
    checksum_files,
    dir_bytes,
    file_problems,
    gib,
    looks_like_disk_full,
    one_line,
    state_bytes,
    stored_files,
)

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
# Optimizer state flattened per parameter name ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): it loads
# whatever the parameter groups of the loading layout are (they are split by device mesh).
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
FORMAT = 2  # 2: expert gate_up stored as (E, D, 2, F) (moevlm.parallel.weights.storage_view)
_STEP_DIR = re.compile(r"step_(\d+)$")


# ---------------------------------------------------------------- RNG state


def _optimizer_view(model: torch.nn.Module, optimizer: Any) -> tuple[torch.nn.Module, Any]:
    """The (module, optimizer) pair DCP's optimizer state dict is taken from: an offloaded optimizer
    (moevlm.parallel.optimizer_offload) names its host masters by the model's parameter names, so the
    state dict is in the same format as the device optimizer's."""
    view = getattr(optimizer, "checkpoint_view", None)
    return view() if view is not None else (model, optimizer)


def rng_state() -> dict[str, Any]:
    """Python `random`, numpy's global RNG, torch CPU and (if initialized) CUDA."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `rng_state` returned (CUDA only where it was saved and CUDA exists)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------ files on disk


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, obj: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


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
    if _STEP_DIR.match(path.name) and marker["step"] != _step_of(path):
        return f"its step is {marker['step']}, its directory's {_step_of(path)}"
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


def _format_problem(path: Path, marker: Mapping[str, Any]) -> str:
    return (
        f"{path} was written in checkpoint format {marker['format']}; this version reads "
        f"format {FORMAT}; export it to Hugging Face format with the version that wrote it"
    )


def _is_complete(path: Path) -> bool:
    try:
        read_marker(path)
    except CheckpointError:
        return False
    return True


def _malformed(path: Path) -> str | None:
    """Why the marker `path` has is unusable; None when it has none (an interrupted save) or a
    sound one."""
    if not (path / MARKER).exists():
        return None
    try:
        read_marker(path)
    except CheckpointError as e:
        return str(e)
    return None


def _remove_checkpoint(path: Path) -> None:
    """Marker first (durably), then the files: never a half-deleted complete checkpoint."""
    marker = path / MARKER
    if marker.exists():
        marker.unlink()
        _fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)


def _step_of(path: Path) -> int:
    m = _STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else -1


def _utc_now(compact: bool = False) -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y%m%dT%H%M%SZ") if compact else now.isoformat(timespec="seconds")


def _checkpoint_index(path: Path) -> dict[str, Any]:
    """DCP's metadata: flattened key -> TensorStorageMetadata (has .size) or BytesStorageMetadata."""
    return dict(_SafeReader(path).read_metadata().state_dict_metadata)


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


class _SafeReader(FileSystemReader):
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


def _dcp_load(state: dict, path: Path, **kwargs: Any) -> None:
    """dcp.load through `_SafeReader` and `_SafePlanner`; a refused item is a CheckpointError."""
    planner = _SafePlanner()
    try:
        with _quiet_no_dist():
            dcp.load(state, storage_reader=_SafeReader(path), planner=planner, **kwargs)
    except (Exception, CheckpointException) as e:  # (DCP's is a BaseException)
        if planner.refused or "weights only load failed" in str(e).lower():
            what = planner.refused[0] if planner.refused else "an item"
            raise CheckpointError(
                f"checkpoint {path}: {what} is not plain data (a pickled object "
                "torch.load(weights_only=True) refuses): refused, nothing in it was run; the "
                "checkpoint was tampered with or not written by moevlm"
            ) from None
        raise


# ---------------------------------------------------------- python values
#
# An `extra` or `per_rank` value is stored as DCP tensors: `<key>` a uint8 tensor holding the value
# as UTF-8 JSON, `<key>.<i>` the i-th tensor or ndarray inside it.  JSON stands for what it cannot
# say itself with one-key objects: {"__tuple__": [...]}, {"__dict__": [[key, value], ...]} (keys
# that are not strings), {"__tensor__": i}, {"__ndarray__": i, "dtype": "<u4", "shape": [...]}.

_TAGS = ("__tuple__", "__dict__", "__tensor__", "__ndarray__")


def _encode(value: Any, tensors: list[torch.Tensor], where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, np.generic) and not isinstance(value, np.object_):
        return _encode(value.item(), tensors, where)
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().to("cpu", copy=True).contiguous())
        return {"__tensor__": len(tensors) - 1}
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        raw = np.frombuffer(np.ascontiguousarray(value).tobytes(), dtype=np.uint8).copy()
        tensors.append(torch.from_numpy(raw))
        return {
            "__ndarray__": len(tensors) - 1,
            "dtype": value.dtype.str,
            "shape": list(value.shape),
        }
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors, where) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors, where) for v in value]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and not (
            len(value) == 1 and next(iter(value)) in _TAGS
        ):
            return {k: _encode(v, tensors, where) for k, v in value.items()}
        return {
            "__dict__": [
                [_encode(k, tensors, where), _encode(v, tensors, where)] for k, v in value.items()
            ]
        }
    raise TypeError(
        f"checkpoint value {where} holds a {type(value).__name__}: checkpoints store None, bool, "
        "int, float, str, list, tuple, dict, tensors and ndarrays (give the object a state_dict())"
    )


def _decode(obj: Any, tensors: Mapping[int, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1 and "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if len(obj) == 1 and "__dict__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__dict__"]}
    if len(obj) == 1 and "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if obj.keys() == {"__ndarray__", "dtype", "shape"}:
        dtype = np.dtype(str(obj["dtype"]))
        if dtype.hasobject:
            raise ValueError(f"ndarray of dtype {dtype} (Python objects)")
        raw = tensors[obj["__ndarray__"]].numpy().tobytes()
        return np.frombuffer(raw, dtype=dtype).reshape([int(n) for n in obj["shape"]]).copy()
    return {k: _decode(v, tensors) for k, v in obj.items()}


def _stored_value(value: Any, where: str) -> dict[str, torch.Tensor]:
    """{"": JSON tensor, "0": first tensor, ...}: what `value` (its state_dict() if it has one)
    becomes under the key `where` and `where.<i>`."""
    if hasattr(value, "state_dict"):
        value = value.state_dict()
    tensors: list[torch.Tensor] = []
    text = json.dumps(_encode(value, tensors, where), separators=(",", ":"))
    blob = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    return {"": blob, **{str(i): t for i, t in enumerate(tensors)}}


def _value_template(saved: Mapping[str, Any], key: str, path: Path) -> dict[str, torch.Tensor]:
    """Empty tensors for what `_stored_value` wrote under `key`, from the checkpoint's index; a value
    stored any other way (a pickle: older moevlm, or not moevlm) is refused, never unpickled."""
    md = saved[key]
    if not (
        isinstance(md, TensorStorageMetadata)
        and md.properties.dtype == torch.uint8
        and len(md.size) == 1
    ):
        raise CheckpointError(
            f"checkpoint {path}: {key} is not stored as JSON but as a pickled Python object (a "
            "checkpoint written by an older moevlm, or not by moevlm); this version never unpickles "
            "checkpoint content: resume it with the moevlm version that wrote it, or start fresh "
            "(train.resume=none, or another train.run_dir)"
        )
    out = {"": torch.empty(tuple(md.size), dtype=torch.uint8)}
    for k, m in saved.items():
        i = k[len(key) + 1 :]
        if k.startswith(key + ".") and i.isdigit():
            if not isinstance(m, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint {path}: {k} is not a tensor; refused")
            out[i] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    return out


def _put(group: dict, name: str, parts: Mapping[str, torch.Tensor]) -> None:
    for i, t in parts.items():
        group[f"{name}.{i}" if i else name] = t


def _loaded_value(group: Mapping[str, Any], name: str, key: str, path: Path) -> Any:
    """The value `_stored_value` wrote, from the tensors DCP filled in `group` (keys as `_put`)."""
    tensors = {
        int(k[len(name) + 1 :]): t
        for k, t in group.items()
        if k.startswith(name + ".") and k[len(name) + 1 :].isdigit()
    }
    try:
        return _decode(json.loads(bytes(group[name].numpy()).decode()), tensors)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path}: {key} is not a value this version reads ({one_line(e)}); refused"
        ) from None


def _restore(target: Any, value: Any) -> Any:
    """Load into `target` if it has load_state_dict (and return it), else return the value."""
    if hasattr(target, "load_state_dict"):
        target.load_state_dict(value)
        return target
    return value


_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


@contextmanager
def _quiet_no_dist() -> Iterator[None]:
    """DCP warns on every single-process save/load, even when asked for one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
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


def _background_group(
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


# ------------------------------------------------------------------ manager


class CheckpointManager:
    """Saves, finds, verifies, loads and prunes `root/step_XXXXXXXX` checkpoints (see module doc)."""

    def __init__(
        self,
        root: str | os.PathLike,
        keep: int = 3,
        process_group: dist.ProcessGroup | None = None,
        async_save: bool = False,
        timeout: datetime.timedelta | None = None,
    ):
        self.root = Path(root)
        self.keep = keep
        self.process_group = process_group
        self.async_save = async_save
        # async saves: (directory, future of its background finish); the thread; CUDA's stager
        self._pending: tuple[Path, Future] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stager: Any = None
        # their collectives run beside the training's: a gloo group of their own (collective)
        self._async_group = _background_group(process_group, timeout) if async_save else None
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

    def _step_dirs(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = [
            (m, p) for p in self.root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
        ]
        return sorted((int(m.group(1)), p) for m, p in found)

    def complete(self) -> list[Path]:
        """Complete checkpoint directories (with a marker; not yet verified), oldest first."""
        return [p for _, p in self._step_dirs() if _is_complete(p)]

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
            return [_format_problem(path, marker)]
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
                _SafeReader(path).read_metadata()
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
            [(p, why) for _, p in self._step_dirs() if (why := _malformed(p))]
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
                [path], "rejected", "failed verification: " + "; ".join(problems[:_SHOW])
            )
            log.warning(
                "checkpoint %s failed verification (%s); moved to %s",
                path,
                "; ".join(problems[:_SHOW]),
                moved[0],
            )
        self.rejected.append((self.root / "rejected" / path.name, problems))
        self._barrier()

    def set_aside(self, paths: Iterable[Path], folder: str, reason: str) -> list[Path]:
        """Move checkpoint directories into `root/folder/` (rank 0 only), with the reason in its README."""
        dest = self.root / folder
        dest.mkdir(parents=True, exist_ok=True)
        moved = []
        for p in paths:
            target = dest / p.name
            if target.exists():
                target = dest / f"{p.name}.{time.time_ns()}"
            os.replace(p, target)
            moved.append(target)
        with open(dest / "README.txt", "a") as f:
            f.write(f"{_utc_now()} moved here: {', '.join(p.name for p in moved)}: {reason}\n")
        _fsync_dir(self.root)
        return moved

    def set_aside_after(self, step: int, keep: Path | None = None) -> list[Path]:
        """Start one line of history at `step` (collective): move the step directories from `step` on
        (except `keep`, the checkpoint resumed from) into `root/abandoned-<time>/`.  Returns them."""
        moved = None
        if self.rank == 0:
            keep = keep.absolute() if keep is not None else None
            doomed = [p for s, p in self._step_dirs() if s >= step and p.absolute() != keep]
            if doomed:
                why = f"a run restarted from step {step}" + (f" ({keep})" if keep else "")
                moved = self.set_aside(doomed, "abandoned-" + _utc_now(compact=True), why)
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
        state = self._save_state(model, optimizer, extra, per_rank)
        need = sum(self._gathered(state_bytes(state)))
        problem = self._from_rank0(self._make_room(need, path) if self.rank == 0 else None)
        if problem:
            raise CheckpointError(problem)
        if self.rank == 0:
            self._clear(path)
        self._barrier()
        names = (sorted(extra), sorted(per_rank))
        if not self.async_save:
            self._write(state, path, need)
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
            _write_json_atomic(
                path / MARKER,
                {
                    **self._marker(step, *names),
                    "checksum": "crc32",
                    "files": dict(sorted(files.items())),
                },
            )
            self._prune()
        self._verified.add(path.absolute())
        self._barrier(group)

    def _write(self, state: dict, path: Path, need: int) -> None:
        """dcp.save; a failure removes the partial directory and says whether the disk was full."""
        try:
            with _quiet_no_dist():
                dcp.save(
                    state,
                    storage_writer=_Writer(path),
                    process_group=self.process_group,
                    no_dist=not self.distributed,
                )
        except (Exception, CheckpointException) as e:  # (DCP's is a BaseException)
            raise self._write_failed(e, path, need) from e

    def _write_async(self, state: dict, path: Path, need: int) -> Future:
        """dcp.async_save: the state copied to host memory now (into the stager's buffers), written
        by DCP's thread over the background group; its future."""
        if self._executor is None:
            self._start_background(state)
        stager = {"async_stager": self._stager} if self._stager is not None else {}
        try:
            got = dcp.async_save(
                state,
                storage_writer=_Writer(path),
                process_group=self._async_group,
                no_dist=not self.distributed,
                **stager,
            )
        except (Exception, CheckpointException) as e:
            raise self._write_failed(e, path, need) from e
        # (an AsyncSaveResponse where the stager is itself asynchronous: ours is not)
        return getattr(got, "upload_completion", got)

    def _start_background(self, state: dict) -> None:
        """The thread that finishes async saves, and the stager: host buffers (pinned on CUDA) made
        at the first save and refilled by the next ones (a fresh copy each time costs its page
        faults again)."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="moevlm-checkpoint")
        if not self.distributed:
            # DCP warns on every single-process save, here from its own thread (see _quiet_no_dist)
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        on_cuda = any(
            isinstance(t, torch.Tensor) and t.is_cuda
            for part in state.values()
            for t in part.values()
        )
        if _DefaultStager is not None and _takes_stager():
            self._stager = _DefaultStager(
                _StagingOptions(
                    use_pinned_memory=on_cuda,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=on_cuda,
                )
            )

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
            _remove_checkpoint(path)
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

    def _make_room(self, need: int, path: Path) -> str | None:
        """Rank 0: None when `need` bytes fit in root's file system, pruning older checkpoints first
        if that makes room; else the message to stop with."""
        free = integrity.free_bytes(self.root)
        if free >= need:
            return None
        dirs = self._step_dirs()
        done = [p for _, p in dirs if _is_complete(p)]
        keep = {done[-1]} if done else set()
        if self.resumed_from is not None:
            keep.add(Path(self.resumed_from))
        # abandoned lines first (oldest first), then half-written ones, then older complete ones
        spare = (
            self._abandoned()
            + [p for _, p in dirs if not (p / MARKER).exists()]
            + [p for p in done if p not in keep]
        )
        sizes = {p: dir_bytes(p) for p in spare}
        if free + sum(sizes.values()) < need:
            last = f"; {done[-1].name} is intact (resume=auto continues from it)" if done else ""
            return (
                f"not enough disk space for checkpoint {path.name} in {self.root}: it needs about {gib(need)}, "
                f"{gib(free)} are free"
                + (
                    f" and pruning older checkpoints would free only {gib(sum(sizes.values()))}"
                    if spare
                    else ""
                )
                + f"; free space there or set train.run_dir on a larger file system{last}"
            )
        for p in spare:
            if integrity.free_bytes(self.root) >= need:
                break
            log.warning(
                "pruning %s (%s) to make room for checkpoint %s (%s needed)",
                p,
                gib(sizes[p]),
                path.name,
                gib(need),
            )
            _remove_checkpoint(p)
            if p.parent != self.root:
                with open(p.parent / "README.txt", "a") as f:
                    f.write(f"{_utc_now()} pruned {p.name} to make room for {path.name}\n")
        return None

    def _abandoned(self) -> list[Path]:
        """Step directories in `root/abandoned-<UTC time>/`: the oldest folder first, by step."""
        out: list[Path] = []
        for folder in sorted(self.root.glob("abandoned-*")):
            if folder.is_dir():
                steps = [p for p in folder.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
                out += sorted(steps, key=_step_of)
        return out

    def _clear(self, path: Path) -> None:
        if path.exists():
            log.warning("replacing existing checkpoint directory %s", path)
            _remove_checkpoint(path)
        self.root.mkdir(parents=True, exist_ok=True)
        path.mkdir()
        _fsync_dir(self.root)

    def _save_state(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        extra: dict,
        per_rank: dict,
    ) -> dict[str, Any]:
        model_sd = get_model_state_dict(model)
        optim_sd = (
            get_optimizer_state_dict(*_optimizer_view(model, optimizer), options=_OPTIM)
            if optimizer is not None
            else None
        )
        model_sd, optim_sd = to_storage_layout(model_sd, optim_sd)
        state: dict[str, Any] = {"model": model_sd}
        if optim_sd is not None:
            state["optim"] = optim_sd
        if extra and self.rank == 0:
            state["extra"] = {}
            for name, v in extra.items():
                _put(state["extra"], name, _stored_value(v, f"extra.{name}"))
        if per_rank:
            mine: dict[str, torch.Tensor] = {}
            for name, v in per_rank.items():
                _put(mine, name, _stored_value(v, f"per_rank.rank{self.rank}.{name}"))
            state["per_rank"] = {f"rank{self.rank}": mine}
        return state

    def _marker(self, step: int, extra: Iterable[str], per_rank: Iterable[str]) -> dict[str, Any]:
        now = time.time()
        return {
            "format": FORMAT,
            "step": step,
            "world_size": self.world_size,
            "time": now,
            "time_utc": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(),
            "extra": sorted(extra),
            "per_rank": sorted(per_rank),
        }

    def _prune(self) -> None:
        dirs = self._step_dirs()
        done = [(s, p) for s, p in dirs if _is_complete(p)]
        if not done:
            return
        doomed = [p for _, p in done[: -self.keep]] if self.keep > 0 else []
        newest = done[-1][0]
        resumed = self.resumed_from.absolute() if self.resumed_from is not None else None
        if resumed is not None and not any(s > _step_of(resumed) for s, _ in done):
            doomed = [p for p in doomed if p.absolute() != resumed]  # until a newer one is complete
        doomed += [p for s, p in dirs if s < newest and not (p / MARKER).exists()]
        for p in doomed:
            log.info("pruning checkpoint %s", p)
            _remove_checkpoint(p)
        for s, p in dirs:  # a marker that is there but unusable: kept for inspection, not deleted
            if s < newest and (why := _malformed(p)):
                moved = self.set_aside([p], "rejected", why)
                log.warning("checkpoint %s: %s; moved to %s", p, why, moved[0])

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
            raise ValueError(_format_problem(path, marker))
        if verify and path.absolute() not in self._verified:
            problems = self.verify(path)
            if problems:
                raise CheckpointError(
                    f"checkpoint {path} failed verification ({len(problems)} problem(s): "
                    f"{'; '.join(problems[:_SHOW])}); name an earlier checkpoint, or use resume=auto, which "
                    "skips damaged ones"
                )
        saved = _checkpoint_index(path)
        extra, names = dict(extra or {}), list(per_rank)
        state, originals = self._load_template(model, optimizer, extra, names, marker, saved, path)
        _dcp_load(state, path, process_group=self.process_group, no_dist=not self.distributed)
        for name in (
            "model",
            "optim",
        ):  # DCP replaces non-tensor values (lr, betas...) in the dict it was given
            for k, v in state.get(name, {}).items():
                if not isinstance(v, torch.Tensor):
                    originals[name][k] = v
        # tensors were filled through the storage views
        set_model_state_dict(model, originals["model"])
        if optimizer is not None:
            set_optimizer_state_dict(
                *_optimizer_view(model, optimizer), originals["optim"], options=_OPTIM
            )
            if hasattr(optimizer, "load_masters"):  # host masters follow the loaded weights
                optimizer.load_masters()
        mine = state.get("per_rank", {}).get(f"rank{self.rank}", {})
        return {
            "step": marker["step"],
            "world_size": marker["world_size"],
            "extra": {
                n: _restore(extra[n], _loaded_value(state["extra"], n, f"extra.{n}", path))
                for n in extra
            },
            "per_rank": {
                n: _loaded_value(mine, n, f"per_rank.rank{self.rank}.{n}", path)
                if n in mine
                else None
                for n in names
            },
        }

    def _load_template(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        extra: dict,
        names: list[str],
        marker: dict,
        saved: Mapping[str, Any],
        path: Path,
    ) -> dict[str, Any]:
        """What dcp.load fills (our model/optimizer state dicts in the storage layout, and
        byte placeholders), and the state dicts those views write into."""
        originals: dict[str, Any] = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            originals["optim"] = get_optimizer_state_dict(
                *_optimizer_view(model, optimizer), options=_OPTIM
            )
        model_sd, optim_sd = to_storage_layout(originals["model"], originals.get("optim"))
        state: dict[str, Any] = {"model": model_sd}
        check_model_keys(state["model"], saved, path, self._keys_of_every_rank(state["model"]))
        if optim_sd is not None:
            state["optim"] = optim_sd
            check_optimizer_keys(state["optim"], saved, path)
        if extra:
            require(extra, saved, "extra", path)
            state["extra"] = {}
            for n in extra:
                _put(state["extra"], n, _value_template(saved, f"extra.{n}", path))
        require(names, saved, "per_rank.rank0", path)
        if names and self.rank < marker["world_size"]:
            mine: dict[str, torch.Tensor] = {}
            for n in names:
                _put(mine, n, _value_template(saved, f"per_rank.rank{self.rank}.{n}", path))
            state["per_rank"] = {f"rank{self.rank}": mine}
        return state, originals

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
        saved = _checkpoint_index(path)
        require([name], saved, "per_rank.rank0", path)
        keys = {
            r: f"per_rank.rank{r}.{name}"
            for r in range(world)
            if f"per_rank.rank{r}.{name}" in saved
        }
        state: dict[str, Any] = {"per_rank": {f"rank{r}": {} for r in keys}}
        for r, key in keys.items():
            _put(state["per_rank"][f"rank{r}"], name, _value_template(saved, key, path))
        _dcp_load(state, path, no_dist=True)
        return [
            _loaded_value(state["per_rank"][f"rank{r}"], name, keys[r], path) if r in keys else None
            for r in range(world)
        ]
