"""The MoE text decoder: embedding, GQA attention with q/k RMSNorm and interleaved M-RoPE, MoE or
dense MLP, final norm, LM head.

Legend: B batch, S sequence, D hidden, H query heads, K kv heads, hd head dim.

    decoder = TextDecoder(cfg, strategies)                   # moevlm.model.strategies.Strategies
    h_BSD, router_stats = decoder(h_BSD, position_ids_3BS, cu_seqlens, visual_mask_BS, deepstack)

Module and parameter names follow the Hugging Face reference (`self_attn.q_proj`, ...) except
the router, `mlp.router`.  Regions a build step may wrap: each layer (`region`), its attention
branch (`attn_region`), each RMSNorm (`region`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from moevlm.model.attention import DocMask
from moevlm.model.config import VLMConfig
from moevlm.model.gated_deltanet import GatedDeltaNet
from moevlm.model.linear import Linear
from moevlm.model.moe import DenseMLP, MoEBlock, RouterStats, TokenInfo
from moevlm.model.region import run_region
from moevlm.model.rope import apply_rotary, mrope
from moevlm.model.strategies import Strategies, Vocab, add_at_mask


class LayerInputs(NamedTuple):
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin
    mask: DocMask
    token_mask: torch.Tensor | None  # as the layers see it (to_layers)
    # moe.aux_loss=sequence / moe.router_force_balance: documents and positions of the tokens
    tokens: TokenInfo | None = None


class RMSNorm(nn.Module):
    """RMSNorm scaled by `weight`; `zero_centered` (Qwen3.5's): scaled by 1 + weight, the weight
    stored (and initialised, and decayed) around 0, the product taken in fp32 and cast after."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_region(self, "region", self._forward, x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:
            x32 = x.float()
            n32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (n32 * (1.0 + self.weight.float())).to(x.dtype)
        return RMSNormFn.apply(x, self.weight, self.eps)


class RMSNormFn(torch.autograd.Function):
    """w * (x32 rsqrt(mean(x32^2) + eps)).to(x.dtype), x32 = x in fp32: autograd's values and
    gradients, op for op, keeping for backward x, the per-row rsqrt and w instead of the fp32 copy
    of x and the normalized rows (3x x's bytes in bf16); the cheap part is recomputed."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        x32 = x.float()
        n = (x32 * rstd).to(x.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:  # summed over the broadcast dims, then cast, as autograd does
            grad_w = (grad * n).sum(tuple(range(grad.dim() - 1)), keepdim=True)
            grad_w = grad_w.view(weight.shape).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            grad_n32 = (grad * weight).to(n.dtype).float()
            grad_rstd = (grad_n32 * x32).sum(-1, keepdim=True)
            grad_ms = grad_rstd * -0.5 * rstd.pow(3)  # rsqrt's derivative
            grad_sq = grad_ms.expand(x32.shape) / x32.shape[-1]  # mean's
            grad_x = (grad_n32 * rstd + grad_sq * (2.0 * x32)).to(
                x.dtype
            )  # pow's, and the product's
        return grad_x, grad_w, None


class TextAttention(nn.Module):
    """The sequence gathered before q/k/v (column parallel under tensor parallelism: this rank's heads),
    the core attention, o_proj scattering the sequence back (row parallel)."""

    def __init__(self, cfg: VLMConfig, strategies: Strategies | None = None):
        super().__init__()
        strategies = strategies or Strategies()
        t = cfg.text
        self.num_heads, self.num_kv_heads, self.head_dim = t.num_heads, t.num_kv_heads, t.head_dim
        self.seq, self.kv_rows = strategies.sequence, strategies.kv_rows(t.num_kv_heads, t.head_dim)
        self.gated = t.attn_output_gate  # q_proj's rows: each head's query, then its output gate
        q_rows = t.num_heads * t.head_dim * (2 if self.gated else 1)
        self.q_proj = Linear(t.hidden_size, q_rows, bias=t.attention_bias)
        self.k_proj = Linear(t.hidden_size, t.num_kv_heads * t.head_dim, bias=t.attention_bias)
        self.v_proj = Linear(t.hidden_size, t.num_kv_heads * t.head_dim, bias=t.attention_bias)
        self.o_proj = Linear(t.num_heads * t.head_dim, t.hidden_size, bias=t.attention_bias)
        self.q_norm = RMSNorm(t.head_dim, t.rms_norm_eps, t.norm_zero_centered)
        self.k_norm = RMSNorm(t.head_dim, t.rms_norm_eps, t.norm_zero_centered)
        self.core = strategies.attention()

    def forward(self, x_BsD, rope_cos_sin, mask: DocMask):
        x_BSD = self.seq.gather(x_BsD)
        B, S, _ = x_BSD.shape
        q = self.q_proj(x_BSD).view(B, S, -1, self.head_dim * (2 if self.gated else 1))
        gate_BSHd = None
        if self.gated:
            q, gate_BSHd = q.chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self._kv(self.k_proj, x_BSD).view(B, S, -1, self.head_dim))
        v = self._kv(self.v_proj, x_BSD).view(B, S, -1, self.head_dim)
        cos, sin = (t[:, :, None, :] for t in rope_cos_sin)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q, k, v, mask)
        if gate_BSHd is not None:
            out = out * torch.sigmoid(gate_BSHd)
        return self.seq.scatter_linear(self.o_proj, out.reshape(B, S, -1))

    def _kv(self, proj: Linear, x_BSD: torch.Tensor) -> torch.Tensor:
        """k or v of the heads this rank computes: all of the weight's rows, or `kv_rows` of them."""
        if self.kv_rows is None:
            return proj(x_BSD)
        a, b = self.kv_rows
        return proj.project(x_BSD, proj.weight[a:b], None if proj.bias is None else proj.bias[a:b])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: VLMConfig, layer_idx: int, strategies: Strategies | None = None):
        super().__init__()
        t = cfg.text
        self.input_layernorm = RMSNorm(t.hidden_size, t.rms_norm_eps, t.norm_zero_centered)
        self.self_attn = self.linear_attn = None  # the token mixer: one of them, by layer type
        if t.is_linear_layer(layer_idx):
            s = strategies or Strategies()
            self.linear_attn = GatedDeltaNet(
                t.hidden_size,
                t.linear_num_key_heads,
                t.linear_num_value_heads,
                t.linear_key_head_dim,
                t.linear_value_head_dim,
                t.linear_conv_kernel_dim,
                t.rms_norm_eps,
                backend=s.gdn_backend,
                sequence=s.sequence,
                share=s.head_share,
            )
        else:
            self.self_attn = TextAttention(cfg, strategies)
        self.post_attention_layernorm = RMSNorm(t.hidden_size, t.rms_norm_eps, t.norm_zero_centered)
        self.is_moe = cfg.moe.is_moe_layer(layer_idx)
        self.mlp = (
            MoEBlock(t.hidden_size, cfg.moe, layer_idx, strategies)
            if self.is_moe
            else DenseMLP(t.hidden_size, t.intermediate_size, strategies)
        )

    def forward(
        self, h_BSD, rope_cos_sin, mask: DocMask, token_mask_BS: torch.Tensor | None = None, *docs
    ) -> tuple[torch.Tensor, RouterStats | None]:
        """`docs`: nothing, or LayerInputs.tokens (moe.aux_loss=sequence, moe.router_force_balance)."""
        return run_region(
            self, "region", self._forward, h_BSD, rope_cos_sin, mask, token_mask_BS, *docs
        )

    def _forward(self, h_BSD, rope_cos_sin, mask, token_mask_BS, docs=None):
        h_BSD = h_BSD + self.attention_part(h_BSD, rope_cos_sin, mask)
        if self.is_moe:
            out, stats = self.mlp(self.post_attention_layernorm(h_BSD), token_mask_BS, docs)
            return h_BSD + out, stats
        return h_BSD + self.mlp(self.post_attention_layernorm(h_BSD)), None

    def attention_part(self, h_BSD, rope_cos_sin, mask: DocMask) -> torch.Tensor:
        """The attention branch before the residual add (region `attn_region`)."""
        return run_region(self, "attn_region", self._attention_part, h_BSD, rope_cos_sin, mask)

    def _attention_part(self, h_BSD, rope_cos_sin, mask):
        x_BSD = self.input_layernorm(h_BSD)
        if self.linear_attn is not None:  # the documents the attention mask was made from
            return self.linear_attn(x_BSD, mask.cu_seqlens)
        return self.self_attn(x_BSD, rope_cos_sin, mask)


class Embedding(nn.Embedding):
    """Token embedding through the vocabulary strategy (whole, or this rank's rows)."""

    def __init__(self, num: int, dim: int, vocab: Vocab | None = None):
        super().__init__(num, dim)
        self.vocab = vocab or Vocab()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.vocab.embed(ids, self.weight)


class TextDecoder(nn.Module):
    static_mask = False  # fixed-size mask tensors only (set by moevlm.parallel.compile)

    def __init__(self, cfg: VLMConfig, strategies: Strategies | None = None):
        super().__init__()
        strategies = strategies or Strategies()
        t = cfg.text
        self.cfg, self.attn_backend = t, cfg.attn_backend
        self.sequence_loss = cfg.moe.num_experts > 0 and cfg.moe.aux_loss == "sequence"
        self.force_balance = cfg.moe.num_experts > 0 and cfg.moe.router_force_balance
        self.seq, self.router_stats = strategies.sequence, strategies.router_stats
        self.embed_tokens = Embedding(t.vocab_size, t.hidden_size, strategies.vocab)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, strategies) for i in range(t.num_layers))
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps, t.norm_zero_centered)

    def forward(
        self,
        h_BSD: torch.Tensor,
        position_ids_3BS: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        visual_mask_BS: torch.Tensor | None = None,
        deepstack: list[torch.Tensor] = (),
        token_mask_BS: torch.Tensor | None = None,
    ):
        ctx = self.layer_inputs(position_ids_3BS, cu_seqlens, token_mask_BS, h_BSD.dtype)
        h, stats = self.run_layers(
            self.seq.enter(h_BSD), ctx, visual_mask_BS, dict(enumerate(deepstack))
        )
        return self.norm(h), stats

    def layer_inputs(
        self,
        position_ids_3BS: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        token_mask_BS: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> LayerInputs:
        """What every layer shares: rotary cos/sin, the document mask, the token mask."""
        t = self.cfg
        _, B, S = position_ids_3BS.shape
        rope = mrope(
            self.seq.positions(position_ids_3BS),
            t.rotary_dim,
            t.rope_theta,
            t.mrope_section,
            t.mrope_interleaved,
            dtype,
        )
        mask = self.seq.mask(
            B,
            S,
            cu_seqlens,
            backend=self.attn_backend,
            device=position_ids_3BS.device,
            dtype=dtype,
            static=self.static_mask,
        )
        tokens = None
        if self.sequence_loss or self.force_balance:
            device = position_ids_3BS.device
            tokens = TokenInfo()
            if self.sequence_loss:
                doc_BS, num_docs = document_index(cu_seqlens, B, S, device)
                tokens = tokens._replace(doc_BS=self.seq.enter(doc_BS), num_docs=num_docs)
            if self.force_balance:
                pos_BS = torch.arange(S, device=device).expand(B, S)
                tokens = tokens._replace(pos_BS=self.seq.enter(pos_BS))
        return LayerInputs(rope, mask, self.seq.enter(token_mask_BS), tokens)

    def run_layers(
        self,
        h,
        ctx: LayerInputs,
        visual_mask_BS: torch.Tensor | None,
        deepstack: dict[int, torch.Tensor],
        layers: nn.Module | None = None,
    ) -> tuple[torch.Tensor, list[RouterStats]]:
        """The layers of `layers` (default: all of `self.layers`) in order, each named by its index in
        the whole decoder (a pipeline stage holds some of them); deepstack rows `deepstack[i]` are
        added after layer i.  Router statistics are reduced over the ranks sharing the sequence."""
        stats: list[RouterStats] = []
        for name, layer in (self.layers if layers is None else layers).named_children():
            docs = () if ctx.tokens is None else (ctx.tokens,)
            h, s = layer(h, ctx.rope, ctx.mask, ctx.token_mask, *docs)
            if s is not None:
                stats.append(self.router_stats.reduce(s))
            if int(name) in deepstack:
                h = self.seq.add_at_mask(h, visual_mask_BS, deepstack[int(name)])
        return h, stats


def document_index(cu_seqlens: torch.Tensor | None, B: int, S: int, device) -> tuple:
    """(the document of each token (B, S), number of documents): the segments of `cu_seqlens` over
    the flattened B*S tokens (padding is a segment too; its tokens are masked), or one per row."""
    if cu_seqlens is None:
        return torch.arange(B, device=device)[:, None].expand(B, S), B
    cu = cu_seqlens.to(device=device, dtype=torch.long, non_blocking=True)
    doc = torch.searchsorted(cu[1:], torch.arange(B * S, device=device), right=True)
    return doc.clamp(max=cu.numel() - 2).view(B, S), cu.numel() - 1


class Head(nn.Linear):
    """The LM head through the vocabulary strategy (whole, or this rank's vocabulary rows)."""

    def __init__(self, hidden: int, vocab_size: int, vocab: Vocab | None = None):
        super().__init__(hidden, vocab_size, bias=False)
        self.vocab = vocab or Vocab()

    def forward(self, h: torch.Tensor, as_input: bool = False) -> torch.Tensor:
        """The logits of h; with `as_input`, h as the weight meets it (a chunked loss takes both)."""
        if as_input:
            return self.vocab.head_input(h)
        return self.vocab.head(h, self.weight)


__all__ = [
    "DecoderLayer",
    "Embedding",
    "Head",
    "LayerInputs",
    "RMSNorm",
    "TextAttention",
    "TextDecoder",
    "add_at_mask",
]
