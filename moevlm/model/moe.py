"""The MoE MLP: fp32 top-k router, dispatcher, grouped-GEMM SwiGLU experts; and the dense MLP.

Legend: T tokens, D hidden, E experts, K top-k, F expert hidden, M dispatched rows.

    block = MoEBlock(D, cfg.moe, layer_idx, strategies)  # dispatcher and experts runner from them
    y_BSD, stats = block(x_BSD, token_mask_BS, tokens)   # stats: RouterStats (sums) of its tokens
    aux = load_balancing_loss(stats_list, E)             # or sequence_ / global_balance_loss

Expert weights: `gate_up_proj` (E, D, 2F), gate columns first, and `down_proj` (E, F, D); their
LoRA updates (`experts.lora`, moevlm.model.lora) run through the same grouped GEMM. Regions a build
step may wrap: the whole block (`region`) and the SwiGLU between the grouped GEMMs (`act_region`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from moevlm.model.config import MoEConfig
from moevlm.model.fp8 import Fp8Recipe, expert_mm
from moevlm.model.linear import Linear, is_adapter
from moevlm.model.region import run_region
from moevlm.model.strategies import Strategies, local

BIAS_BUFFER = "router.expert_bias"


@dataclass
class RouterStats:
    prob_sum_E: torch.Tensor  # sum over tokens of the full softmax, fp32
    counts_E: torch.Tensor  # top-k selections per expert, fp32
    num_tokens: int | torch.Tensor  # a tensor when masked (no host sync)
    # moe.z_loss_coeff > 0: sum over tokens of logsumexp(logits)^2
    z_sum: torch.Tensor | None = None
    # moe.aux_loss=sequence: the same sums per document (Ds documents of the micro-batch)
    doc_prob_sum_DE: torch.Tensor | None = None
    doc_counts_DE: torch.Tensor | None = None
    doc_tokens_D: torch.Tensor | None = None


def is_training_state(name: str) -> bool:
    """A state-dict entry that is training state (the router bias) or a LoRA adapter
    (moevlm.model.lora), not a weight of the network: kept out of Hugging Face import and export."""
    return name.endswith(BIAS_BUFFER) or is_adapter(name)


class Router(nn.Module):
    def __init__(
        self, hidden: int, num_experts: int, top_k: int, bias: bool = False, force_balance=False
    ):
        super().__init__()
        self.top_k, self.force_balance = top_k, force_balance
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        if bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x_TD: torch.Tensor, pos_T: torch.Tensor | None = None):
        """(top-k experts, their combine weights, full softmax, logits) of every token.  `pos_T`:
        each token's position in its whole sequence, which forced-balanced routing routes by (so a
        sharded sequence routes as one process does); None: the tokens' order here."""
        return run_region(self, "region", self._forward, x_TD, pos_T)

    def _forward(self, x_TD: torch.Tensor, pos_T: torch.Tensor | None = None):
        dtype = torch.promote_types(x_TD.dtype, torch.float32)  # fp32, or fp64 in float64 tests
        # autocast would run this linear in bf16
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = F.linear(x_TD.to(dtype), self.weight.to(dtype))
        probs_TE = logits_TE.softmax(dim=-1)
        if self.force_balance:
            if pos_T is None:
                pos_T = torch.arange(probs_TE.shape[0], device=probs_TE.device)
            topk_idx_TK = balanced_choice(pos_T, probs_TE.shape[1], self.top_k)
            topk_w_TK = probs_TE.gather(1, topk_idx_TK)
        elif hasattr(self, "expert_bias"):
            topk_idx_TK = (probs_TE + self.expert_bias).topk(self.top_k, dim=-1).indices
            topk_w_TK = probs_TE.gather(1, topk_idx_TK)
        else:
            topk_w_TK, topk_idx_TK = probs_TE.topk(self.top_k, dim=-1)
        topk_w_TK = topk_w_TK / topk_w_TK.sum(dim=-1, keepdim=True)
        return topk_idx_TK, topk_w_TK, probs_TE, logits_TE


def balanced_choice(pos_T: torch.Tensor, E: int, K: int) -> torch.Tensor:
    """(T, K) experts of the forced-balanced routing: the token at position p of its sequence
    takes (p K + j) mod E, j < K (every expert gets the same share of a sequence whose length
    times K is a multiple of E)."""
    return (pos_T.to(torch.long)[:, None] * K + torch.arange(K, device=pos_T.device)) % E


class TokenInfo(NamedTuple):
    """What an MoE block may need to know of its tokens beyond their rows, each (B, S) as the layers
    see the sequence: the document of each token and the number of documents (moe.aux_loss=
    sequence), the position of each token in its whole sequence (moe.router_force_balance)."""

    doc_BS: torch.Tensor | None = None
    num_docs: int = 0
    pos_BS: torch.Tensor | None = None


