"""Expert parallel (EP) and expert tensor parallel (ETP) for the MoE blocks: the expert weights'
placements (`shard_experts`); each block's dispatcher is built by `build_model`.

Legend: E experts, L = E/ep local experts, D hidden, F expert hidden, etp the
expert-tensor-parallel size.

    gate_up_proj (E, D, 2F)  ->  local (L, D, 2F/etp) = [gate slice | up slice]
    down_proj    (E, F, D)   ->  local (L, F/etp, D)
    router                   replicated (every rank routes its own tokens)
    dispatcher               built per block: AllToAllDispatcher(ep group, etp group[, capacity_factor]), ...

DTensors on the expert mesh's (ep, etp); why these placements: docs/architecture.md.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from moevlm.parallel.tensor_parallel import shard_param

try:  # torch's placement for interleaved halves (used by FSDP2 + TP); private, present in 2.6+
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = None


def shard_experts(model: nn.Module, expert_mesh) -> list[str]:
    """Shard every MoE block's expert weights (and LoRA adapters) over (ep, etp) of `expert_mesh`;
    returns the names of the adapters whose gradients are partial over etp (summed once per step)."""
    sub = expert_mesh["ep", "etp"]
    etp = expert_mesh["etp"].size()
    if etp > 1 and _StridedShard is None:  # pragma: no cover
        raise RuntimeError("parallel.etp > 1 needs torch's _StridedShard placement (torch >= 2.6)")
    gate_up = [Shard(0), _StridedShard(2, split_factor=2) if etp > 1 else Shard(2)]
    partial = []
    for i, layer in model.text.layers.named_children():  # a ModuleList, or a stage's ModuleDict
        if not layer.is_moe:
            continue
        experts = layer.mlp.experts
        shard_param(experts, "gate_up_proj", sub, gate_up)
        shard_param(experts, "down_proj", sub, [Shard(0), Shard(1)])
        if experts.lora is not None:
            partial += _shard_expert_lora(
                experts.lora, f"text.layers.{i}.mlp.experts.lora.", sub, gate_up
            )
    return partial


def _shard_expert_lora(lora, p: str, sub, gate_up) -> list[str]:
    """Expert adapters over experts as their weights; over etp as a linear's beside a column- (gate_up:
    B's columns, A whole) or row-parallel (down: A's rows, B whole) weight.  Returns the etp-partial."""
    shard_param(lora, "gate_up_A", sub, [Shard(0), Replicate()])
    shard_param(lora, "gate_up_B", sub, gate_up)
    shard_param(lora, "down_A", sub, [Shard(0), Shard(1)])
    shard_param(lora, "down_B", sub, [Shard(0), Replicate()])
    return [p + "gate_up_A", p + "down_B"]


__all__ = ["shard_experts"]
