"""`build_model(cfg, dims, options)`: the one place a model is built for its parallel layout, on the
meta device (the order is docs/architecture.md's "Build order"), and the `ParallelContext` it returns.

    model, ctx = build_model(cfg, dims, BuildOptions(dp_mode="fsdp", device_type="cuda", bf16=True))
    materialize_(model, device, ctx)         # to_empty, through FSDP's pipeline roots
    init_parameters_(model, seed, ctx)       # or moevlm.parallel.hf_io.load_hf_weights_
    ...loss.backward() per micro-batch, or ctx.pipeline.forward_backward(...)...
    ctx.finish_gradients()                   # DDP all-reduces, tp sums of partial gradients
    norm = ctx.clip_grad_norm_(params, max_norm)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from moevlm.dispatch import DISPATCHERS, DispatcherSpec, dispatcher_names
from moevlm.dispatch.base import constructor_arguments
from moevlm.model.config import VLMConfig
from moevlm.model.fp8 import Fp8Recipe
from moevlm.model.fp8_targets import apply_fp8
from moevlm.model.moe import MoEBlock
from moevlm.model.strategies import Strategies
from moevlm.model.vlm import Qwen3VLMoe
from moevlm.parallel.compile import apply_compile
from moevlm.parallel.context_parallel import cp_strategies
from moevlm.parallel.cuda_graphs import CudaGraphs, apply_cuda_graphs
from moevlm.parallel.data_parallel import GradSync, apply_fsdp
from moevlm.parallel.ep_overlap import OverlappedRunner, problem
from moevlm.parallel.expert_parallel import shard_experts
from moevlm.parallel.master_weights import cast_parameters_
from moevlm.parallel.mesh import ParallelDims
from moevlm.parallel.offload import OffloadState, apply_offload, set_chains
from moevlm.parallel.optimizer_offload import offload_kind
from moevlm.parallel.pipeline import Pipeline, prune_to_stages, v_schedules_supported
from moevlm.parallel.pipeline_split import PipelineSplit
from moevlm.parallel.recompute import apply_recompute
from moevlm.parallel.tensor_parallel import (
    ParallelLoss,
    SumOverGroup,
    shard_tensor_parallel,
    tp_strategies,
)


class ParallelNotBuilt(NotImplementedError):
    pass


@dataclass
class ParallelContext:
    dims: ParallelDims
    dp_mode: str = "fsdp"
    meshes: tuple = ()
    groups: dict = field(default_factory=dict)  # tp, dp (data totals), dense, expert, vision, pp
    tp_partial: list[str] = field(default_factory=list)
    etp_partial: list[str] = field(default_factory=list)  # expert LoRA adapters whole over etp
    grad_sync: GradSync | None = None
    pipeline: Pipeline | None = None
    init_rules: dict | None = None  # the whole model's (a pipeline rank holds part of it)
    # flattened meshes: dense (dp x cp), vision (dp x cp x tp)
    flat: dict = field(default_factory=dict)
    # the meshes FSDP2 shards over: dense, vision, expert; 2-D (replicate, shard) under HSDP
    fsdp: dict = field(default_factory=dict)
    cuda_graphs: CudaGraphs | None = None
    offload: OffloadState | None = None  # the activation offload's streams and chains (None: off)
    fp8_marked: int = 0
    # parallel.optimizer_offload: "fsdp" (FSDP2's CPU offload policy: the shards live on the host),
    # "host" (DDP / one process: the trainer's optimizer keeps host masters), None (off)
    optimizer_offload: str | None = None
    device_type: str = "cpu"

    @property
    def compute_device(self) -> torch.device:
        """The device this rank computes and communicates on (the current CUDA device for NCCL)."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

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


