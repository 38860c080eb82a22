"""Hugging Face checkpoints in and out of a model laid out by `build_model` (sharded by TP/EP/FSDP,
split into pipeline stages), or of a whole model.  moevlm.model.hf knows names, layouts and files;
this module adds which rank holds which tensor, the gathers and who writes.

    load_hf_weights_(model, hf_dir)          # each rank copies its own shards; no communication
    save_hf(model, out_dir, ctx=ctx)         # collective when laid out: every rank calls it
    save_adapter(model, out_dir, ctx=ctx)    # LoRA adapters in PEFT's format; collective likewise
    export_folder(target, write, run_dir=..., step=..., kind="hf", ctx=ctx)  # all or nothing

`export_folder` is how a run exports (train.export_hf, train.export_adapter): `write` fills a hidden
folder beside the target, rank 0 adds the marker `moevlm_export.json` and swaps it into place; a target
that is not an earlier export of this run is refused (`check_export_target`).  Why: docs/checkpoints.md.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from moevlm.errors import ConfigError
from moevlm.files import fsync_path
from moevlm.model import Qwen3VLMoe, hf
from moevlm.model.linear import is_adapter
from moevlm.model.lora import merged_weight, peft_tensors, write_peft_adapter
from moevlm.model.moe import is_training_state
from moevlm.parallel.weights import copy_full_, full_tensor


def load_hf_weights_(model: nn.Module, hf_dir, expert_layout: str = "auto") -> None:
    """Copy an HF checkpoint's weights into a materialized model (sharded, pipeline-split or whole)."""
    hf_dir = Path(hf_dir)
    hf.check_architecture(hf_dir, model.config)
    expected = hf.expected_shapes(_whole_on_meta(model))
    plan = hf.match_checkpoint(
        expected,
        hf.checkpoint_files(hf_dir),
        expert_layout,
        tie_word_embeddings=model.config.tie_word_embeddings,
        config=model.config,
    )
    params = model.state_dict()
    with torch.no_grad():
        for name, t in hf.read_tensors(plan, [n for n in plan if n in params], expected):
            copy_full_(params[name], t)


def save_hf(
    model: nn.Module,
    out_dir,
    *,
    expert_layout: str = "hub",
    max_shard_bytes: int = 5 << 30,
    ctx=None,
) -> None:
    """Write the model as a Hugging Face folder; collective when the model is laid out over ranks (`ctx`:
    its ParallelContext).  LoRA adapters are merged into the weights written (the model unchanged)."""
    out_dir = Path(out_dir)
    spread = ctx is not None and ctx.dims.world > 1 and dist.is_initialized()
    rank = dist.get_rank() if spread else 0
    stage_world = ctx.dims.world // ctx.dims.pp if spread else 1
    cfg = model.config
    params = model.state_dict()
    dtype = next(iter(params.values())).dtype
    files, total = _file_plan(model, dtype, max_shard_bytes, ctx)
    mine = _my_pp_rank(ctx) if spread else 0
    leader = rank % stage_world == 0  # the stage's first rank (dp = cp = tp = 0)
    if leader:
        out_dir.mkdir(parents=True, exist_ok=True)
    for fname, (holder, names) in files.items():
        if holder != mine:
            continue
        tensors = {}
        for n in names:
            t = merged_weight(model, n, full_tensor(params[n].detach(), n), _full)
            tensors |= hf.to_hf(n, t, cfg, expert_layout)
        if leader:  # every rank of the stage gathered (collectives); one writes
            hf.write_file(out_dir / fname, tensors, expert_layout)
    if rank == 0:
        weight_map = {
            h: fname
            for fname, (_, names) in files.items()
            for n in names
            for h in hf.hf_names(n, cfg, expert_layout)
        }
        hf.write_index_and_config(out_dir, weight_map, total, cfg, dtype)
    if spread:
        dist.barrier()  # the folder is complete when any rank returns


