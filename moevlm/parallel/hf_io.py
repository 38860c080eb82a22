"""Hugging Face checkpoints in and out of a model laid out by `build_model` (sharded by TP/EP/FSDP,
split into pipeline stages), or of a whole model.  moevlm.model.hf knows names, layouts and files;
this module adds which rank holds which tensor, the gathers and who writes.

    load_hf_weights_(model, hf_dir)          # each rank copies its own shards; no communication
    save_hf(model, out_dir, ctx=ctx)         # collective when laid out: every rank calls it
    save_adapter(model, out_dir, ctx=ctx)    # LoRA adapters in PEFT's format; collective likewise
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

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


__all__ = ["load_hf_weights_", "save_adapter", "save_hf"]