@dataclass
class BuildOptions:
    """How `build_model` lays a model out beyond its dims (the defaults: one process, nothing added)."""

    dp_mode: str = "fsdp"  # fsdp | ddp
    device_type: str = "cpu"  # what the model will run on
    bf16: bool = False  # bf16 compute (FSDP's parameter dtype, compile's autocast)
    pipeline: PipelineSplit | None = None  # the stages; needed when dims.pp > 1
    dispatcher: DispatcherSpec = field(default_factory=DispatcherSpec)  # every MoE block's
    recompute: tuple[str, tuple[str, ...]] = ("none", ())  # mode and selective regions
    recompute_collectives: str = "save"  # save | reissue (moevlm.parallel.recompute)
    offload: tuple[str, ...] = ()  # activation offload scopes
    compile: bool = False
    compile_mode: str | None = None
    cp_comm: str = "allgather"  # allgather | ring
    ep_overlap: bool = False
    fp8: Fp8Recipe | None = None  # the FP8 recipe resolved for the device; None: off
    fp8_modules: tuple[str, ...] = ()
    cuda_graph_scope: tuple[str, ...] = ()
    optimizer_offload: bool = False
    # optim.master_weights: the parameters made bf16 (fp32 masters: moevlm.parallel.master_weights)
    master_weights: bool = False
    reduce_dtype: torch.dtype = torch.float32  # parallel.reduce_dtype: gradient reductions
    gdn_backend: str = "auto"  # the Gated DeltaNet kernel; a plan sets `modelled`


def build_model(
    cfg: VLMConfig, dims: ParallelDims, options: BuildOptions | None = None
) -> tuple[nn.Module, ParallelContext]:
    """The model of `cfg` laid out over `dims` on the meta device, and its context (see the module
    docstring)."""
    o = options or BuildOptions()
    _check_buildable(cfg, dims, o)
    ctx = ParallelContext(dims, o.dp_mode, device_type=o.device_type)
    ctx.optimizer_offload = offload_kind(o.optimizer_offload, dims.world, o.dp_mode)
    if dims.world > 1:
        _groups(ctx, o.device_type)
    with torch.device("meta"):
        model = Qwen3VLMoe(cfg, _strategies(cfg, ctx, o))
    _check_runners(model)
    if dims.pp > 1:  # this rank's stages only, before anything is sharded
        ctx.init_rules = model.init_rules()
        prune_to_stages(model, o.pipeline, ctx.meshes[0]["pp"].get_local_rank())
    if dims.tp > 1:
        ctx.tp_partial = shard_tensor_parallel(model, ctx.meshes[0]["tp"])
    if cfg.moe.num_experts and dims.ep * dims.etp > 1:
        ctx.etp_partial = shard_experts(model, ctx.meshes[1])
    apply_recompute(model, *o.recompute, collectives=o.recompute_collectives)
    ctx.offload = apply_offload(model, o.offload, o.device_type, o.recompute)
    ctx.fp8_marked = apply_fp8(model, o.fp8, o.fp8_modules)
    if dims.pp > 1:
        ctx.pipeline = _pipeline(model, o.pipeline, ctx)
        set_chains(ctx.pipeline.modules)
    if o.compile:  # after the parallelisms (and recompute), before FSDP/DDP
        apply_compile(model, mode=o.compile_mode, bf16=o.bf16)
    if o.master_weights:  # before FSDP: its shards (and what it gathers) are then bf16
        cast_parameters_(model, torch.bfloat16)
    _data_parallel(model, ctx, o.bf16, o.reduce_dtype)
    # captured at the first training forward
    ctx.cuda_graphs = apply_cuda_graphs(model, o.cuda_graph_scope)
    return model, ctx


def _check_buildable(cfg: VLMConfig, dims: ParallelDims, o: BuildOptions) -> None:
    if dims.pp > 1 and (o.pipeline is None or o.pipeline.pp != dims.pp):
        raise ValueError(
            f"parallel.pp={dims.pp} needs its PipelineSplit (moevlm.parallel.split_pipeline)"
        )
    experts_split = cfg.moe.num_experts and dims.ep * dims.etp > 1
    if experts_split and o.dispatcher.name not in DISPATCHERS:
        raise ParallelNotBuilt(
            f"model.dispatcher={o.dispatcher.name!r} is not built yet; available: "
            f"{list(dispatcher_names())}"
        )
    if experts_split and "ep_group" not in constructor_arguments(o.dispatcher.name):
        raise ValueError(
            f"parallel.ep x etp = {dims.ep} x {dims.etp} splits the experts over ranks, which the "
            f"{o.dispatcher.name!r} dispatcher cannot reach: build with "
            "BuildOptions(dispatcher=DispatcherSpec('alltoall')) or another exchanging backend"
        )
    if dims.dp_replicate > 1 and o.dp_mode != "fsdp":
        raise ValueError(
            f"parallel.dp_replicate={dims.dp_replicate} shards within replicas (HSDP), but "
            f"parallel.dp_mode={o.dp_mode} replicates every weight on every data rank; use dp_mode=fsdp"
        )
    _check_lora_buildable(cfg, dims)
    if o.ep_overlap and not (cfg.moe.num_experts and dims.ep > 1):
        raise ValueError(
            "parallel.ep_overlap needs MoE layers and parallel.ep > 1 (nothing to overlap otherwise)"
        )


