"""Tensor parallel with sequence parallel (Megatron style) for the text decoder.

Legend: B batch, S sequence, s = S/tp local sequence, D hidden, V vocabulary,
H query heads, K kv heads, hd head dim, tp the tensor-parallel size.

What changes, per module (`apply_tensor_parallel` rewrites a model built on
meta; parameter names stay those of the unsharded model):

    embed_tokens     vocab-parallel: rows [r*V/tp, (r+1)*V/tp), Shard(0); the partial
                     lookups are summed over tp (`sum_replicated`), image features are
                     scattered into the full sequence, then the sequence is split
    decoder layers   hidden states are (B, s, D) between blocks (sequence parallel):
                     norms and residual adds run on 1/tp of the tokens
    self_attn        all-gather the sequence -> q/k/v column parallel (H/tp heads;
                     K/tp kv heads, or, when K < tp, the one kv head those query heads
                     use, sliced from a replicated k/v weight) -> attention -> o_proj
                     row parallel -> reduce-scatter the sequence
    dense MLP        all-gather -> gate/up column parallel -> down row parallel ->
                     reduce-scatter
    MoE block        routes its own s tokens; router statistics (aux loss, expert
                     load) are summed over tp so the aux loss is the micro-batch's
    deepstack        added through `split_seq`, so every tp rank gets the vision
                     tower's full gradient
    lm_head          all-gather the sequence -> vocab-parallel logits (B, S, V/tp) ->
                     vocab-parallel cross-entropy; full logits are never gathered

Design choices:
- Sharded weights are DTensors on the attention mesh's `tp` dimension (so FSDP2
  composes with them and DCP checkpoints reshard); the forward runs on their
  local shards with our own collectives (`comm.py`), which Megatron-style TP
  needs anyway for the varlen attention and the MoE path.
- Sequence parallel is always on when tp > 1 (Megatron requires it with MoE).
- Weights that stay whole but see only part of the work (norms on 1/tp of the
  tokens, q/k norms on H/tp heads, the router, kv weights replicated when K < tp)
  get partial gradients: they are recorded in `tp_partial` and their gradients
  summed over tp once per step (`ParallelModel.finish_gradients`).
- The vision tower is not tensor parallel: every tp rank runs it on the same
  images (FSDP2 shards its weights over all ranks; see data_parallel.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from moevlm.model.attention import DocMask
from moevlm.model.decoder import TextAttention, TextDecoder, add_at_mask
from moevlm.model.moe import DenseMLP, MoEBlock, RouterStats
from moevlm.model.rope import apply_rotary
from moevlm.model.vlm import IGNORE_INDEX, Qwen3VLMoe
from moevlm.parallel.comm import gather_seq, reduce_scatter_seq, split_seq, sum_replicated
from moevlm.parallel.vocab_parallel import vocab_parallel_cross_entropy


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The shard this rank computes with (differentiable)."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_param(module: nn.Module, name: str, mesh, placements) -> None:
    """Replace `module.name` (on meta or materialised) by a DTensor parameter with
    these placements; the global shape is the original one."""
    p = getattr(module, name)
    full = p.detach()
    if isinstance(full, DTensor):
        raise RuntimeError(f"{name} is already sharded")
    from torch.distributed.tensor import distribute_tensor

    dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


# ---------------------------------------------------------------- modules
class TPTextAttention(TextAttention):
    tp_group = None
    tp_size, tp_rank = 1, 0

    def _kv_weight(self, proj: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.num_kv_heads >= self.tp_size:
            return local(proj.weight), local(proj.bias)
        j, hd = self.tp_rank * self.num_kv_heads // self.tp_size, self.head_dim
        bias = None if proj.bias is None else proj.bias[j * hd:(j + 1) * hd]
        return proj.weight[j * hd:(j + 1) * hd], bias

    def forward(self, x_BsD, rope_cos_sin, mask: DocMask):
        x_BSD = gather_seq(x_BsD, self.tp_group)
        B, S, _ = x_BSD.shape
        q = self.q_proj.project(x_BSD, local(self.q_proj.weight), local(self.q_proj.bias))
        k = self.k_proj.project(x_BSD, *self._kv_weight(self.k_proj))
        v = self.v_proj.project(x_BSD, *self._kv_weight(self.v_proj))
        q = self.q_norm(q.view(B, S, -1, self.head_dim))
        k = self.k_norm(k.view(B, S, -1, self.head_dim))
        v = v.view(B, S, -1, self.head_dim)
        cos, sin = (t[:, :, None, :] for t in rope_cos_sin)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core_attention(q, k, v, mask).reshape(B, S, -1)
        y = reduce_scatter_seq(self.o_proj.project(out, local(self.o_proj.weight)), self.tp_group)
        return y if self.o_proj.bias is None else y + self.o_proj.bias


class TPDenseMLP(DenseMLP):
    tp_group = None

    def forward(self, x_BsD):
        x = gather_seq(x_BsD, self.tp_group)
        h = F.silu(self.gate_proj.project(x, local(self.gate_proj.weight))) * self.up_proj.project(
            x, local(self.up_proj.weight))
        return reduce_scatter_seq(self.down_proj.project(h, local(self.down_proj.weight)), self.tp_group)


class SPMoEBlock(MoEBlock):
    """Routes this rank's tokens; router statistics summed over the sequence group."""
    seq_group = None

    def _stats(self, topk_idx_TK, probs_TE, token_mask_BS) -> RouterStats:
        s = super()._stats(topk_idx_TK, probs_TE, token_mask_BS)
        n = torch.as_tensor(s.num_tokens, dtype=torch.float32, device=probs_TE.device)
        counts_n = sum_replicated(torch.cat([s.counts_E, n[None]]), self.seq_group)
        return RouterStats(sum_replicated(s.prob_sum_E, self.seq_group), counts_n[:-1], counts_n[-1])


