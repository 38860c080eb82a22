"""`parallelize(model, dims, ...)`: the one place a model built on the meta
device is rewritten for its parallel layout, in this order: pipeline stages
(pipeline.py: this rank keeps its stages' parts), tensor/sequence parallel
(tensor_parallel.py), context parallel (context_parallel.py), expert parallel (expert_parallel.py; with
`ep_overlap`, ep_overlap.py: each MoE block's exchanges overlapped with its expert compute), recompute
(recompute.py: `recompute=(mode, modules)`), per-block torch.compile (compile.py,
`compile=True`), data parallel (data_parallel.py: FSDP2 or DDP-style all-reduce).

    with torch.device("meta"): model = Qwen3VLMoe(cfg)
    model = parallelize(model, dims, dp_mode="fsdp", device_type="cuda", bf16=True,
                        pipeline=plan_pipeline(...))      # plan only when dims.pp > 1
    materialize_(model, device)              # model.to_empty, through FSDP's pipeline roots
    init_parameters_(model, seed)            # or moevlm.parallel.hf_io.load_hf_weights_
    ...loss.backward() per micro-batch, or ctx.pipeline.forward_backward(...)...
    ctx = parallel_context(model)
    ctx.finish_gradients()                   # DDP all-reduces, tp sums of partial gradients
    norm = ctx.clip_grad_norm_(params, max_norm)

Design choices:
- The two meshes come from `ParallelDims.build_meshes`; the model keeps a
  `ParallelContext` (meshes, groups, pipeline, gradient finish) instead of any
  global.
- Initialisation is layout independent: every parameter is drawn whole from a
  generator seeded by (seed, its name) and this rank keeps its shard, so one
  process and any layout (pipeline stages included) start from the same weights.
- Context parallel (context_parallel.py) rewrites the model after tensor
  parallel: the sequence is sharded over cp x tp.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moevlm.dispatch import DISPATCHERS, build_dispatcher
from moevlm.model.moe import MoEBlock, capacity_kwargs
from moevlm.model.vlm import fill_
from moevlm.parallel.compile import apply_compile
from moevlm.parallel.context_parallel import apply_context_parallel
from moevlm.parallel.data_parallel import GradSync, apply_fsdp
from moevlm.parallel.ep_overlap import apply_ep_overlap
from moevlm.parallel.expert_parallel import apply_expert_parallel
from moevlm.parallel.mesh import ParallelDims
from moevlm.parallel.pipeline import Pipeline, prune_to_stages, v_schedules_supported
from moevlm.parallel.pipeline_plan import PipelinePlan
from moevlm.parallel.recompute import apply_recompute
from moevlm.parallel.tensor_parallel import apply_tensor_parallel


class ParallelNotBuilt(NotImplementedError):
    pass


@dataclass
class ParallelContext:
    dims: ParallelDims
    dp_mode: str = "fsdp"
    meshes: tuple = ()
    groups: dict = field(default_factory=dict)  # tp, dp (data totals), dense, expert, vision, pp
    tp_partial: list[str] = field(default_factory=list)
    grad_sync: GradSync | None = None
    pipeline: Pipeline | None = None
    init_rules: dict | None = None  # the whole model's (a pipeline rank holds part of it)

    @property
    def dp_group(self):
        """Ranks holding different data (one per data-parallel replica)."""
        return self.groups.get("dp")

    @property
    def loss_group(self):
        """Ranks whose token losses add up to the data-parallel replicas' (dp x cp: a cp rank holds part
        of each row; tp ranks hold the same sums)."""
        return self.groups.get("dense")

    @property
    def pp_group(self):
        return self.groups.get("pp")

    def finish_gradients(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync.finish()

    def clip_grad_norm_(self, params, max_norm: float) -> torch.Tensor:
        return self.grad_sync.clip_grad_norm_(params, max_norm)


def parallel_context(model: nn.Module) -> ParallelContext:
    return model.__dict__["_parallel_context"]


def parallelize(model: nn.Module, dims: ParallelDims, *, dp_mode: str = "fsdp", device_type: str = "cpu",
                bf16: bool = False, dispatcher: str = "local", pipeline: PipelinePlan | None = None,
                recompute: tuple[str, tuple[str, ...]] = ("none", ()), compile: bool = False,
                compile_mode: str | None = None, cp_comm: str = "allgather", ep_overlap: bool = False) -> nn.Module:
    if dims.pp > 1 and (pipeline is None or pipeline.pp != dims.pp):
        raise ValueError(f"parallel.pp={dims.pp} needs its PipelinePlan (moevlm.parallel.plan_pipeline)")
    if model.config.moe.num_experts and dims.ep * dims.etp > 1 and dispatcher not in DISPATCHERS:
        raise ParallelNotBuilt(f"model.dispatcher={dispatcher!r} is not built yet (its adapter arrives with its own "
                               f"issue); available: {sorted(DISPATCHERS)}")
    ctx = ParallelContext(dims, dp_mode)
    model.__dict__["_parallel_context"] = ctx
    if ep_overlap and not (model.config.moe.num_experts and dims.ep > 1):
        raise ValueError("parallel.ep_overlap needs MoE layers and parallel.ep > 1 (nothing to overlap otherwise)")
    if dims.world == 1:
        apply_recompute(model, *recompute)
        if compile:
            apply_compile(model, mode=compile_mode, bf16=bf16)
        ctx.grad_sync = GradSync(model, fsdp=False, groups={"tp": None}, tp_partial=[], tp=1, world=1)
        return model
    attn, expert = dims.build_meshes(device_type)
    dense = attn["dp", "cp"]._flatten("dp_cp")
    vision = attn["dp", "cp", "tp"]._flatten("dp_cp_tp")
    ctx.meshes = (attn, expert)
    ctx.groups = {"tp": attn["tp"].get_group(), "dp": attn["dp"].get_group(), "dense": dense.get_group(),
                  "expert": expert["edp"].get_group(), "vision": vision.get_group(), "pp": attn["pp"].get_group()}
    if dims.pp > 1:  # this rank's stages only, before anything is sharded
        ctx.init_rules = model.init_rules()
        prune_to_stages(model, pipeline, attn["pp"].get_local_rank())
    if dims.tp > 1:
        ctx.tp_partial = apply_tensor_parallel(model, attn["tp"])
    if dims.cp > 1:
        apply_context_parallel(model, attn["cp"].get_group(), attn["cp", "tp"]._flatten("cp_tp").get_group(),
                               cp_comm)
    if model.config.moe.num_experts and dims.ep * dims.etp > 1:
        apply_expert_parallel(model, expert, dispatcher)
        if ep_overlap:
            apply_ep_overlap(model)
    else:  # experts whole on every rank: no token leaves its rank (the model's own
        cfg = model.config.moe  # dispatcher would default to the world group)
        for block in _moe_blocks(model):
            if cfg.capacity_factor is None:
                block.dispatcher = build_dispatcher("local", num_experts=block.num_experts,
                                                    top_k=block.router.top_k, permute=cfg.permute)
            else:  # the capacity all-to-all over a group of one: no exchange, the same drops as with ep > 1
                block.dispatcher = build_dispatcher("alltoall", num_experts=block.num_experts,
                                                    top_k=block.router.top_k, permute=cfg.permute,
                                                    ep_group=expert["ep"].get_group(), **capacity_kwargs(cfg))
    apply_recompute(model, *recompute)
    if dims.pp > 1:
        if pipeline.style == "v" and not v_schedules_supported(dist.get_backend(ctx.pp_group)):
            raise ParallelNotBuilt(
                f"parallel.pp_schedule={pipeline.schedule} cannot start on gloo with this torch: its pipeline stages "
                "open with a send from each rank to itself (the two stages a V puts on one rank), which gloo refuses; "
                "use NCCL (GPUs), a torch whose stages skip that (2.13), or another schedule")
        ctx.pipeline = Pipeline(model, pipeline, attn["pp"].get_local_rank(), ctx.pp_group)
    if compile:  # after the parallelisms (and recompute), before FSDP/DDP
        apply_compile(model, mode=compile_mode, bf16=bf16)
    if dp_mode == "fsdp":
        apply_fsdp(model, dense, expert["edp"], vision, dims.tp, bf16,
                   roots=ctx.pipeline.modules if ctx.pipeline else None)
    ctx.grad_sync = GradSync(model, fsdp=dp_mode == "fsdp", groups=ctx.groups, tp_partial=ctx.tp_partial,
                             tp=dims.tp, world=dims.world, stage_world=dims.world // dims.pp)
    return model


def materialize_(model: nn.Module, device) -> None:
    """`model.to_empty(device)` for a parallelized model: under pipeline stages with FSDP the stage
    modules are the FSDP roots, so they move their parameters (FSDP re-registers its shards)."""
    ctx = model.__dict__.get("_parallel_context")
    if ctx is not None and ctx.pipeline is not None and ctx.dp_mode == "fsdp":
        for stage in ctx.pipeline.modules:
            stage.to_empty(device=device)
    else:
        model.to_empty(device=device)


def _moe_blocks(model: nn.Module) -> list[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


# ------------------------------------------------------------------ weights
def param_generator(seed: int, name: str, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    return g


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write the unsharded value `full` into `param` (this rank's shard when it is a
    DTensor; no communication: every rank holds `full`)."""
    if isinstance(param, DTensor):
        shard = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def init_parameters_(model: nn.Module, seed: int) -> None:
    """Initialise every parameter by `model.init_rules()`, each drawn whole from its
    own seeded generator, so the values do not depend on the layout."""
    params = dict(model.named_parameters())
    ctx = model.__dict__.get("_parallel_context")
    rules = ctx.init_rules if ctx is not None and ctx.init_rules is not None else model.init_rules()
    for name, (kind, std) in rules.items():
        if name not in params and ctx is not None and ctx.pipeline is not None:
            continue  # held by another pipeline stage
        p = params[name]
        device = p.to_local().device if isinstance(p, DTensor) else p.device
        full = torch.empty(p.shape, dtype=torch.float32, device=device)
        fill_(full, kind, std, param_generator(seed, name, device))
        copy_full_(p, full)


