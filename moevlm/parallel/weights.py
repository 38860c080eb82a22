"""Parameters of a laid-out model: layout-independent initialization, unsharded values, the DCP
storage layout of the expert weights.

    init_parameters_(model, seed, ctx)       # the same weights under any layout
    full_state_dict(model); full_grads(model)  # unsharded, by name (collective)

Every parameter is drawn whole from a generator seeded by (seed, its name) and this rank keeps its
shard, so one process and any layout (pipeline stages included) start from the same weights.
"""

from __future__ import annotations

import logging
import zlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moevlm.model.vlm import fill_


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
        shard = distribute_tensor(
            full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None
        )
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def init_parameters_(model: nn.Module, seed: int, ctx=None, only=None) -> None:
    """Initialise every parameter by `model.init_rules()` (the whole model's, from `ctx` when `model` holds
    pipeline stages), each drawn whole from its own seeded generator, so the values do not depend on the
    layout; `only`: the names it accepts (e.g. LoRA adapters after loading a checkpoint), default all.
    Under FSDP's CPU offload (the shards on the host) the values are drawn on the compute device, as
    without offload, and copied to the host shards."""
    params = dict(model.named_parameters())
    rules = ctx.init_rules if ctx is not None and ctx.init_rules is not None else model.init_rules()
    offloaded = ctx is not None and getattr(ctx, "optimizer_offload", None) == "fsdp"
    draw_on = ctx.compute_device if offloaded else None
    for name, (kind, std) in rules.items():
        if only is not None and not only(name):
            continue
        if name not in params and ctx is not None and ctx.pipeline is not None:
            continue  # held by another pipeline stage
        p = params[name]
        device = draw_on or (p.to_local().device if isinstance(p, DTensor) else p.device)
        full = torch.empty(p.shape, dtype=torch.float32, device=device)
        fill_(full, kind, std, param_generator(seed, name, device))
        copy_full_(p, full)


def full_tensor(t: torch.Tensor, name: str = "") -> torch.Tensor:
    """The unsharded value of parameter `name` (collective for DTensors: every rank
    must call it).  Expert gate_up tensors are gathered through their storage view:
    torch's redistribute refuses `_StridedShard` on two dimensions (FSDP over edp
    on dim 0 and ETP on dim 2).  A shard held on the host (FSDP's CPU offload) is gathered on its
    mesh's device (an NCCL group takes no host tensors)."""
    if not isinstance(t, DTensor):
        return t
    if t._local_tensor.device.type != t.device_mesh.device_type:
        t = DTensor.from_local(  # moves the local tensor to the mesh's device
            t._local_tensor, t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
        )
    # "2 sequential
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # all_gathers" for FSDP-over-TP shards, once per tensor: expected here
    if is_gate_up(name):
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
# a LoRA adapter's (E, r, 2F), laid out as gate_up_proj over etp
GATE_UP_B = "experts.lora.gate_up_B"


def is_gate_up(name: str) -> bool:
    """An expert tensor whose last dimension is [gate | up] (the weight, or its LoRA B)."""
    return name.endswith((GATE_UP, GATE_UP_B))


def storage_view(t: torch.Tensor) -> torch.Tensor:
    """An expert gate_up tensor (E, D, 2F) as (E, D, 2, F) (a LoRA B: (E, r, 2F)), sharing its storage.

    Under ETP the (E, D, 2F) DTensor is `_StridedShard` on its last dimension
    (each rank holds matching gate and up columns), which DCP cannot describe
    as contiguous chunks; as (E, D, 2, F) the same shard is a plain `Shard(3)`.
    Checkpoints always store this 4-D form, so they load under any etp."""
    if isinstance(t, DTensor):
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        loc = t._local_tensor
        E, D, F2 = t.shape
        placements = [
            Shard(3)
            if isinstance(p, _StridedShard) and p.dim == 2
            else Shard(3)
            if p.is_shard() and p.dim == 2
            else p
            for p in t.placements
        ]
        local4 = loc.view(loc.shape[0], loc.shape[1], 2, loc.shape[2] // 2)
        return DTensor.from_local(
            local4,
            t.device_mesh,
            placements,
            run_check=False,
            shape=torch.Size((E, D, 2, F2 // 2)),
            stride=(D * F2, F2, F2 // 2, 1),
        )
    return t.view(t.shape[0], t.shape[1], 2, t.shape[2] // 2)


def to_storage_layout(
    model_sd: dict | None = None, optim_sd: dict | None = None
) -> tuple[dict | None, dict | None]:
    """Shallow copies of the model / optimizer state dicts with every expert gate_up
    tensor (and its AdamW moments) as `storage_view`; loading into them writes the
    originals."""
    m = (
        None
        if model_sd is None
        else {k: storage_view(v) if is_gate_up(k) else v for k, v in model_sd.items()}
    )
    o = None
    # flattened: "state.<fqn>.<moment>" (DCP's flatten_optimizer_state_dict)
    if optim_sd is not None:
        o = {
            k: storage_view(v)
            if torch.is_tensor(v) and v.ndim == 3 and is_gate_up(k.rsplit(".", 1)[0])
            else v
            for k, v in optim_sd.items()
        }
    return m, o


__all__ = [
    "GATE_UP",
    "GATE_UP_B",
    "copy_full_",
    "full_grads",
    "full_state_dict",
    "full_tensor",
    "init_parameters_",
    "is_gate_up",
    "param_generator",
    "storage_view",
    "to_storage_layout",
]