class Experts(nn.Module):
    fp8: Fp8Recipe | None = None  # set by moevlm.model.fp8_targets.apply_fp8
    compile_eager_gemm = (
        False  # the grouped GEMMs stay out of a compiled graph (moevlm.parallel.compile)
    )

    def __init__(self, num_experts: int, hidden: int, ffn: int, grouped_gemm: str):
        super().__init__()
        self.grouped_gemm = grouped_gemm
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * ffn))
        self.down_proj = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.lora = None  # a moevlm.model.lora.ExpertLora when the model's config asks for one

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
        if self.lora is not None:
            h_MF2 = h_MF2 + self.lora.update("gate_up", x_MD, counts_E, self.grouped_gemm)
        h_MF = run_region(self, "act_region", swiglu, h_MF2)
        y_MD = expert_mm(h_MF, down_EFD, counts_E, self.grouped_gemm, self.fp8, (self, "down"))
        if self.lora is not None:
            y_MD = y_MD + self.lora.update("down", h_MF, counts_E, self.grouped_gemm)
        return y_MD


@torch._disable_dynamo  # torch.compiler.disable, dynamo imported at the first call, not here
def _eager_mlp(experts: Experts, x_MD, counts_E):
    return experts.mlp(x_MD, counts_E)


def swiglu(h_MF2: torch.Tensor) -> torch.Tensor:
    """SwiGLU between the two grouped GEMMs (gate columns first)."""
    gate_MF, up_MF = h_MF2.chunk(2, dim=-1)
    return F.silu(gate_MF) * up_MF