class VocabParallelEmbedding(nn.Embedding):
    tp_group = None
    vocab_start = 0

    def forward(self, ids):
        w = local(self.weight)
        rel = ids - self.vocab_start
        here = (rel >= 0) & (rel < w.shape[0])
        h = F.embedding(torch.where(here, rel, torch.zeros_like(rel)), w) * here[..., None].to(w.dtype)
        return sum_replicated(h, self.tp_group)


class VocabParallelHead(nn.Linear):
    tp_group = None

    def forward(self, h_BsD):
        return F.linear(gather_seq(h_BsD, self.tp_group), local(self.weight))


class SPTextDecoder(TextDecoder):
    """Layers see this rank's 1/tp of the sequence; deepstack rows are scattered into
    the full sequence first, so `split_seq`'s backward hands every rank the full
    gradient of the vision tower's features."""
    tp_group = None

    def to_layers(self, t_BS):
        return None if t_BS is None else split_seq(t_BS, self.tp_group)

    def add_deepstack(self, h_BsD, mask_BS, rows_ND):
        delta_BSD = add_at_mask(h_BsD.new_zeros(*mask_BS.shape, h_BsD.shape[-1]), mask_BS, rows_ND)
        return h_BsD + split_seq(delta_BSD, self.tp_group)


class TPQwen3VLMoe(Qwen3VLMoe):
    """Logits come out sharded along the vocabulary (B, S, V/tp)."""
    tp_group = None
    vocab_start = 0

    def loss_from_targets(self, logits_BSV, targets):
        loss_T = vocab_parallel_cross_entropy(logits_BSV.reshape(targets.numel(), -1), targets, self.vocab_start,
                                              self.tp_group, IGNORE_INDEX)
        n = (targets != IGNORE_INDEX).sum()
        return loss_T.sum() / n.clamp(min=1), n


# ---------------------------------------------------------------- rewrite
def _swap(module: nn.Module, cls: type, **attrs) -> None:
    module.__class__ = cls
    for k, v in attrs.items():
        setattr(module, k, v)


def apply_tensor_parallel(model: Qwen3VLMoe, tp_mesh) -> list[str]:
    """Rewrite the decoder for tp = tp_mesh.size() (> 1).  Returns the names of
    parameters whose gradients are partial over tp (summed once per step)."""
    tp, r, g = tp_mesh.size(), tp_mesh.get_local_rank(), tp_mesh.get_group()
    cfg = model.config
    V = cfg.text.vocab_size
    if V % tp:
        raise ValueError(f"text.vocab_size={V} is not divisible by parallel.tp={tp}")
    partial: list[str] = []
    col, row = [Shard(0)], [Shard(1)]

    emb = model.text.embed_tokens  # None on a pipeline rank without the first stage (so is lm_head without the last)
    if emb is not None:
        shard_param(emb, "weight", tp_mesh, col)
        _swap(emb, VocabParallelEmbedding, tp_group=g, vocab_start=r * V // tp)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = emb.weight
    elif model.lm_head is not None:
        shard_param(model.lm_head, "weight", tp_mesh, col)
    if model.lm_head is not None:
        _swap(model.lm_head, VocabParallelHead, tp_group=g)
    _swap(model, TPQwen3VLMoe, tp_group=g, vocab_start=r * V // tp)
    _swap(model.text, SPTextDecoder, tp_group=g)
    if model.text.norm is not None:
        partial.append("text.norm.weight")

    for i, layer in model.text.layers.named_children():  # i: the layer's index in the whole decoder
        p = f"text.layers.{i}."
        partial += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                    p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        a = layer.self_attn
        for proj in (a.q_proj, a.k_proj, a.v_proj) if a.num_kv_heads >= tp else (a.q_proj,):
            shard_param(proj, "weight", tp_mesh, col)
            if proj.bias is not None:
                shard_param(proj, "bias", tp_mesh, col)
        if a.num_kv_heads < tp:
            partial += [p + f"self_attn.{n}" for n, _ in list(a.k_proj.named_parameters(prefix="k_proj"))
                        + list(a.v_proj.named_parameters(prefix="v_proj"))]
        shard_param(a.o_proj, "weight", tp_mesh, row)
        if a.o_proj.bias is not None:
            partial.append(p + "self_attn.o_proj.bias")
        _swap(a, TPTextAttention, tp_group=g, tp_size=tp, tp_rank=r)
        if layer.is_moe:
            _swap(layer.mlp, SPMoEBlock, seq_group=g)
            partial.append(p + "mlp.router.weight")
        else:
            m = layer.mlp
            shard_param(m.gate_proj, "weight", tp_mesh, col)
            shard_param(m.up_proj, "weight", tp_mesh, col)
            shard_param(m.down_proj, "weight", tp_mesh, row)
            _swap(m, TPDenseMLP, tp_group=g)
    return partial


__all__ = ["apply_tensor_parallel", "local", "shard_param"]
