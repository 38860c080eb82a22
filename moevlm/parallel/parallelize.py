"""`parallelize(model, dims, cfg)`: the one place a built model is rewritten
for its parallel layout (TP/SP, EP/ETP, CP, PP, recompute, compile, FSDP2/DDP,
in that order).

One process needs no rewriting.  Multi-process layouts arrive with the
parallel-folding issue; until then a multi-rank launch is refused here with a
message, before any weight is materialised, rather than silently training
replicas that do not talk to each other.
"""

from __future__ import annotations

import torch.nn as nn

from moevlm.parallel.mesh import ParallelDims


class ParallelNotBuilt(NotImplementedError):
    pass


def parallelize(model: nn.Module, dims: ParallelDims, cfg=None) -> nn.Module:
    if dims.world == 1:
        return model
    raise ParallelNotBuilt(
        f"this layout ({dims.describe()}) needs the parallel folding (TP/EP/CP/PP, FSDP2/DDP), which is not "
        "built yet; launch one process (python train.py ...) until it lands")
