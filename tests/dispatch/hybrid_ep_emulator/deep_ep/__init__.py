"""TEST EMULATOR, not HybridEP: the documented semantics of `deep_ep.HybridEPBuffer` (DeepEP's hybrid-ep
branch: `dispatch_with_permute` / `combine_with_unpermute`) over torch.distributed (gloo on the CPU), for
moevlm's adapter tests.  See ../README.md.

Legend: T tokens on every rank (HybridEP gathers the routing maps with one all-gather, so every rank of the
group dispatches the same T), D hidden, E experts, P ranks, L = E / P local experts (rank r owns experts
[r*L, (r+1)*L)), G = P*T tokens of the group (rank-major), M permuted rows on this rank.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__version__ = "emulator"
EMULATOR = True  # lets a test tell this double from a real build
MULTINODE = False  # built without HYBRID_EP_MULTINODE=1: a group past one NVLink domain is refused
TOKENS_PER_CHUNK = 128  # the emulator's tokens per chunk of the dispatch kernel
BUILT = [0]  # buffers constructed (tests read it: HybridEP grows its buffer itself)


def _nvlink_domain(group_size: int) -> int:
    """Ranks per NVLink domain: NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN, else detected (here: the whole group,
    one domain).  The old NVLINK_DOMAIN_SIZE is not read."""
    value = os.environ.get("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", "")
    return int(value) if value else group_size


class HybridEPBuffer:
    def __init__(
        self,
        group,
        hidden_dim: int,
        max_num_of_tokens_per_rank: int,
        num_local_experts: int,
        use_fp8: bool = False,
        num_sms_dispatch_api=None,
        num_sms_combine_api=None,
        num_sms_preprocessing_api=None,
        nvlink_domain_size=None,
        load_cached_kernels: bool = False,
        use_shared_buffer: bool = True,
        enable_custom_allgather: bool = False,
        **unused,
    ):
        if use_fp8:
            raise NotImplementedError("hybrid_ep emulator: fp8 dispatch is not emulated")
        self.group = group
        self.rank, self.group_size = dist.get_rank(group), dist.get_world_size(group)
        assert self.group_size > 1, f"HybridEP needs at least 2 ranks, got {self.group_size}"
        self.ranks_per_domain = min(_nvlink_domain(self.group_size), self.group_size)
        # upstream: assert(false) in a build without the multi-node kernels
        assert MULTINODE or self.ranks_per_domain == self.group_size, (
            "HybridEP across NVLink domains needs a build with HYBRID_EP_MULTINODE=1"
        )
        BUILT[0] += 1
        self.hidden_dim, self.max_num_of_tokens_per_rank = hidden_dim, max_num_of_tokens_per_rank
        self.num_local_experts = num_local_experts

    # ------------------------------------------------------------------ dispatch
    def dispatch_with_permute(
        self,
        *,
        hidden,
        topk_idx=None,
        topk_weights=None,
        num_of_experts_per_rank=None,
        num_of_experts=None,
        use_fp8=None,
        routing_map=None,
        probs=None,
        scaling_factor=None,
        num_dispatched_tokens=None,
        num_permuted_tokens=None,
        pad_multiple=None,
        handle=None,
        non_blocking: bool = False,
        use_host_meta: bool = True,
        **unused,
    ):
        if use_fp8 or scaling_factor is not None:
            raise NotImplementedError(
                "hybrid_ep emulator: fp8 dispatch (scaling_factor) is not emulated"
            )
        T, D = hidden.shape
        # upstream grows its buffer for a larger token count (no new buffer)
        self.max_num_of_tokens_per_rank = max(self.max_num_of_tokens_per_rank, T)
        assert D <= self.hidden_dim, "a wider hidden than the buffer's hidden_dim"
        # executor.cu: the tail chunk's bytes of the routing map must stay 16-byte aligned
        assert (T % TOKENS_PER_CHUNK) * self.ranks_per_domain * 4 % 16 == 0, (
            f"HybridEP token count {T} breaks the chunk alignment ({self.ranks_per_domain} ranks)"
        )
        if handle is not None:  # cached: the layout of an earlier dispatch, hidden only
            src_M, used = handle[0], handle[5]
            return _rows(self._gather(hidden), src_M, used), None, None, handle[1], handle
        if routing_map is None:
            assert topk_idx is not None and num_of_experts is not None, (
                "routing_map, or topk_idx + num_of_experts"
            )
            routing_map = torch.zeros(T, num_of_experts, dtype=torch.bool, device=hidden.device)
            routing_map.scatter_(1, topk_idx.long(), True)
            if topk_weights is not None:
                probs = torch.zeros(T, num_of_experts, dtype=torch.float32, device=hidden.device)
                probs.scatter_(1, topk_idx.long(), topk_weights.float())
        assert routing_map.dtype == torch.bool and routing_map.shape[0] == T
        if non_blocking:
            assert num_permuted_tokens is not None, (
                "non_blocking dispatch needs num_permuted_tokens"
            )
        self._same_tokens_everywhere(T)
        E, P, L = (
            routing_map.shape[1],
            self.group_size,
            num_of_experts_per_rank or self.num_local_experts,
        )
        assert E == P * L, f"routing map of {E} experts for {P} ranks x {L} local experts"
        pad = pad_multiple or 1
        map_GE = self._gather(routing_map)
        mine_GL = map_GE[:, self.rank * L : (self.rank + 1) * L]
        # permuted order: local expert, then group token (source rank, then its token order); each expert's
        # block padded with empty rows (source -1) to a multiple of `pad`.  Built with tensor ops and
        # L host values (not a host list of every row: under moevlm.plan's fake tensors each host value
        # is a dispatched op)
        counts = mine_GL.sum(0).tolist()
        padded = [c + (-c % pad) for c in counts]
        total = sum(padded)
        pick = torch.nonzero(mine_GL.t())  # (expert, group token), in that order
        e_of, g_of = pick[:, 0], pick[:, 1]
        block = torch.tensor([sum(padded[:e]) for e in range(L)], device=hidden.device)
        first = torch.tensor([sum(counts[:e]) for e in range(L)], device=hidden.device)
        at = block[e_of] + torch.arange(len(pick), device=hidden.device) - first[e_of]
        src_all = torch.full((total,), -1, dtype=torch.long, device=hidden.device)
        src_all[at] = g_of
        expert = [e for e in range(L) for _ in range(padded[e])]
        tokens_per_expert = torch.tensor(padded, dtype=torch.long)
        M = total if num_permuted_tokens is None else int(num_permuted_tokens)
        overflow = torch.tensor([int(total > M)], dtype=torch.int32, device=hidden.device)
        # rows past the budget are dropped (and flagged); the unused ones are never written
        used = min(total, M)
        src_M = torch.cat([src_all, src_all.new_full((max(M - total, 0),), -1)])[:M]
        expert_M = torch.tensor((expert + [-1] * M)[:M], dtype=torch.long, device=hidden.device)
        out = _rows(self._gather(hidden), src_M, used)
        out_probs = None
        if probs is not None:
            probs_GL = self._gather(probs.float())[:, self.rank * L : (self.rank + 1) * L]
            out_probs = torch.where(
                src_M >= 0, probs_GL[src_M.clamp_min(0), expert_M.clamp_min(0)], 0.0
            )
            out_probs[used:] = float("nan")
        if not (use_host_meta and not non_blocking):
            tokens_per_expert = tokens_per_expert.to(hidden.device)
        # the overflow flag last, as upstream; the emulator's used-row count before it
        handle = (src_M, tokens_per_expert, expert_M, T, E, used, overflow)
        return out, out_probs, None, tokens_per_expert, handle

    # ------------------------------------------------------------------ combine
    def combine_with_unpermute(
        self,
        *,
        hidden,
        probs=None,
        handle=None,
        pad_multiple=None,
        num_dispatched_tokens=None,
        **unused,
    ):
        """The unweighted sum, per source token, of its rows on every rank (and the same for per-row probs,
        into a dense (T, E) map)."""
        assert handle is not None, "combine needs the dispatch handle"
        # hybrid_ep.cu: combine reduces 2-byte elements only
        assert hidden.element_size() == 2, f"HybridEP combine takes 2-byte rows, got {hidden.dtype}"
        src_M, _, expert_M, T, E = handle[:5]
        P, L = self.group_size, E // self.group_size
        kept = src_M >= 0
        # summed in fp32, written in the rows' dtype
        out = torch.zeros(P * T, hidden.shape[1]).index_add_(0, src_M[kept], hidden[kept].float())
        dist.all_reduce(out, group=self.group)
        combined = out[self.rank * T : (self.rank + 1) * T].to(hidden.dtype)
        combined_probs = None
        if probs is not None:
            dense = torch.zeros(P * T, E, dtype=torch.float32, device=hidden.device)
            dense[src_M[kept], self.rank * L + expert_M[kept]] = probs.float()[kept]
            dist.all_reduce(dense, group=self.group)
            combined_probs = dense[self.rank * T : (self.rank + 1) * T]
        return combined, combined_probs

    # ------------------------------------------------------------------ helpers
    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bool:  # gloo has no bool all-gather
            return self._gather(t.to(torch.uint8)).bool()
        parts = [torch.empty_like(t) for _ in range(self.group_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts)

    def _same_tokens_everywhere(self, T: int) -> None:
        counts = [None] * self.group_size
        dist.all_gather_object(counts, T, group=self.group)
        assert len(set(counts)) == 1, (
            f"HybridEP gathers equal routing maps: token counts differ {counts}"
        )


def _rows(hidden_GD: torch.Tensor, src_M: torch.Tensor, used: int) -> torch.Tensor:
    """The permuted rows: padding rows zero, rows past `used` never written (NaN here).  Upstream has no dtype
    check: it copies D 2-byte words of each row, so wider rows arrive as garbage (their first half, then NaN)."""
    D = hidden_GD.shape[1]
    src = torch.cat([hidden_GD, hidden_GD.new_zeros(1, D)])[
        torch.where(src_M >= 0, src_M, len(hidden_GD))
    ]
    out = torch.full_like(src, float("nan"))
    out.view(torch.uint8)[:used, : 2 * D] = src[:used].view(torch.uint8)[:, : 2 * D]
    return out
