"""The local dispatcher (expert parallel size 1): rows grouped by expert on this rank.

Legend as in `base.py`.  Rows are the T*K (token, choice) pairs in the order of a
stable sort by expert id (ties in token order), so every expert's rows are
contiguous and in a fixed order; `combine` scales by the router weights and sums
the K rows of a token.  Dropless: every choice is computed.  The permutation
itself is `moevlm.dispatch.rows` (`permute="torch"` or `"triton"`, the fused
kernels).
"""

from __future__ import annotations

from moevlm.dispatch.base import TokenDispatcher, register_dispatcher
from moevlm.dispatch.rows import from_expert_rows, rows_plan, to_expert_rows


@register_dispatcher
class LocalDispatcher(TokenDispatcher):
    name = "local"
    pad_multiple = 1  # > 1: each expert's rows padded to a multiple (set for FP8 by moevlm.model.fp8)

    def __init__(self, num_experts: int, top_k: int, permute: str = "torch"):
        super().__init__(num_experts, top_k)
        self.permute = permute

    def preprocess(self, topk_idx_TK, topk_w_TK):
        if self.permute != "torch" or self.pad_multiple > 1:
            return None
        return rows_plan(topk_idx_TK, topk_w_TK, self.num_experts)

    def dispatch(self, x_TD, topk_idx_TK, topk_w_TK):
        return to_expert_rows(x_TD, topk_idx_TK, topk_w_TK, self.num_experts, self.permute,
                              plan=self.preprocess(topk_idx_TK, topk_w_TK), pad_multiple=self.pad_multiple)

    def combine(self, expert_y_MD, handle):
        return from_expert_rows(expert_y_MD, handle)
