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
from torch.distributed.tensor import Shard

from moevlm.parallel.tensor_parallel import shard_param

try:  # torch's placement for interleaved halves (used by FSDP2 + TP); private, present in 2.6+
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = None


def shard_experts(model: nn.Module, expert_mesh) -> None:
    """Shard every MoE block's expert weights over (ep, etp) of `expert_mesh`."""
    sub = expert_mesh["ep", "etp"]
    etp = expert_mesh["etp"].size()
    if etp > 1 and _StridedShard is None:  # pragma: no cover
        raise RuntimeError("parallel.etp > 1 needs torch's _StridedShard placement (torch >= 2.6)")
    gate_up = [Shard(0), _StridedShard(2, split_factor=2) if etp > 1 else Shard(2)]
    for layer in model.text.layers.children():  # a ModuleList, or a pipeline stage's ModuleDict
        if layer.is_moe:
            shard_param(layer.mlp.experts, "gate_up_proj", sub, gate_up)
            shard_param(layer.mlp.experts, "down_proj", sub, [Shard(0), Shard(1)])


__all__ = ["shard_experts"]
