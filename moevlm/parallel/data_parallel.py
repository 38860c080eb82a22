"""Data parallel: the FSDP2 units (`apply_fsdp`, HSDP included) and `GradSync` (DDP's bucketed
all-reduce, the tp sums of partial gradients, gradient-norm clipping over every shard of every
group).

Every reduction is a sum; a weight computed identically on several ranks has it divided by their
number (why: docs/architecture.md):

    group of the reduction         weights
    dense mesh (dp x cp)           attention, norms, router, embeddings, LM head
    expert mesh edp                experts (each EP/ETP shard with its copies)
    vision mesh (dp x cp x tp)     vision tower, divided by tp (FSDP and DDP)
    tp (after the above)           `tp_partial` weights
    etp (after the above)          expert LoRA adapters whole over etp (gate_up's A, down's B)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = ()


def apply_fsdp(
    model: nn.Module,
    dense_mesh,
    expert_mesh,
    vision_mesh,
    tp: int,
    bf16: bool,
    roots: list[nn.Module] | None = None,
    offload_policy=None,
    reduce_dtype: torch.dtype = torch.float32,
) -> None:
    """FSDP2 units over the parts of `model` this rank holds; `roots` (default: the model) own what
    is left (embeddings, final norm, LM head).  Pipeline stage modules are roots of their stage: they
    pass their inputs (activations, fp32 router statistics) through uncast.  `offload_policy`
    (parallel.optimizer_offload): FSDP's CPUOffloadPolicy for every unit.  `reduce_dtype`
    (parallel.reduce_dtype): the reduce-scatters' dtype; the gradients are kept in the weights'
    dtype (under bf16 weights, optim.master_weights, the gather is not cast)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def policy(cast_inputs: bool = True):
        if not bf16:  # fp32 compute: gradients in fp32, reduced in fp32 unless asked otherwise
            reduce = None if reduce_dtype == torch.float32 else reduce_dtype
            return MixedPrecisionPolicy(reduce_dtype=reduce, cast_forward_inputs=cast_inputs)
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, cast_forward_inputs=cast_inputs
        )

    units: list[tuple[nn.Module, float]] = []

    # Under pipeline stages the weights stay gathered from a micro-batch's forward to its backward (torch's
    # stage reshards them after the step): no all-gather per micro-batch, and the zero-bubble schedules'
    # split backward finds the weights its weight-gradient pass differentiates.
    # else torch's default (root: kept)
    keep = {} if roots is None else {"reshard_after_forward": False}
    if offload_policy is not None:
        keep["offload_policy"] = offload_policy

    def shard(module, mesh, divide, cast_inputs=True):
        fully_shard(module, mesh=mesh, mp_policy=policy(cast_inputs), **keep)
        units.append((module, divide))

    if model.vision is not None:
        for block in model.vision.blocks:
            shard(block, vision_mesh, tp)
        shard(model.vision, vision_mesh, tp)
    for layer in model.text.layers.children():
        if layer.is_moe:
            shard(layer.mlp.experts, expert_mesh, 1.0)
        shard(layer, dense_mesh, 1.0)
    for root in roots or [model]:
        shard(root, dense_mesh, 1.0, cast_inputs=roots is None)
    for module, divide in units:
        # sum over the shard group and (HSDP) the replicas, then / divide: our sums (module docstring)
        module.set_gradient_divide_factor(float(divide))
        # plain SUM (+ a division): gloo has no PREMUL_SUM
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)