def _check_lora_buildable(cfg: VLMConfig, dims: ParallelDims) -> None:
    """Attention adapters whose base rows a layout slices inside the layer (moevlm.model.decoder's
    k/v rows when kv heads < tp, a Gated DeltaNet's heads under tp or cp) are not built yet."""
    lo, t = cfg.lora, cfg.text
    if not (lo.rank and "attn" in lo.modules):
        return
    if dims.tp > t.num_kv_heads:
        raise ParallelNotBuilt(
            f"model.lora_rank={lo.rank} with attn adapters and parallel.tp={dims.tp} > the "
            f"{t.num_kv_heads} kv heads (replicated k/v weights sliced per rank) is not built yet; "
            f"use parallel.tp <= {t.num_kv_heads} or drop attn from model.lora_modules"
        )
    if "linear_attention" in t.layer_types and dims.tp * dims.cp > 1:
        raise ParallelNotBuilt(
            f"model.lora_rank={lo.rank} with attn adapters on Gated DeltaNet layers under parallel.tp="
            f"{dims.tp} x cp={dims.cp} is not built yet; use tp = cp = 1 or drop attn from "
            "model.lora_modules"
        )


def _groups(ctx: ParallelContext, device_type: str) -> None:
    dims = ctx.dims
    attn, expert = dims.build_meshes(device_type)
    ctx.meshes = (attn, expert)
    data = dims.data_meshes(attn, expert)
    ctx.fsdp = {k: data[k] for k in ("dense", "vision", "expert")}
    ctx.flat = {"dense": data["dp_cp"], "vision": data["dp_cp_tp"]}
    ctx.groups = {
        "tp": attn["tp"].get_group(),
        "dp": data["dp"].get_group(),
        "dense": ctx.flat["dense"].get_group(),
        "expert": data["edp"].get_group(),
        "vision": ctx.flat["vision"].get_group(),
        "pp": attn["pp"].get_group(),
        "ep": expert["ep"].get_group(),
        "etp": expert["etp"].get_group(),
    }
    if dims.dp_replicate > 1:  # HSDP: FSDP's two groups per mesh (ParallelDims.FOLDED's names)
        for kind, names in dims.FOLDED.items():
            for i, name in enumerate(names):
                ctx.groups[name] = ctx.fsdp[kind].get_group(i)
    if ctx.dims.cp > 1:  # the ranks a row is split over: router statistics are summed over them
        ctx.groups.update(
            cp=attn["cp"].get_group(), cp_tp=attn["cp", "tp"]._flatten("cp_tp").get_group()
        )


def _strategies(cfg: VLMConfig, ctx: ParallelContext, o: BuildOptions) -> Strategies:
    """The strategies of this layout: tensor parallel under context parallel, the dispatchers, the runner."""
    dims, fields = ctx.dims, {"gdn_backend": o.gdn_backend}
    loss = {}
    if dims.tp > 1:
        tp = tp_strategies(ctx.meshes[0]["tp"], cfg.text.vocab_size)
        group, start = tp.pop("loss_group")
        fields.update(tp, router_stats=SumOverGroup(ctx.groups["tp"]))
        loss.update(group=group, vocab_start=start)
    if dims.cp > 1:
        info, cp = cp_strategies(
            ctx.groups["cp"], o.cp_comm, fields.get("sequence", Strategies().sequence)
        )
        fields.update(cp, router_stats=SumOverGroup(ctx.groups["cp_tp"]))
        loss.update(take=info.take)
    if loss:
        fields["loss"] = lambda: ParallelLoss(**loss)
    spec, groups = (
        o.dispatcher,
        {"ep_group": ctx.groups.get("ep"), "etp_group": ctx.groups.get("etp")},
    )
    # (layer index, MoE config) -> the block's dispatcher, built once per MoE block with its groups
    fields["dispatcher"] = lambda layer_idx, moe_cfg: spec.build(moe_cfg, **groups)
    if o.ep_overlap:
        fields["experts_runner"] = OverlappedRunner
    return Strategies(**fields)


