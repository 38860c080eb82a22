"""The MoE MLP: fp32 top-k router, dispatcher, grouped-GEMM SwiGLU experts.

Legend: T tokens, D hidden, E experts, K top-k, F expert hidden, M dispatched rows.

Design choices:
- The router runs in fp32 whatever the model dtype (logits, softmax, top-k,
  renormalisation): routing decisions are the most precision-sensitive step.
- Expert weights are stored `x @ W` style: `gate_up_proj` (E, D, 2F) with the
  gate columns first, `down_proj` (E, F, D).  That is the hub checkpoint layout
  and what grouped GEMMs take directly; `hf.py` transposes the transformers
  in-memory layout on load/export.
- The block never knows which dispatcher runs: it is handed one when built (the local one by
  default; `moevlm.parallel.build` builds the expert-parallel ones), and an experts runner
  (dispatch -> experts -> combine; `parallel.ep_overlap` hands a chunked, overlapped one).
  Router weights are applied once, in `combine`.
- Every MoE block returns `RouterStats` of its own tokens (sums, not means) so the
  auxiliary loss is formed once over all layers exactly as the reference does; the
  decoder reduces them over the ranks that share the sequence (the layout's
  `router_stats`), and the trainer the same sums over data-parallel ranks.
- Regions a build step may wrap: the whole block (`region`), the SwiGLU between the
  two grouped GEMMs (`act_region`); see `moevlm.model.layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from moevlm.model.config import MoEConfig
from moevlm.model.fp8 import Fp8Plan, Linear, expert_mm
from moevlm.model.layout import Layout, local, run_region


@dataclass
class RouterStats:
    prob_sum_E: torch.Tensor  # sum over tokens of the full softmax, fp32
    counts_E: torch.Tensor  # top-k selections per expert, fp32
    num_tokens: int | torch.Tensor  # a tensor when masked (no host sync)


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return run_region(self, "region", self._forward, x_TD)

    def _forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dtype = torch.promote_types(x_TD.dtype, torch.float32)  # fp32, or fp64 in float64 tests
        # autocast would run this linear in bf16
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = F.linear(x_TD.to(dtype), self.weight.to(dtype))
        probs_TE = logits_TE.softmax(dim=-1)
        topk_w_TK, topk_idx_TK = probs_TE.topk(self.top_k, dim=-1)
        topk_w_TK = topk_w_TK / topk_w_TK.sum(dim=-1, keepdim=True)
        return topk_idx_TK, topk_w_TK, probs_TE


class Experts(nn.Module):
    fp8: Fp8Plan | None = None  # set by moevlm.model.fp8.apply_fp8
    compile_eager_gemm = (
        False  # the grouped GEMMs stay out of a compiled graph (moevlm.parallel.compile)
    )

    def __init__(self, num_experts: int, hidden: int, ffn: int, grouped_gemm: str):
        super().__init__()
        self.grouped_gemm = grouped_gemm
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * ffn))
        self.down_proj = nn.Parameter(torch.empty(num_experts, ffn, hidden))

    def forward(self, x_MD: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """Over this rank's shards of the weights (whole without expert parallelism)."""
        if self.compile_eager_gemm:
            return _eager_mlp(self, x_MD, tokens_per_expert_E)
        return self.mlp(x_MD, tokens_per_expert_E)

    def mlp(self, x_MD, counts_E) -> torch.Tensor:
        """The two grouped GEMMs around SwiGLU."""
        gate_up_EDF2, down_EFD = local(self.gate_up_proj), local(self.down_proj)
        h_MF2 = expert_mm(
            x_MD, gate_up_EDF2, counts_E, self.grouped_gemm, self.fp8, (self, "gate_up")
        )
        h_MF = run_region(self, "act_region", swiglu, h_MF2)
        return expert_mm(h_MF, down_EFD, counts_E, self.grouped_gemm, self.fp8, (self, "down"))


