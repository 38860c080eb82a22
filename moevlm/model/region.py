"""Regions: the named points where a build step may wrap part of a module's forward.

A module holds a `Region` child at a slot (`region` for its whole forward; `attn_region`,
`act_region`, `preprocess_region` for parts); recompute, activation offload and CUDA graphs
install their own there, so `repr(model)` shows what runs.  Without one the computation runs
plainly.

    out = run_region(self, "region", self._forward, x)   # self.region(fn, x) if set, else fn(x)
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

__all__ = ["Region", "run_region"]


class Region(nn.Module):
    """A point where a computation may be wrapped; this plain one runs it."""

    def forward(self, fn: Callable, *args):
        return fn(*args)


def run_region(module: nn.Module, slot: str, fn: Callable, *args):
    """`fn(*args)` through the region `module` holds at `slot`, if any."""
    region = module._modules.get(slot)
    return fn(*args) if region is None else region(fn, *args)
