"""The token-dispatcher interface the MoE block calls, and the single-process dispatcher.

Legend: T tokens on this rank, K top-k, D hidden, E experts in the model,
L experts on this rank (E for the local dispatcher), M rows after dispatch.

    expert_x_MD, tokens_per_expert_L, handle = d.dispatch(x_TD, topk_idx_TK, topk_w_TK)
    expert_y_MD = experts(expert_x_MD, tokens_per_expert_L)
    y_TD = d.combine(expert_y_MD, handle)

The contract (docs/dispatchers.md has the whole of it):
- Routing comes in as top-k indices (int64) and fp32 weights.
- `dispatch` returns rows grouped by local expert, in expert order, and a *tensor* of rows per
  local expert (no host copy unless a backend forces one).
- **Router weights are applied in `combine`, exactly once**, to the expert output before the
  per-token sum.  `dispatch` never scales rows.
- `handle` is opaque to the caller: whatever the backend needs to invert the permutation (and,
  for collectives, to run backward through the same plan).
- `preprocess(topk_idx_TK, topk_w_TK)` is the routing-only part of `dispatch` before any
  exchange or host sync (static shapes), or None; a backend reaches it through `planned`, so a
  region installed at `preprocess_region` (a CUDA graph) runs it.

Design choices:
- A dispatcher is a parameter-free module, built once per MoE block by whoever builds the model
  (the local one by default; moevlm.parallel.build for expert parallelism) and held by the
  block, so `repr(model)` names it.  The distributed backends and their registry live in
  moevlm.dispatch; the model imports none of them.
- What other steps need to know is a property here, never an `isinstance` check:
  `exchanges` (a collective exchange with a host sync: kept out of compiled graphs),
  `pads_experts` (can pad each expert's rows for FP8 scale blocks), `overlappable` (the
  chunked EP-overlap runner can drive it), `capturable_preprocess` (its `preprocess` has
  static shapes a CUDA graph may capture).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn as nn

from moevlm.model.layout import run_region
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
