"""The random number generators' state, saved per rank in a checkpoint and restored on resume.

per_rank={"rng": rng_state()}          # at save
set_rng_state(got["per_rank"]["rng"])  # after load
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Python `random`, numpy's global RNG, torch CPU and (if initialized) CUDA."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `rng_state` returned (CUDA only where it was saved and CUDA exists)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