def _pipeline(model: nn.Module, plan: PipelineSplit, ctx: ParallelContext) -> Pipeline:
    if plan.style == "v" and not v_schedules_supported(dist.get_backend(ctx.pp_group)):
        raise ParallelNotBuilt(
            f"parallel.pp_schedule={plan.schedule} cannot start on gloo with this torch: its pipeline stages "
            "open with a send from each rank to itself (the two stages a V puts on one rank), which gloo refuses; "
            "use NCCL (GPUs), a torch whose stages skip that (2.13), or another schedule"
        )
    return Pipeline(model, plan, ctx.meshes[0]["pp"].get_local_rank(), ctx.pp_group)


def _check_runners(model: nn.Module) -> None:
    """The overlapped experts runner drives only the dispatchers it can (EP over all-to-all, etp 1)."""
    for block in (m for m in model.modules() if isinstance(m, MoEBlock)):
        if isinstance(block.runner, OverlappedRunner) and problem(block.dispatcher) is not None:
            raise ValueError(problem(block.dispatcher))


def _data_parallel(
    model: nn.Module, ctx: ParallelContext, bf16: bool, reduce_dtype: torch.dtype
) -> None:
    dims = ctx.dims
    if dims.world == 1:
        ctx.grad_sync = GradSync(
            model, fsdp=False, groups={"tp": None}, tp_partial=[], tp=1, world=1
        )
        return
    if ctx.dp_mode == "fsdp":
        apply_fsdp(
            model,
            ctx.fsdp["dense"],
            ctx.fsdp["expert"],
            ctx.fsdp["vision"],
            dims.tp,
            bf16,
            roots=ctx.pipeline.modules if ctx.pipeline else None,
            offload_policy=_offload_policy(ctx) if ctx.optimizer_offload == "fsdp" else None,
            reduce_dtype=reduce_dtype,
        )
    ctx.grad_sync = GradSync(
        model,
        fsdp=ctx.dp_mode == "fsdp",
        groups=ctx.groups,
        tp_partial=ctx.tp_partial,
        etp_partial=ctx.etp_partial if dims.etp > 1 else [],
        tp=dims.tp,
        world=dims.world,
        stage_world=dims.world // dims.pp,
        comm_device=ctx.compute_device if ctx.optimizer_offload == "fsdp" else None,
        reduce_dtype=reduce_dtype,
    )


def _offload_policy(ctx: ParallelContext):
    """FSDP2's CPU offload policy, with pinned host memory when the job runs on CUDA."""
    from moevlm.parallel.optimizer_offload import fsdp_offload_policy, pin_host_memory

    return fsdp_offload_policy(pin=ctx.device_type == "cuda" and pin_host_memory())


def materialize_(model: nn.Module, device, ctx: ParallelContext | None = None) -> None:
    """`model.to_empty(device)` for a built model: under pipeline stages with FSDP the stage modules are
    the FSDP roots, so they move their parameters (FSDP re-registers its shards).  Under FSDP's CPU
    offload (parallel.optimizer_offload) the parameters are made on the host, where the policy keeps
    them, and the buffers (the routers' expert biases) on `device`."""
    offload = ctx is not None and ctx.optimizer_offload == "fsdp"
    roots = (
        ctx.pipeline.modules
        if ctx is not None and ctx.pipeline is not None and ctx.dp_mode == "fsdp"
        else [model]
    )
    for root in roots:
        root.to_empty(device="cpu" if offload else device)
    if offload and torch.device(device).type != "cpu":
        for module in model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None:
                    module._buffers[name] = buf.to(device)


__all__ = ["BuildOptions", "ParallelContext", "ParallelNotBuilt", "build_model", "materialize_"]