def full_tensor(t: torch.Tensor, name: str = "") -> torch.Tensor:
    """The unsharded value of parameter `name` (collective for DTensors: every rank
    must call it).  Expert gate_up tensors are gathered through their storage view:
    torch's redistribute refuses `_StridedShard` on two dimensions (FSDP over edp
    on dim 0 and ETP on dim 2)."""
    if not isinstance(t, DTensor):
        return t
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # "2 sequential
    if name.endswith(GATE_UP):  # all_gathers" for FSDP-over-TP shards, once per tensor: expected here
        return storage_view(t).full_tensor().flatten(2)
    return t.full_tensor()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter unsharded, by name (collective)."""
    return {n: full_tensor(p.detach(), n) for n, p in model.named_parameters()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient unsharded, by name (collective); parameters without one are left out."""
    return {n: full_tensor(p.grad, n) for n, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------- DCP storage layout
GATE_UP = "experts.gate_up_proj"


def storage_view(t: torch.Tensor) -> torch.Tensor:
    """An expert gate_up tensor (E, D, 2F) as (E, D, 2, F), sharing its storage.

    Under ETP the (E, D, 2F) DTensor is `_StridedShard` on its last dimension
    (each rank holds matching gate and up columns), which DCP cannot describe
    as contiguous chunks; as (E, D, 2, F) the same shard is a plain `Shard(3)`.
    Checkpoints always store this 4-D form, so they load under any etp."""
    if isinstance(t, DTensor):
        from torch.distributed.tensor import Shard

        from moevlm.parallel.expert_parallel import _StridedShard

        loc = t._local_tensor
        E, D, F2 = t.shape
        placements = [Shard(3) if isinstance(p, _StridedShard) and p.dim == 2 else
                      Shard(3) if p.is_shard() and p.dim == 2 else p for p in t.placements]
        local4 = loc.view(loc.shape[0], loc.shape[1], 2, loc.shape[2] // 2)
        return DTensor.from_local(local4, t.device_mesh, placements, run_check=False, shape=torch.Size((E, D, 2, F2 // 2)),
                                  stride=(D * F2, F2, F2 // 2, 1))
    return t.view(t.shape[0], t.shape[1], 2, t.shape[2] // 2)


def to_storage_layout(model_sd: dict | None = None, optim_sd: dict | None = None) -> tuple[dict | None, dict | None]:
    """Shallow copies of the model / optimizer state dicts with every expert gate_up
    tensor (and its AdamW moments) as `storage_view`; loading into them writes the
    originals."""
    m = None if model_sd is None else {k: storage_view(v) if k.endswith(GATE_UP) else v for k, v in model_sd.items()}
    o = None
    if optim_sd is not None:  # flattened: "state.<fqn>.<moment>" (DCP's flatten_optimizer_state_dict)
        o = {k: storage_view(v) if torch.is_tensor(v) and v.ndim == 3 and k.rsplit(".", 1)[0].endswith(GATE_UP)
             else v for k, v in optim_sd.items()}
    return m, o
