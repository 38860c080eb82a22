"""The model's linear layer: `nn.Linear` whose GEMMs run in FP8 once it is marked with an FP8 recipe.

Legend: D_in / D_out the in- and out-features.

    lin = Linear(D_in, D_out, bias=False)       # the same parameters and state dict as nn.Linear
    y = lin(x)                                   # F.linear, or FP8 after moevlm.model.fp8_targets marks it
    y = lin.project(x, weight_shard, bias)       # what tensor parallelism calls with its shard

`lin.lora` (None unless model.lora_rank > 0, moevlm.model.lora) adds its low-rank update to `project`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from moevlm.model.fp8 import Fp8Recipe, fp8_linear
from moevlm.model.strategies import local

__all__ = ["Linear"]


def is_adapter(name: str) -> bool:
    """A parameter or state-dict name inside a LoRA adapter (moevlm.model.lora)."""
    return ".lora." in name


class Linear(nn.Linear):
    """nn.Linear whose GEMMs run in FP8 once `apply_fp8` marks it (the same parameters and state dict)."""

    fp8: Fp8Recipe | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lora = None  # a moevlm.model.lora.LoraAdapter when the model's config asks for one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, local(self.weight), local(self.bias))

    def project(self, x, weight, bias=None):
        """x @ weight^T + bias: this module's weight, or a shard of it that tensor parallelism passes."""
        if self.fp8 is None:
            y = F.linear(x, weight, bias)
        else:
            y = fp8_linear(x, weight, bias, self.fp8, owner=self)
        return y if self.lora is None else y + self.lora(x)
