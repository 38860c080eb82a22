"""The local dispatcher (expert parallel size 1): a stable sort by expert.

Legend as in `base.py`.  Rows are the T*K (token, choice) pairs sorted by expert
id, ties in token order, so every expert's rows are contiguous and in a fixed
order; `combine` scales by the router weights and sums the K rows of a token
with one `index_add_`.  Dropless: every choice is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moevlm.dispatch.base import TokenDispatcher, register_dispatcher


@dataclass
class LocalHandle:
    token_idx_M: torch.Tensor  # source token of every dispatched row
    weight_M: torch.Tensor  # router weight of every dispatched row
    num_tokens: int


@register_dispatcher
class LocalDispatcher(TokenDispatcher):
    name = "local"

    def dispatch(self, x_TD, topk_idx_TK, topk_w_TK):
        flat_idx = topk_idx_TK.reshape(-1)
        order_M = torch.sort(flat_idx, stable=True).indices
        token_idx_M = order_M // self.top_k
        tokens_per_expert_E = torch.bincount(flat_idx, minlength=self.num_experts)
        handle = LocalHandle(token_idx_M, topk_w_TK.reshape(-1)[order_M], x_TD.shape[0])
        return x_TD[token_idx_M], tokens_per_expert_E, handle

    def combine(self, expert_y_MD, handle: LocalHandle):
        weighted = expert_y_MD * handle.weight_M.to(expert_y_MD.dtype)[:, None]
        y_TD = expert_y_MD.new_zeros(handle.num_tokens, expert_y_MD.shape[1])
        return y_TD.index_add_(0, handle.token_idx_M, weighted)