def save_adapter(model: nn.Module, out_dir, *, ctx=None) -> Path:
    """The LoRA adapters as PEFT's folder (moevlm.model.lora.save_peft_adapter); collective when the
    model is laid out over ranks: each stage gathers its adapters, rank 0 collects the stages' and
    writes."""
    spread = ctx is not None and ctx.dims.world > 1 and dist.is_initialized()
    if not spread:
        tensors, modules = peft_tensors(model)
    else:
        tensors, modules = peft_tensors(model, _full)
        if ctx.dims.pp > 1:  # the stages' leaders hold the parts; they travel to rank 0
            leader = dist.get_rank() % (ctx.dims.world // ctx.dims.pp) == 0
            mine = ({k: v.cpu() for k, v in tensors.items()}, modules) if leader else ({}, [])
            parts = [None] * ctx.dims.world if dist.get_rank() == 0 else None
            dist.gather_object(mine, parts, dst=0)
            if parts is not None:
                tensors = {k: v for part, _ in parts for k, v in part.items()}
                modules = [m for _, names in parts for m in names]
    out = Path(out_dir)
    if not spread or dist.get_rank() == 0:
        write_peft_adapter(model.config, tensors, modules, out)
    if spread:
        dist.barrier()  # the folder is complete when any rank returns
    return out


def _full(name: str, t: torch.Tensor) -> torch.Tensor:
    return full_tensor(t, name)


def _whole_on_meta(model: nn.Module) -> nn.Module:
    with torch.device("meta"):
        return Qwen3VLMoe(model.config)


def _file_plan(model: nn.Module, dtype: torch.dtype, max_shard_bytes: int, ctx):
    """({file name: (pp rank that writes it, our tensor names)}, total bytes), for the whole architecture."""
    whole = _whole_on_meta(model).state_dict()
    if model.config.tie_word_embeddings:
        whole.pop("lm_head.weight", None)
    plan = ctx.pipeline.plan if ctx is not None and ctx.pipeline is not None else None
    by_rank: dict[int, dict[str, int]] = {}
    for name, t in whole.items():
        if is_training_state(name) or is_adapter(name):  # the router bias; LoRA (merged)
            continue
        by_rank.setdefault(_holder(plan, name), {})[name] = t.numel() * dtype.itemsize
    groups = [
        (r, names) for r in sorted(by_rank) for names in hf.shard_names(by_rank[r], max_shard_bytes)
    ]
    return dict(zip(hf.file_names(len(groups)), groups)), sum(
        sum(v.values()) for v in by_rank.values()
    )


def _holder(plan, name: str) -> int:
    """The pipeline rank holding parameter `name` (0 without a pipeline)."""
    if plan is None:
        return 0
    if name.startswith(("vision.", "text.embed_tokens.")):
        return plan.rank_of(0)
    if name.startswith(("text.norm.", "lm_head.")):
        return plan.rank_of(plan.num_stages - 1)
    layer = int(name.split(".")[2])  # text.layers.<i>.
    return plan.rank_of(next(s for s in range(plan.num_stages) if layer in plan.layer_range(s)))


def _my_pp_rank(ctx) -> int:
    return ctx.meshes[0]["pp"].get_local_rank() if ctx.meshes else 0


# ------------------------------------------------------------ all-or-nothing exports of a run
EXPORT_MARKER = "moevlm_export.json"  # written last, inside the folder: what run and step it holds
# suffixes of the hidden folders beside the target: the export being written, the one it replaces
_PARTIAL, _OLD = ".moevlm-partial", ".moevlm-old"


class ExportTargetError(ConfigError):
    """An export folder that this run must not write (the message: which, why, what to do): a config
    error at set-up (exit 2); at the end of a run the trainer says it with exit 7."""


def export_marker(target) -> dict | None:
    """The marker of a moevlm export folder (None: not one)."""
    try:
        record = json.loads((Path(target) / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("made_by") == "moevlm" else None


def check_export_target(
    target, run_dir, option: str = "train.export_hf", protected: dict | None = None
) -> Path:
    """`target` as an absolute path, if this run may replace it: absent, empty, or an earlier export of
    the run in `run_dir` (its marker says so; None: a run not yet named, whose folder is new).
    Refused: a link, a file, a folder with other files (a user's, another run's export), and any
    folder that is or holds a `protected` path ({what: path}: the run's model.hf_checkpoint, its run
    directory)."""
    target = Path(target).absolute()
    run_dir = Path(run_dir).absolute() if run_dir else None
    where = f"{option}={target}"
    if target.is_symlink():
        raise ExportTargetError(f"{where} is a symbolic link: moevlm never exports through a link")
    real = target.resolve()
    ours = {}
    if run_dir is not None:
        ours = {"the run directory": run_dir} | {
            f"the run's {n}": run_dir / n for n in ("checkpoints", "tb", "profile", "wandb")
        }
    for what, path in {**ours, **(protected or {})}.items():
        if not path:
            continue
        path = Path(path).absolute().resolve()
        if real == path or real in path.parents:
            same = "is" if real == path else "holds"
            raise ExportTargetError(
                f"{where} {same} {what} ({path}): an export replaces its whole folder; name another"
            )
    if target.exists() and not target.is_dir():
        raise ExportTargetError(f"{where} is a file, not a folder; name a new or empty folder")
    if not target.is_dir() or not any(target.iterdir()):
        return target
    marker = export_marker(target)
    if marker is None:
        raise ExportTargetError(
            f"{where} exists, is not empty and is not a moevlm export (no {EXPORT_MARKER}): nothing "
            "in it was touched; name a new or empty folder"
        )
    if run_dir is None or marker.get("run_dir") != str(run_dir):
        raise ExportTargetError(
            f"{where} holds the export of another run ({marker.get('run_dir')}, step "
            f"{marker.get('step')}): nothing in it was touched; name another folder, or remove it"
        )
    return target


def export_folder(
    target,
    write: Callable[[Path], object],
    *,
    run_dir,
    step: int,
    kind: str,
    option: str = "train.export_hf",
    protected: dict | None = None,
    ctx=None,
) -> Path:
    """Export all or nothing; collective when the model is laid out (`ctx`).  Rank 0 checks `target`
    again (check_export_target: a refusal is an ExportTargetError on every rank) and makes the hidden
    folder `.<name>.moevlm-partial` beside it; every rank calls `write(folder)` (save_hf, save_adapter:
    rank 0 and the stages' first ranks write); rank 0 adds the marker, flushes the files to disk and
    swaps the folder into place, whole (an earlier export of this run is replaced at once, stale files
    of another layout with it).  A failure or a kill leaves the previous folder, or none: never a
    partial one at `target`."""
    spread = ctx is not None and ctx.dims.world > 1 and dist.is_initialized()
    lead = not spread or dist.get_rank() == 0
    target = Path(target).absolute()
    tmp = target.with_name(f".{target.name}{_PARTIAL}")
    refusal = None
    if lead:
        try:
            check_export_target(target, run_dir, option, protected)
            _remove_ours(tmp)  # a killed export's
            tmp.mkdir(parents=True)
        except ExportTargetError as err:
            refusal = str(err)
    if spread:
        box = [refusal]
        dist.broadcast_object_list(box, src=0)
        refusal = box[0]
    if refusal is not None:
        raise ExportTargetError(refusal)
    try:
        write(tmp)
        if spread:
            dist.barrier()  # every rank's files are in the folder before it is marked
        if lead:
            check_export_target(target, run_dir, option, protected)  # taken while we wrote?
            files = sorted(p.name for p in tmp.iterdir())
            record = {"made_by": "moevlm", "kind": kind, "run_dir": str(Path(run_dir).absolute())}
            record |= {"step": step, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            (tmp / EXPORT_MARKER).write_text(json.dumps(record | {"files": files}, indent=1) + "\n")
            _flush(tmp)
            _swap_in(tmp, target)
    except BaseException:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if spread:
        dist.barrier()  # the folder is in place when any rank returns
    return target


def _remove_ours(folder: Path) -> None:
    """Remove a hidden folder that an earlier export left (`folder` is named by us, beside the target)."""
    if folder.is_symlink():
        folder.unlink()
    elif folder.exists():
        shutil.rmtree(folder)


def _flush(folder: Path) -> None:
    """Each file's bytes on disk before the folder is renamed into place."""
    for p in folder.iterdir():
        fsync_path(p)


def _swap_in(tmp: Path, target: Path) -> None:
    """`tmp` becomes `target` in one step: renamed over an absent or empty folder, exchanged with an
    earlier export (renameat2 RENAME_EXCHANGE), whose files then go.  Where the exchange is not
    offered, two renames: a kill between them leaves no `target` (the earlier export is `.<name>.moevlm-old`)."""
    try:
        os.rename(tmp, target)
        fsync_path(target.parent)
        return
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if _exchange(tmp, target):
        fsync_path(target.parent)
        shutil.rmtree(tmp)
        return
    old = target.with_name(f".{target.name}{_OLD}")
    _remove_ours(old)
    os.rename(target, old)
    os.rename(tmp, target)
    fsync_path(target.parent)
    shutil.rmtree(old)


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the system does not offer it."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


__all__ = [
    "EXPORT_MARKER",
    "ExportTargetError",
    "check_export_target",
    "export_folder",
    "export_marker",
    "load_hf_weights_",
    "save_adapter",
    "save_hf",
]
