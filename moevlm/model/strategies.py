"""The strategies a model is built with (`Strategies`), with their single-process defaults: how the
model's work is laid out over ranks, called by the modules at fixed points.

Legend: B rows, S sequence, s this rank's share of it, D hidden, V vocabulary, N image rows.

    model = Qwen3VLMoe(cfg)                                    # one process: every default here
    model = Qwen3VLMoe(cfg, strategies=Strategies(sequence=..., ...))  # moevlm.parallel.build makes these

Fields: `sequence` (what the layers see of (B, S) tensors, gather/scatter around projections,
positions, the document mask), `attention` (core attention factory), `images`, `vocab`, `loss`,
`router_stats`, `kv_rows`, `head_share` (a Gated DeltaNet's part of its heads), `gdn_backend` (its
kernel), `dispatcher` (per MoE block) and `experts_runner` (dispatch -> experts -> combine).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from moevlm.model.attention import CoreAttention, doc_mask
from moevlm.model.dispatcher import LocalDispatcher
from moevlm.model.linear_ce import IGNORE_INDEX, VocabShard, linear_cross_entropy


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The shard of a parameter this rank computes with (differentiable); the tensor itself when whole."""
    # a DTensor exists only once its module is imported: a one-process model never imports it
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


# ------------------------------------------------------------------ strategies
class Sequence:
    """The whole sequence on this rank."""

    sharded = False

    def begin(self, cu_seqlens: torch.Tensor | None, B: int, S: int, device) -> None:
        """A micro-batch of B rows of S tokens is about to run."""

    def enter(self, t_BS: torch.Tensor | None) -> torch.Tensor | None:
        """What the layers see of a (B, S, ...) tensor."""
        return t_BS

    def add_at_mask(
        self, h: torch.Tensor, mask_BS: torch.Tensor, rows_ND: torch.Tensor
    ) -> torch.Tensor:
        """h (as the layers see it) plus `rows` at the positions where the full-sequence mask is true.
        A sharded sequence builds the addition over the full sequence and enters it, so the backward of
        `enter` hands every rank the full gradient of `rows` (the vision tower's features)."""
        if not self.sharded:
            return add_at_mask(h, mask_BS, rows_ND)
        delta_BSD = add_at_mask(h.new_zeros(*mask_BS.shape, h.shape[-1]), mask_BS, rows_ND)
        return h + self.enter(delta_BSD)

    def positions(self, position_ids_3BS: torch.Tensor) -> torch.Tensor:
        """The rotary position ids of the tokens the attention sees."""
        return position_ids_3BS

    def mask(self, B: int, S: int, cu_seqlens, **doc_mask_kwargs):
        return doc_mask(B, S, cu_seqlens, causal=True, **doc_mask_kwargs)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Before a block's column-parallel projections."""
        return x

    def scatter_linear(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A block's row-parallel output projection (bias included), back to the layers' share."""
        return linear(x)

    def gather_whole(self, x: torch.Tensor) -> torch.Tensor:
        """Before a block that reads every token in order (a Gated DeltaNet's recurrence): the whole
        sequence."""
        return self.gather(x)

    def scatter_sum(self, y: torch.Tensor) -> torch.Tensor:
        """Such a block's output over the whole sequence, partial over the ranks that split its heads
        (`Strategies.head_share`): summed, back to the layers' share."""
        return y


class Images:
    """The vision tower runs on every image of the micro-batch here."""

    def encode(
        self,
        encode_fn: Callable,
        pixel_values_NP: torch.Tensor,
        grid_thw_I3: torch.Tensor,
        merge: int,
    ):
        return encode_fn(pixel_values_NP, grid_thw_I3)


class Vocab:
    """The whole vocabulary on this rank."""

    def embed(self, ids: torch.Tensor, weight_VD: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, weight_VD)

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """h as the LM head's weight meets it (the tokens of its logits)."""
        return h

    def head(self, h: torch.Tensor, weight_VD: torch.Tensor) -> torch.Tensor:
        return F.linear(self.head_input(h), weight_VD)


class Loss(nn.Module):
    """(mean next-token cross-entropy, number of counted targets) of the logits this rank holds, or
    of the LM head over its input, chunk by chunk, without them."""

    def forward(
        self,
        x: torch.Tensor,
        labels_BS: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        weight_VD: torch.Tensor | None = None,
        chunk_tokens: int = 0,
    ):
        """`x`: the logits (B, S, V); with `weight_VD` the head's input (B, S, D) (`Vocab.head_input`),
        `chunk_tokens` at a time (moevlm.model.linear_ce)."""
        targets = self.targets(labels_BS, cu_seqlens)
        if weight_VD is None:
            return self.token_loss(x, targets)
        h_TD = x.reshape(targets.numel(), -1)
        total = linear_cross_entropy(h_TD, weight_VD, targets, chunk_tokens, self.vocab_shard())
        n = (targets != IGNORE_INDEX).sum()
        return total / n.clamp(min=1), n

    def vocab_shard(self) -> VocabShard:
        """The vocabulary rows this rank's head holds (all of them)."""
        return VocabShard()

    def targets(self, labels_BS: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        return next_token_targets(labels_BS, cu_seqlens)

    def token_loss(
        self, logits_BSV: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return token_loss(logits_BSV, targets)


class RouterStatsReduction:
    """Router statistics stay this rank's."""

    def reduce(self, stats):
        return stats


class ExpertsRunner(nn.Module):
    """dispatch -> experts -> combine, one after the other."""

    def __init__(self):
        super().__init__()
        self.dispatch = Dispatch()
        self.combine = Combine()

    def forward(self, x_TD, topk_idx_TK, topk_w_TK, dispatcher, experts):
        rows_MD, tokens_per_expert, handle = self.dispatch(dispatcher, x_TD, topk_idx_TK, topk_w_TK)
        return self.combine(dispatcher, experts(rows_MD, tokens_per_expert), handle)


class Dispatch(nn.Module):
    """`dispatcher.dispatch`; an exchanging dispatcher (a host sync, data-dependent row counts) runs
    outside a compiled graph, its rows re-entering it with a dynamic row dimension."""

    def forward(self, dispatcher, x_TD, topk_idx_TK, topk_w_TK):
        if dispatcher.exchanges:
            return _dispatch_eager(dispatcher, x_TD, topk_idx_TK, topk_w_TK)
        return dispatcher.dispatch(x_TD, topk_idx_TK, topk_w_TK)


class Combine(nn.Module):
    """`dispatcher.combine` (outside a compiled graph for an exchanging dispatcher)."""

    def forward(self, dispatcher, expert_y_MD, handle):
        if dispatcher.exchanges:
            return _combine_eager(dispatcher, expert_y_MD, handle)
        return dispatcher.combine(expert_y_MD, handle)


@torch._disable_dynamo  # torch.compiler.disable, dynamo imported at the first call, not here
def _dispatch_eager(dispatcher, x_TD, topk_idx_TK, topk_w_TK):
    rows_MD, counts, handle = dispatcher.dispatch(x_TD, topk_idx_TK, topk_w_TK)
    torch._dynamo.maybe_mark_dynamic(rows_MD, 0)
    return rows_MD, counts, handle


@torch._disable_dynamo  # torch.compiler.disable, dynamo imported at the first call, not here
def _combine_eager(dispatcher, expert_y_MD, handle):
    return dispatcher.combine(expert_y_MD, handle)


def _local_dispatcher(layer_idx: int, moe_cfg):
    return LocalDispatcher(moe_cfg.num_experts, moe_cfg.top_k, moe_cfg.permute)


@dataclass
class Strategies:
    """The strategies a model is built with (see the module docstring); defaults: one process."""

    sequence: Sequence = field(default_factory=Sequence)
    attention: Callable[[], nn.Module] = CoreAttention
    images: Images = field(default_factory=Images)
    vocab: Vocab = field(default_factory=Vocab)
    loss: Callable[[], nn.Module] = Loss
    router_stats: RouterStatsReduction = field(default_factory=RouterStatsReduction)
    kv_rows: Callable[[int, int], tuple[int, int] | None] = lambda num_kv_heads, head_dim: None
    # (i, n): a Gated DeltaNet computes the i-th of n equal parts of its heads
    head_share: tuple[int, int] = (0, 1)
    gdn_backend: str = "auto"  # the chunked delta rule's (moevlm.model.gated_deltanet.GDN_BACKENDS)
    dispatcher: Callable[[int, Any], Any] = _local_dispatcher  # (layer index, MoEConfig)
    experts_runner: Callable[[], nn.Module] = ExpertsRunner


# ------------------------------------------------------------------ shared pure functions
def true_positions(mask: torch.Tensor, n: int, fill: int = -1) -> torch.Tensor:
    """The flat positions of `mask`'s first n true entries, in order, without a device-to-host read
    (the caller knows n on the host: the merged rows the vision tower made, which the input checks
    match to the visual tokens); `fill` where the mask holds fewer."""
    return torch.nonzero_static(mask.reshape(-1), size=n, fill_value=fill).squeeze(-1)


def place_rows(
    h_BSD: torch.Tensor, where: torch.Tensor, rows_RD: torch.Tensor, add: bool = False
) -> torch.Tensor:
    """h with `rows` put (`add`: added), in order, at the positions `where` says (out of place):
    a (B, S) bool mask holding as many as `rows` has, or the R flat positions (`laid_out_positions`:
    a captured step's, where B*S marks a padding row, which lands on a spare row that is dropped)."""
    flat = h_BSD.reshape(-1, h_BSD.shape[-1])
    rows = rows_RD.to(h_BSD.dtype)
    if where.dtype == torch.bool:
        idx = true_positions(where, rows.shape[0])
        return (flat.index_add(0, idx, rows) if add else flat.index_copy(0, idx, rows)).view_as(
            h_BSD
        )
    spare = torch.cat([flat, flat.new_zeros(1, flat.shape[-1])])
    out = spare.index_add(0, where, rows) if add else spare.index_copy(0, where, rows)
    return out[:-1].view_as(h_BSD)


def laid_out_positions(mask_BS: torch.Tensor, rows: int) -> torch.Tensor:
    """The flat positions of `mask`'s true entries for `rows` rows, B*S past its count: every shape
    fixed, nothing read from the device (`place_rows`)."""
    return true_positions(mask_BS, rows, fill=mask_BS.numel())


def add_at_mask(h_BSD: torch.Tensor, where: torch.Tensor, rows_ND: torch.Tensor) -> torch.Tensor:
    """h with `rows` added, in order, at the positions `where` says (`place_rows`)."""
    return place_rows(h_BSD, where, rows_ND, add=True)


def token_loss(
    logits_BSV: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of the logits against already-shifted targets (IGNORE_INDEX not counted), and
    the number counted."""
    logits = logits_BSV.reshape(targets.numel(), -1)
    total = F.cross_entropy(
        logits.to(torch.promote_types(logits.dtype, torch.float32)),
        targets,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    n = (targets != IGNORE_INDEX).sum()
    return total / n.clamp(min=1), n


def next_token_targets(labels_BS: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """(B*S,) target of every position: the next label, IGNORE_INDEX at the last
    position of every row and of every packed document."""
    targets = F.pad(labels_BS, (0, 1), value=IGNORE_INDEX)[:, 1:].reshape(-1).clone()
    if cu_seqlens is not None:
        last_of_doc = cu_seqlens[1:].to(targets.device, torch.long, non_blocking=True) - 1
        targets.index_fill_(0, last_of_doc, IGNORE_INDEX)  # (a scalar: no host tensor to copy in)
    return targets


__all__ = [
    "IGNORE_INDEX",
    "Combine",
    "Dispatch",
    "ExpertsRunner",
    "Images",
    "Strategies",
    "Loss",
    "RouterStatsReduction",
    "Sequence",
    "Vocab",
    "add_at_mask",
    "laid_out_positions",
    "place_rows",
    "local",
    "next_token_targets",
    "token_loss",
]
