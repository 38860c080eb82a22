"""Tensor parallel with sequence parallel (Megatron style) for the text decoder: the strategies a
model is built with (`tp_strategies`) and the weight placements applied to it afterwards
(`shard_tensor_parallel`; parameter names stay those of the unsharded model).

Legend: B batch, S sequence, s = S/tp local sequence, D hidden, V vocabulary, H query heads, K kv
heads, hd head dim, tp the tensor-parallel size.

Between blocks the hidden states are (B, s, D); attention and the dense MLP all-gather the sequence,
run column- then row-parallel projections and reduce-scatter it; the embedding and the LM head are
vocab-parallel.  Weights that stay whole but see part of the work are listed in `tp_partial`, their
gradients summed over tp once per step.  Per module, and why: docs/architecture.md.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from moevlm.model.linear_ce import VocabShard
from moevlm.model.strategies import IGNORE_INDEX, Loss, Sequence, Vocab, local
from moevlm.parallel.comm import gather_seq, reduce_scatter_seq, split_seq, sum_replicated
from moevlm.parallel.vocab_parallel import group_shard, vocab_parallel_cross_entropy


def shard_param(module: nn.Module, name: str, mesh, placements) -> None:
    """Replace `module.name` (on meta or materialized) by a DTensor parameter with
    these placements; the global shape is the original one."""
    p = getattr(module, name)
    full = p.detach()
    if isinstance(full, DTensor):
        raise RuntimeError(f"{name} is already sharded")
    dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


# ---------------------------------------------------------------- strategies
class TPSequence(Sequence):
    """Layers see this rank's 1/tp of the sequence; attention and the dense MLP gather it and scatter back.
    Deepstack rows are scattered into the full sequence first, so `split_seq`'s backward hands every
    rank the full gradient of the vision tower's features."""

    sharded = True

    def __init__(self, group):
        self.group = group

    def enter(self, t_BS):
        return None if t_BS is None else split_seq(t_BS, self.group)

    def gather(self, x):
        return gather_seq(x, self.group)

    def scatter_linear(self, linear, x):
        y = reduce_scatter_seq(linear.project(x, local(linear.weight)), self.group)
        return y if linear.bias is None else y + linear.bias

    def scatter_sum(self, y):
        return reduce_scatter_seq(y, self.group)


class TPVocab(Vocab):
    """This rank's rows [vocab_start, vocab_start + V/tp) of the embedding and the LM head."""

    def __init__(self, group, vocab_start: int):
        self.group, self.vocab_start = group, vocab_start

    def embed(self, ids, weight_VD):
        w = local(weight_VD)
        rel = ids - self.vocab_start
        here = (rel >= 0) & (rel < w.shape[0])
        h = F.embedding(torch.where(here, rel, torch.zeros_like(rel)), w) * here[..., None].to(
            w.dtype
        )
        return sum_replicated(h, self.group)

    def head_input(self, h_BsD):
        """The whole sequence (B, S, D): the head's logits are over this rank's vocabulary rows."""
        return gather_seq(h_BsD, self.group)

    def head(self, h_BsD, weight_VD):
        """Logits of the whole sequence over this rank's vocabulary rows (B, S, V/tp)."""
        return F.linear(self.head_input(h_BsD), local(weight_VD))


class ParallelLoss(Loss):
    """Targets of the tokens this rank holds (`take`: context parallel's selection, or all), the
    cross-entropy over a vocabulary split over `group` (or whole when `group` is None)."""

    def __init__(self, take=None, group=None, vocab_start: int = 0):
        super().__init__()
        self.take, self.group, self.vocab_start = take, group, vocab_start

    def targets(self, labels_BS, cu_seqlens):
        targets = super().targets(labels_BS, cu_seqlens)
        return (
            targets if self.take is None else self.take(targets.view(labels_BS.shape)).reshape(-1)
        )

    def vocab_shard(self) -> VocabShard:
        return VocabShard() if self.group is None else group_shard(self.group, self.vocab_start)

    def token_loss(self, logits_BSV, targets):
        if self.group is None:
            return super().token_loss(logits_BSV, targets)
        loss_T = vocab_parallel_cross_entropy(
            logits_BSV.reshape(targets.numel(), -1),
            targets,
            self.vocab_start,
            self.group,
            IGNORE_INDEX,
        )
        n = (targets != IGNORE_INDEX).sum()
        return loss_T.sum() / n.clamp(min=1), n


class SumOverGroup:
    """Router statistics summed over the ranks sharing the sequence (cp x tp), so the aux loss is the
    micro-batch's."""

    def __init__(self, group):
        self.group = group

    def reduce(self, s):
        from moevlm.model.moe import RouterStats

        n = torch.as_tensor(s.num_tokens, dtype=torch.float32, device=s.prob_sum_E.device)
        counts_n = sum_replicated(torch.cat([s.counts_E, n[None]]), self.group)
        out = RouterStats(sum_replicated(s.prob_sum_E, self.group), counts_n[:-1], counts_n[-1])
        # the balancing options' sums (moe.z_loss_coeff, moe.aux_loss=sequence), when present
        for name in ("z_sum", "doc_prob_sum_DE", "doc_counts_DE", "doc_tokens_D"):
            if getattr(s, name) is not None:
                setattr(out, name, sum_replicated(getattr(s, name), self.group))
        return out


def kv_rows(tp: int, rank: int):
    """The `Strategies.kv_rows` of tensor parallelism: all rows of this rank's k/v shard when K >= tp; when
    K < tp the rows of the one kv head this rank's query heads use, from a replicated weight."""

    def rows(num_kv_heads: int, head_dim: int):
        if num_kv_heads >= tp:
            return None
        j = rank * num_kv_heads // tp
        return j * head_dim, (j + 1) * head_dim

    return rows


