"""TEST EMULATOR, not DeepEP: the run-time checks upstream's `deep_ep/utils/envs.py` makes before every V1 and
V2 dispatch or combine, and upstream's dtype rule for rows.  See ../README.md."""

from __future__ import annotations

import torch


def check_torch_deterministic() -> None:
    """Upstream refuses to run while torch's deterministic mode fills uninitialised memory (its kernels
    allocate with `torch.empty` and rely on it staying as written)."""
    assert not (
        torch.are_deterministic_algorithms_enabled()
        and torch.utils.deterministic.fill_uninitialized_memory
    ), (
        "DeepEP needs torch.utils.deterministic.fill_uninitialized_memory = False when "
        "deterministic algorithms are enabled"
    )


def check_bf16(x: torch.Tensor, what: str) -> None:
    """Upstream's kernels move and reduce bf16 rows only (fp8 comes as an (x, scales) tuple)."""
    assert x.dtype == torch.bfloat16, f"{what} takes bf16 rows only, got {x.dtype}"