class MoEBlock(nn.Module):
    def __init__(
        self, hidden: int, cfg: MoEConfig, layer_idx: int = 0, strategies: Strategies | None = None
    ):
        super().__init__()
        strategies = strategies or Strategies()
        self.num_experts, self.z_loss = cfg.num_experts, cfg.z_loss_coeff > 0
        self.router = Router(
            hidden, cfg.num_experts, cfg.top_k, cfg.router_bias_rate > 0, cfg.router_force_balance
        )
        self.experts = Experts(cfg.num_experts, hidden, cfg.moe_intermediate_size, cfg.grouped_gemm)
        self.dispatcher = strategies.dispatcher(layer_idx, cfg)
        self.runner = strategies.experts_runner()
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:  # every token, beside the routed experts
            self.shared_expert = DenseMLP(hidden, cfg.shared_expert_intermediate_size, strategies)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def forward(
        self,
        x_BSD: torch.Tensor,
        token_mask_BS: torch.Tensor | None = None,
        tokens: TokenInfo | None = None,
    ) -> tuple[torch.Tensor, RouterStats]:
        """`token_mask_BS` (True = real token) keeps padding out of the router
        statistics (aux loss, expert load); padding is still routed and computed.
        `tokens`: documents (moe.aux_loss=sequence: per-document sums join the statistics)
        and positions (moe.router_force_balance) of the tokens."""
        return run_region(self, "region", self._forward, x_BSD, token_mask_BS, tokens)

    def _forward(self, x_BSD, token_mask_BS, tokens=None):
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        pos_T = None if tokens is None or tokens.pos_BS is None else tokens.pos_BS.reshape(-1)
        topk_idx_TK, topk_w_TK, probs_TE, logits_TE = self.router(x_TD, pos_T)
        y_TD = self.runner(x_TD, topk_idx_TK, topk_w_TK, self.dispatcher, self.experts)
        stats = self.stats(topk_idx_TK, probs_TE, token_mask_BS)
        docs = None if tokens is None or tokens.doc_BS is None else tokens
        if self.z_loss or docs is not None:
            keep_T = (
                torch.ones_like(probs_TE[:, 0])
                if token_mask_BS is None
                else token_mask_BS.reshape(-1).to(probs_TE)
            )
            if self.z_loss:
                stats.z_sum = (logits_TE.logsumexp(-1).square() * keep_T).sum()
            if docs is not None:
                add_doc_stats(stats, topk_idx_TK, probs_TE, keep_T, docs.doc_BS, docs.num_docs)
        y_BSD = y_TD.view_as(x_BSD)
        if self.shared_expert is not None:
            y_BSD = y_BSD + torch.sigmoid(self.shared_expert_gate(x_BSD)) * self.shared_expert(
                x_BSD
            )
        return y_BSD, stats

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

    def __init__(self, hidden: int, ffn: int, strategies: Strategies | None = None):
        super().__init__()
        self.seq = (strategies or Strategies()).sequence
        self.gate_proj = Linear(hidden, ffn, bias=False)
        self.up_proj = Linear(hidden, ffn, bias=False)
        self.down_proj = Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_region(self, "region", self._forward, x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.seq.gather(x)
        return self.seq.scatter_linear(self.down_proj, F.silu(self.gate_proj(x)) * self.up_proj(x))


def add_doc_stats(stats: RouterStats, topk_idx_TK, probs_TE, keep_T, doc_BS, num_docs: int):
    """The per-document sums of the sequence-wise loss (fixed (num_docs, E) shapes)."""
    doc_T = doc_BS.reshape(-1).to(probs_TE.device)
    T, E = probs_TE.shape
    stats.doc_prob_sum_DE = probs_TE.new_zeros(num_docs, E).index_add(
        0, doc_T, probs_TE * keep_T[:, None]
    )
    counts_DE = probs_TE.new_zeros(num_docs * E)
    flat_N = (doc_T[:, None] * E + topk_idx_TK).reshape(-1)
    counts_DE.index_add_(0, flat_N, keep_T[:, None].expand_as(topk_idx_TK).reshape(-1))
    stats.doc_counts_DE = counts_DE.view(num_docs, E).detach()
    stats.doc_tokens_D = probs_TE.new_zeros(num_docs).index_add(0, doc_T, keep_T).detach()


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> torch.Tensor:
    """Switch-style auxiliary loss over all MoE layers, as the reference defines it:
    E * sum_e (selections_e / tokens) * (mean router prob_e), with selections and
    probabilities summed over every layer's tokens before normalizing."""
    tokens = sum(s.num_tokens for s in stats)
    frac_tokens_E = torch.stack([s.counts_E for s in stats]).sum(0) / tokens
    mean_prob_E = torch.stack([s.prob_sum_E for s in stats]).sum(0) / tokens
    return num_experts * (frac_tokens_E * mean_prob_E).sum()


def sequence_balance_loss(s: RouterStats, num_experts: int) -> torch.Tensor:
    """One layer's sequence-wise loss (DeepSeek-V3's, in the reference's scale): the mean over the
    micro-batch's documents d (those with a real token) of E * sum_e (selections_de / n_d) *
    (prob_sum_de / n_d), n_d the document's real tokens.  A document is one packed sample (a
    segment of `cu_seqlens`; a whole row without packing).  DeepSeek-V3 divides by K as well: its
    coefficient is ours times K."""
    n_D1 = s.doc_tokens_D.clamp(min=1)[:, None]
    per_doc_D = num_experts * ((s.doc_counts_DE / n_D1) * (s.doc_prob_sum_DE / n_D1)).sum(-1)
    used_D = (s.doc_tokens_D > 0).to(per_doc_D)
    return (per_doc_D * used_D).sum() / used_D.sum().clamp(min=1)


def global_balance_loss(
    prob_sum_E: torch.Tensor, tokens, freq_E: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """The global-batch loss of one micro-batch: E * sum_e freq_e * (prob_sum_e / tokens), the
    micro-batch's mean router probabilities (summed over layers, as `load_balancing_loss`) weighted
    by expert frequencies `freq_E` (selections over tokens) that the caller forms over more than
    this micro-batch (moevlm.parallel.balance.StepFrequencies).  With `freq_E` of this micro-batch
    alone it is `load_balancing_loss`, bit for bit."""
    return num_experts * (freq_E * (prob_sum_E / tokens)).sum()


def layer_extras(stats: list[RouterStats], num_experts: int) -> tuple:
    """(sum over `stats`' layers of the per-layer sequence-wise loss, of the per-layer mean over
    tokens of logsumexp^2); None where the statistics do not carry it."""
    seq = z = None
    for s in stats:
        if s.doc_tokens_D is not None:
            part = sequence_balance_loss(s, num_experts)
            seq = part if seq is None else seq + part
        if s.z_sum is not None:
            part = s.z_sum / s.num_tokens
            z = part if z is None else z + part
    return seq, z


def update_router_bias_(routers: list[Router], load_LE: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing after an optimizer step (DeepSeek-V3): each MoE layer's bias moves by
    `rate` towards balance, bias_e += rate * sign(mean_e(load) - load_e), `load_LE` the step's
    selections per layer (all micro-batches, all data-parallel ranks), one row per router in order."""
    assert len(routers) == load_LE.shape[0], (len(routers), tuple(load_LE.shape))
    load_LE = load_LE.to(torch.float32)
    step_LE = rate * torch.sign(load_LE.mean(-1, keepdim=True) - load_LE)
    for router, step_E in zip(routers, step_LE):
        router.expert_bias.add_(step_E.to(router.expert_bias.device))