def tp_strategies(tp_mesh, vocab_size: int) -> dict:
    """The Strategies fields of tensor parallelism over `tp_mesh` (the caller composes them with context parallel)."""
    tp, r, g = tp_mesh.size(), tp_mesh.get_local_rank(), tp_mesh.get_group()
    if vocab_size % tp:
        raise ValueError(f"text.vocab_size={vocab_size} is not divisible by parallel.tp={tp}")
    start = r * vocab_size // tp
    return dict(
        sequence=TPSequence(g),
        vocab=TPVocab(g, start),
        kv_rows=kv_rows(tp, r),
        head_share=(r, tp),
        loss_group=(g, start),
    )


# ---------------------------------------------------------------- weight placements
def shard_tensor_parallel(model: nn.Module, tp_mesh) -> list[str]:
    """Place the decoder's weights for tp = tp_mesh.size() (> 1): column/row shards as DTensors.  Returns
    the names of parameters whose gradients are partial over tp (summed once per step)."""
    tp = tp_mesh.size()
    cfg = model.config
    partial: list[str] = []
    col, row = [Shard(0)], [Shard(1)]
    # None on a pipeline rank without the first stage (so is lm_head without the last)
    emb = model.text.embed_tokens
    if emb is not None:
        shard_param(emb, "weight", tp_mesh, col)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = emb.weight
    elif model.lm_head is not None:
        shard_param(model.lm_head, "weight", tp_mesh, col)
    if model.text.norm is not None:
        partial.append("text.norm.weight")
    for i, layer in model.text.layers.named_children():  # i: the layer's index in the whole decoder
        partial += _shard_layer(layer, f"text.layers.{i}.", tp_mesh, tp, col, row)
    return partial


def _shard_layer(layer, p: str, tp_mesh, tp: int, col, row) -> list[str]:
    partial = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    if layer.linear_attn is not None:
        partial += _shard_gated_deltanet(layer.linear_attn, p + "linear_attn.", tp_mesh, col, row)
    else:
        partial += _shard_attention(layer.self_attn, p + "self_attn.", tp_mesh, tp, col, row)
    dense, dp = layer.mlp, p + "mlp."
    if layer.is_moe:
        partial.append(p + "mlp.router.weight")
        dense, dp = layer.mlp.shared_expert, dp + "shared_expert."  # sharded as a dense MLP
        if dense is not None:  # its gate replicated as the router
            partial.append(p + "mlp.shared_expert_gate.weight")
    if dense is not None:
        for name, placements in (("gate_proj", col), ("up_proj", col), ("down_proj", row)):
            partial += shard_linear(getattr(dense, name), f"{dp}{name}.", tp_mesh, placements)
    return partial


def shard_linear(lin, p: str, tp_mesh, placements) -> list[str]:
    """A linear's weight column- ([Shard(0)]) or row-parallel ([Shard(1)]), and its LoRA adapter
    (model.lora_rank > 0) consistently: B's rows beside a column-parallel weight (A whole, its gradient
    tp-partial), A's columns beside a row-parallel one (B whole, tp-partial).  Returns the names of
    its tp-partial parameters (`p`: the linear's name with a trailing dot)."""
    shard_param(lin, "weight", tp_mesh, placements)
    if lin.lora is None:
        return []
    column = placements[0].dim == 0
    shard_param(lin.lora, "B" if column else "A", tp_mesh, placements)
    return [p + ("lora.A" if column else "lora.B")]


def _shard_attention(a, p: str, tp_mesh, tp: int, col, row) -> list[str]:
    """q/k/v column-parallel by heads (k/v whole, rows picked by `kv_rows`, when K < tp), o_proj
    row-parallel; returns the names of its tp-partial parameters."""
    partial = [p + "q_norm.weight", p + "k_norm.weight"]
    names = ("q_proj", "k_proj", "v_proj") if a.num_kv_heads >= tp else ("q_proj",)
    for name in names:
        proj = getattr(a, name)
        partial += shard_linear(proj, f"{p}{name}.", tp_mesh, col)
        if proj.bias is not None:
            shard_param(proj, "bias", tp_mesh, col)
    if a.num_kv_heads < tp:
        partial += [
            p + n
            for n, _ in list(a.k_proj.named_parameters(prefix="k_proj"))
            + list(a.v_proj.named_parameters(prefix="v_proj"))
        ]
    partial += shard_linear(a.o_proj, p + "o_proj.", tp_mesh, row)
    if a.o_proj.bias is not None:
        partial.append(p + "o_proj.bias")
    return partial


def _shard_gated_deltanet(g, p: str, tp_mesh, col, row) -> list[str]:
    """A Gated DeltaNet by key heads with their value heads: in_proj_qkv and the conv (rows grouped
    by key head, `gated_deltanet.qkv_order`), in_proj_z/b/a, dt_bias and A_log column-parallel,
    out_proj row-parallel; the gated norm's weight (shared by the heads) is tp-partial."""
    for proj in (g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a):
        shard_param(proj, "weight", tp_mesh, col)
    for name in ("dt_bias", "A_log"):
        shard_param(g, name, tp_mesh, col)
    shard_param(g.conv1d, "weight", tp_mesh, col)
    shard_param(g.out_proj, "weight", tp_mesh, row)
    return [p + "norm.weight"]


__all__ = [
    "ParallelLoss",
    "SumOverGroup",
    "TPSequence",
    "TPVocab",
    "kv_rows",
    "local",
    "shard_linear",
    "shard_param",
    "shard_tensor_parallel",
    "tp_strategies",
]
