"""The model's linear layer: `nn.Linear` whose GEMMs run in FP8 once it is marked with an FP8 recipe.

Legend: D_in / D_out the in- and out-features.

    lin = Linear(D_in, D_out, bias=False)       # the same parameters and state dict as nn.Linear
    y = lin(x)                                   # F.linear, or FP8 after moevlm.model.fp8_targets marks it
    y = lin.project(x, weight_shard, bias)       # what tensor parallelism calls with its shard
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from moevlm.model.fp8 import Fp8Recipe, fp8_linear
from moevlm.model.strategies import local

__all__ = ["Linear"]


class Linear(nn.Linear):
    """nn.Linear whose GEMMs run in FP8 once `apply_fp8` marks it (the same parameters and state dict)."""

    fp8: Fp8Recipe | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, local(self.weight), local(self.bias))

    def project(self, x, weight, bias=None):
        """x @ weight^T + bias: this module's weight, or a shard of it that tensor parallelism passes."""
        if self.fp8 is None:
            return F.linear(x, weight, bias)
        return fp8_linear(x, weight, bias, self.fp8, owner=self)