@torch.compiler.disable
def _eager_mlp(experts: Experts, x_MD, counts_E):
    return experts.mlp(x_MD, counts_E)


def swiglu(h_MF2: torch.Tensor) -> torch.Tensor:
    """SwiGLU between the two grouped GEMMs (gate columns first)."""
    gate_MF, up_MF = h_MF2.chunk(2, dim=-1)
    return F.silu(gate_MF) * up_MF


class MoEBlock(nn.Module):
    def __init__(
        self, hidden: int, cfg: MoEConfig, layer_idx: int = 0, layout: Layout | None = None
    ):
        super().__init__()
        layout = layout or Layout()
        self.num_experts = cfg.num_experts
        self.router = Router(hidden, cfg.num_experts, cfg.top_k)
        self.experts = Experts(cfg.num_experts, hidden, cfg.moe_intermediate_size, cfg.grouped_gemm)
        self.dispatcher = layout.dispatcher(layer_idx, cfg)
        self.runner = layout.experts_runner()

    def forward(
        self, x_BSD: torch.Tensor, token_mask_BS: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, RouterStats]:
        """`token_mask_BS` (True = real token) keeps padding out of the router
        statistics (aux loss, expert load); padding is still routed and computed."""
        return run_region(self, "region", self._forward, x_BSD, token_mask_BS)

    def _forward(self, x_BSD, token_mask_BS):
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        topk_idx_TK, topk_w_TK, probs_TE = self.router(x_TD)
        y_TD = self.runner(x_TD, topk_idx_TK, topk_w_TK, self.dispatcher, self.experts)
        return y_TD.view_as(x_BSD), self.stats(topk_idx_TK, probs_TE, token_mask_BS)

    def stats(self, topk_idx_TK, probs_TE, token_mask_BS) -> RouterStats:
        """Counts by a fixed-size `scatter_add_` (no `bincount`: its output size is data dependent,
        which breaks a compiled graph, and it syncs on CUDA)."""
        idx_N = topk_idx_TK.reshape(-1)
        counts_E = torch.zeros(self.num_experts, dtype=torch.float32, device=idx_N.device)
        if token_mask_BS is None:
            counts_E.scatter_add_(0, idx_N, torch.ones_like(idx_N, dtype=torch.float32))
            return RouterStats(probs_TE.sum(0), counts_E, topk_idx_TK.shape[0])
        keep_T = token_mask_BS.reshape(-1).to(probs_TE.device)
        counts_E.scatter_add_(
            0, idx_N, keep_T[:, None].expand_as(topk_idx_TK).reshape(-1).to(torch.float32)
        )
        return RouterStats((probs_TE * keep_T[:, None]).sum(0), counts_E, keep_T.sum())


class DenseMLP(nn.Module):
    """SwiGLU MLP of the `mlp_only_layers`: the sequence gathered before the gate/up projections and
    scattered by the down projection (both no-ops in one process)."""

    def __init__(self, hidden: int, ffn: int, layout: Layout | None = None):
        super().__init__()
        self.seq = (layout or Layout()).sequence
        self.gate_proj = Linear(hidden, ffn, bias=False)
        self.up_proj = Linear(hidden, ffn, bias=False)
        self.down_proj = Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_region(self, "region", self._forward, x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.seq.gather(x)
        return self.seq.scatter_linear(self.down_proj, F.silu(self.gate_proj(x)) * self.up_proj(x))


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> torch.Tensor:
    """Switch-style auxiliary loss over all MoE layers, as the reference defines it:
    E * sum_e (selections_e / tokens) * (mean router prob_e), with selections and
    probabilities summed over every layer's tokens before normalising."""
    tokens = sum(s.num_tokens for s in stats)
    frac_tokens_E = torch.stack([s.counts_E for s in stats]).sum(0) / tokens
    mean_prob_E = torch.stack([s.prob_sum_E for s in stats]).sum(0) / tokens
    return num_experts * (frac_tokens_E * mean_prob_E).sum()
