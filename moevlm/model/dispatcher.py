"""The token-dispatcher interface the MoE block calls, and the single-process dispatcher.

Legend: T tokens on this rank, K top-k, D hidden, E experts in the model,
L experts on this rank (E for the local dispatcher), M rows after dispatch.

    expert_x_MD, tokens_per_expert_L, handle = d.dispatch(x_TD, topk_idx_TK, topk_w_TK)
    expert_y_MD = experts(expert_x_MD, tokens_per_expert_L)
    y_TD = d.combine(expert_y_MD, handle)                    # router weights applied here, once

Rows come back grouped by local expert, with a tensor of counts; `handle` is opaque to the caller.
What other build steps need to know is a property (`exchanges`, `pads_experts`, `overlappable`,
`capturable_preprocess`).  The whole contract: docs/dispatchers.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn as nn

from moevlm.model.region import run_region
from moevlm.model.rows import from_expert_rows, rows_plan, to_expert_rows


class TokenDispatcher(nn.Module):
    name: ClassVar[str]
    exchanges = False
    pads_experts = False
    overlappable = False
    pad_multiple = (
        1  # > 1: each expert's rows padded to a multiple (FP8 scale blocks), where pads_experts
    )

    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k

    def extra_repr(self) -> str:
        return f"{self.name}, experts={self.num_experts}, top_k={self.top_k}"

    @classmethod
    def unavailable_reason(cls, **kwargs) -> str | None:
        """Why this backend cannot run with these arguments here, or None."""
        return None

    @property
    def capturable_preprocess(self) -> bool:
        return False

    def preprocess(
        self, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor
    ) -> tuple[torch.Tensor, ...] | None:
        """Routing -> the plan tensors `dispatch` starts from (static shapes, no host sync); None: none."""
        return None

    def planned(self, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor):
        """`preprocess` through the region at `preprocess_region`, if one is installed."""
        return run_region(self, "preprocess_region", self.preprocess, topk_idx_TK, topk_w_TK)

    def dispatch(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement dispatch")

    def combine(self, expert_y_MD: torch.Tensor, handle: Any) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement combine")


class LocalDispatcher(TokenDispatcher):
    """Expert parallel size 1: rows grouped by expert on this rank.

    Rows are the T*K (token, choice) pairs in the order of a stable sort by expert id (ties in token
    order), so every expert's rows are contiguous and in a fixed order; `combine` scales by the router
    weights and sums the K rows of a token.  Dropless.  The permutation is `moevlm.model.rows`
    (`permute="torch"` or `"triton"`, the fused kernels)."""

    name = "local"
    pads_experts = True

    def __init__(self, num_experts: int, top_k: int, permute: str = "torch"):
        super().__init__(num_experts, top_k)
        self.permute = permute

    @property
    def capturable_preprocess(self) -> bool:
        return self.permute == "torch"

    def preprocess(self, topk_idx_TK, topk_w_TK):
        if self.permute != "torch" or self.pad_multiple > 1:
            return None
        return rows_plan(topk_idx_TK, topk_w_TK, self.num_experts)

    def dispatch(self, x_TD, topk_idx_TK, topk_w_TK):
        return to_expert_rows(
            x_TD,
            topk_idx_TK,
            topk_w_TK,
            self.num_experts,
            self.permute,
            plan=self.planned(topk_idx_TK, topk_w_TK),
            pad_multiple=self.pad_multiple,
        )

    def combine(self, expert_y_MD, handle):
        return from_expert_rows(expert_y_MD, handle)


__all__ = ["LocalDispatcher", "TokenDispatcher"]