class GradSync:
    """The per-step gradient finish: DDP all-reduces (when not FSDP) and the tp sums.
    Parameters are looked up by name at every call (materializing a meta model
    replaces the parameter objects)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        fsdp: bool,
        groups: dict,
        tp_partial: list[str],
        tp: int,
        etp_partial: list[str] = (),
        world: int,
        stage_world: int | None = None,
        bucket_mb: float = 64.0,
        comm_device: torch.device | None = None,
        reduce_dtype: torch.dtype = torch.float32,
    ):
        self.model = model
        # parallel.reduce_dtype: the dtype of the DDP buckets and the tp sums
        self.reduce_dtype = reduce_dtype
        # where the process groups' collectives run (NCCL: the GPU); gradients held on the host (FSDP's
        # CPU offload) are moved there for the norm's and the tp sums' all-reduces
        self.comm_device = comm_device
        names = [n for n, _ in model.named_parameters()]
        missing = sorted(set(tp_partial).union(etp_partial) - set(names))
        if missing:
            raise RuntimeError(f"tp- or etp-partial parameters not in the model: {missing[:5]}")
        self.world, self.tp = world, tp
        # the ranks holding this rank's parameters (world / pp)
        self.stage_world = stage_world or world
        self.bucket_elems = int(bucket_mb * (1 << 20) / 4)
        # the clip's per-gradient weights (1 / copies) by their values: made once, no host copy per step
        self.shard_weights: dict[tuple, torch.Tensor] = {}
        self.tp_group = groups["tp"]
        # (group, names) summed after the data-parallel reductions: tp-partial weights, and expert LoRA
        # adapters whole over etp (moevlm.parallel.expert_parallel)
        self.partial = [(self.tp_group, list(tp_partial))] if tp > 1 else []
        self.partial += [(groups["etp"], list(etp_partial))] if etp_partial else []
        self.ddp_buckets: list[tuple[object, float, list[str]]] = []
        if not fsdp:
            by_group: dict[str, list[str]] = {"dense": [], "expert": [], "vision": []}
            for n in names:
                by_group[
                    "vision"
                    if n.startswith("vision.")
                    else "expert"
                    if ".experts." in n
                    else "dense"
                ].append(n)
            for kind, members in by_group.items():
                group = groups.get(kind)
                if members and group is not None and dist.get_world_size(group) > 1:
                    # the vision tower: sum over dp x cp x tp, / tp (the tp copies are identical): one average
                    # of the copies keeps them bitwise equal even where a GPU kernel is not deterministic
                    self.ddp_buckets.append((group, 1.0 / tp if kind == "vision" else 1.0, members))

    @torch.no_grad()
    def finish(self) -> None:
        params = dict(self.model.named_parameters())
        for group, scale, members in self.ddp_buckets:
            for n in members:  # every rank reduces the same buckets, used or not this step
                if params[n].grad is None and params[n].requires_grad:
                    params[n].grad = torch.zeros_like(params[n])
            _all_reduce_flat(
                [params[n].grad for n in members if params[n].grad is not None],
                group,
                self.bucket_elems,
                scale,
                dtype=self.reduce_dtype,
            )
        for group, partial in self.partial:
            _all_reduce_flat(
                [params[n].grad for n in partial if params[n].grad is not None],
                group,
                self.bucket_elems,
                device=self.comm_device,
                dtype=self.reduce_dtype,
            )

    @torch.no_grad()
    def clip_grad_norm_(self, params, max_norm: float) -> torch.Tensor:
        """Global L2 norm of all gradients (each distinct shard counted once over
        the whole world, every pipeline stage included), then scale by min(1, max_norm / norm).
        One all-reduce."""
        grads = [p.grad for p in params if p.grad is not None]
        locals_ = [local_tensor(g) for g in grads]
        device = locals_[0].device if locals_ else _device(self.model)
        # a rank without gradients still joins the sum
        total = torch.zeros((), dtype=torch.float64, device=device)
        if grads:
            # empty shards give 0
            # bf16 gradients (optim.master_weights): their norms computed and returned in fp32
            wide = (
                {} if all(t.dtype == torch.float32 for t in locals_) else {"dtype": torch.float32}
            )
            norms = torch.stack(torch._foreach_norm(locals_, 2, **wide)).double()
            total = (norms.pow(2) * self._weights(grads, device)).sum()
        if dist.is_initialized() and self.world > 1:
            # host gradients (FSDP's CPU offload): the sum runs on the group's device
            total = total.to(self.comm_device or device)
            dist.all_reduce(total)
            total = total.to(device)
        norm = total.sqrt().float()
        if math.isfinite(max_norm) and locals_:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(locals_, coef.to(locals_[0].dtype))
        return norm

    def _weights(self, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """1 / (copies of each gradient's shard) as a float64 device tensor, made once per set of
        values (a captured step replays it; no host-to-device copy per step)."""
        key = (device, tuple(_copies(g, self.stage_world) for g in grads))
        if key not in self.shard_weights:
            values = [1.0 / c for c in key[1]]
            self.shard_weights[key] = torch.tensor(values, dtype=torch.float64, device=device)
        return self.shard_weights[key]


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return torch.device("cpu") if p is None else local_tensor(p).device


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage, outside autograd), or `t` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _copies(g: torch.Tensor, world: int) -> int:
    """How many ranks hold this same shard: the ranks holding the parameter (`world`: those of its
    pipeline stage) / number of distinct shards."""
    if not isinstance(g, DTensor):
        return world
    shards = 1
    for i, pl in enumerate(g.placements):
        # FSDP over TP uses _StridedShard (not a Shard)
        if pl.is_shard() or isinstance(pl, _StridedShard):
            shards *= g.device_mesh.size(i)
    return world // shards


def _all_reduce_flat(
    grads: list[torch.Tensor],
    group,
    bucket_elems: int,
    scale: float = 1.0,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Sum the local tensors of `grads` over `group`, in flat buckets of `dtype` (on `device` when the
    tensors are elsewhere: host gradients under FSDP's CPU offload, an NCCL group)."""
    locals_ = [local_tensor(g) for g in grads]
    start = 0
    while start < len(locals_):
        end, n = start, 0
        while end < len(locals_) and (n == 0 or n + locals_[end].numel() <= bucket_elems):
            n += locals_[end].numel()
            end += 1
        chunk = locals_[start:end]
        flat = torch.cat([t.reshape(-1).to(dtype) for t in chunk])
        if device is not None and flat.device != device:
            flat = flat.to(device)
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for t in chunk:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        start = end
