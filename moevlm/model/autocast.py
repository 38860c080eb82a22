"""The dtype a computation runs in: autocast's where autocast is on for the device (its listed ops
compute in that dtype whatever their inputs'), else the inputs' own.

    dtype = compute_dtype("cuda", x.dtype)   # bf16 under torch.autocast("cuda", torch.bfloat16)
"""

from __future__ import annotations

import torch

__all__ = ["compute_dtype"]


def compute_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """autocast's dtype where autocast is on for `device_type`, else `dtype`."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype
