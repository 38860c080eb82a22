"""TEST EMULATOR, not DeepEP: the semantics of DeepEP V2's `deep_ep.ElasticBuffer` (DeepEP main v2.1:
upstream `deep_ep/buffers/elastic.py`, its kernels, `deep_ep/utils/refs.py` and `tests/elastic/test_ep.py`)
in the compact (non-expand) layout within one scale-up domain, over torch.distributed (gloo on the CPU),
for moevlm's adapter tests.  See ../README.md.

Legend: T tokens on this rank, K top-k, D hidden, E experts, P ranks in the group, L = E / P local experts,
C num_max_tokens_per_rank, N rows this rank sends (one per (token, destination rank) pair), R rows received.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .envs import check_bf16, check_torch_deterministic

_ALIGNMENT = 2 << 20  # upstream's buffer sizes are 2 MiB-aligned
_MAX_TOPK = 32  # the kernels' largest top-k; a size hint for num_topk=0 makes room for it
_NUM_SMS = 20  # what the emulator's get_theoretical_num_sms answers within one node
# buffers built with explicitly_destroy=True that Python collected without destroy(): upstream leaks their
# registered memory (csrc/elastic/buffer.hpp); tests read this count
LEAKED = [0]


def _collected(state: dict) -> None:
    if state["live"]:
        LEAKED[0] += 1


def _rdma_gbs() -> float:
    """Upstream reads the RDMA bandwidth through `ibstat` / `mlx5_0`; neither exists here, so it reads 0."""
    return 0.0


def _num_bytes(
    num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int, use_fp8_dispatch: bool
) -> int:
    """The emulator's own size formula (not DeepEP's): a send and a receive slot for every peer's C tokens,
    each a bf16 row (fp8: a byte per element and an fp32 scale per 128), its top-k ids and weights, its
    source index."""
    row = hidden + 4 * -(-hidden // 128) if use_fp8_dispatch else 2 * hidden
    per_token = row + 12 * (num_topk or _MAX_TOPK) + 8
    return _align(2 * num_ranks * num_max_tokens_per_rank * per_token, _ALIGNMENT)


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


class EventOverlap:
    """Stands for upstream's EventOverlap: nothing here runs asynchronously, so there is nothing to wait for."""

    def __init__(self, event=None):
        self.event = event

    def current_stream_wait(self) -> None:
        pass


@dataclass(eq=False)
class _Layout:
    """The emulator's own record of one dispatch (DeepEP keeps buffer slot indices instead)."""

    # source token of every sent row, destination-rank-major, token order within
    send_token_idx: torch.Tensor
    send_splits: list[int]  # rows to each rank
    recv_splits: list[int]  # rows from each rank
    # received row i is row recv_order[i] of the source-rank-major, source-token order
    recv_order: torch.Tensor
    recv_topk_idx: torch.Tensor  # (R, K) local expert ids, -1 where the choice is not on this rank


@dataclass(eq=False)
class EPHandle:
    """Upstream's handle attributes (opaque to callers; a cached dispatch and combine read them), plus the
    emulator's `layout`.  Tensors DeepEP keeps for its kernels alone (slot indices, hybrid-mode lists) are None."""

    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: torch.Tensor  # (T, K) the dispatched top-k, cloned unless do_handle_copy=False
    num_recv_tokens: int  # R, or P x C without a CPU sync (the rows the recv tensors have)
    num_expanded_tokens: int
    # aligned rows per local expert; [] without a CPU sync
    num_recv_tokens_per_expert_list: list[int]
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor  # (P,) int32, inclusive
    psum_num_recv_tokens_per_expert: torch.Tensor  # (L,) int32, inclusive, of the aligned counts
    num_unaligned_recv_tokens_per_expert: torch.Tensor  # (L,) int32
    # (rows, K + 2) int32: source global token, source rank x K + first local slot, -1s
    recv_src_metadata: torch.Tensor
    layout: _Layout
    dst_buffer_slot_idx: torch.Tensor | None = None
    token_metadata_at_forward: torch.Tensor | None = None
    channel_linked_list: torch.Tensor | None = None


class ElasticBuffer:
    def __init__(
        self,
        group,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
    ):
        if num_cpu_bytes:
            raise NotImplementedError(
                "deep_ep emulator: CPU buffer bytes (Engram) are not emulated"
            )
        self.group = group
        self.rank_idx, self.num_ranks = group.rank(), group.size()
        self.deterministic, self.explicitly_destroy = deterministic, explicitly_destroy
        if num_bytes is None:
            assert num_max_tokens_per_rank > 0 and hidden > 0
            num_bytes = _num_bytes(
                self.num_ranks, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch
            )
        self.num_bytes, self.num_max_tokens_per_rank = num_bytes, num_max_tokens_per_rank
        self.num_scaleout_ranks, self.num_scaleup_ranks = (
            1,
            self.num_ranks,
        )  # one scale-up domain only
        self.runtime = object()  # None once destroyed, as upstream
        self._state = {"live": explicitly_destroy}
        weakref.finalize(self, _collected, self._state)
        # the unspecified receive order
        self._order = torch.Generator().manual_seed(5151 + self.rank_idx)
        dist.barrier(group=group)  # upstream ends its constructor with a group barrier

    def destroy(self) -> None:
        assert self.explicitly_destroy
        self.runtime, self._state["live"] = None, False

    @staticmethod
    def get_buffer_size_hint(
        group,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
    ) -> int:
        return _num_bytes(group.size(), num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch)

    def get_logical_domain_size(self) -> tuple[int, int]:
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_physical_domain_size(self) -> tuple[int, int]:
        """(nodes, ranks per node): the node is the launch's LOCAL_WORLD_SIZE when it is smaller than the group
        (the emulator still moves every token as within one scale-up domain)."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.num_ranks))
        per_node = min(local, self.num_ranks)
        return self.num_ranks // per_node, per_node

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, *args, **kwargs) -> int:
        # upstream too fails on num_experts=None (a cached dispatch)
        assert num_experts % self.num_ranks == 0
        nodes, _ = self.get_physical_domain_size()
        if nodes > 1:
            # as upstream: the scale-out traffic over the detected RDMA bandwidth, 0 without ibstat
            return max(4, int(num_topk * 1e9 / _rdma_gbs()) // 2 * 2)
        return _NUM_SMS

    def barrier(
        self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True
    ) -> None:
        dist.barrier(group=self.group)

    # ------------------------------------------------------------------ dispatch
    def dispatch(
        self,
        x,
        topk_idx=None,
        topk_weights=None,
        cumulative_local_expert_recv_stats=None,
        num_experts=None,
        num_max_tokens_per_rank=None,
        expert_alignment=None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle=None,
        do_handle_copy: bool = True,
        do_cpu_sync=None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ):
        self._check_alive()
        check_torch_deterministic()
        if isinstance(x, tuple):
            raise NotImplementedError("deep_ep emulator: fp8 (x, scales) dispatch is not emulated")
        # the buffer holds 2-byte rows (csrc/elastic/buffer.hpp): wider rows would overrun it
        check_bf16(x, "DeepEP V2 dispatch")
        if do_expand or do_zero_padding:
            raise NotImplementedError(
                "deep_ep emulator: the expanding layout (do_expand) is not emulated"
            )
        _no_async(
            previous_event,
            previous_event_before_epilogue,
            async_with_compute_stream,
            allocate_on_comm_stream,
        )
        num_topk = (handle.topk_idx if topk_idx is None else topk_idx).shape[1]
        # as upstream: the SM count is chosen before a cached handle supplies num_experts
        num_sms = self.get_theoretical_num_sms(num_experts, num_topk) if num_sms == 0 else num_sms
        if handle is not None:
            assert topk_idx is None
            assert do_cpu_sync is None or not do_cpu_sync, "Cannot do CPU sync with cached handle"
            cached = (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
            given = (num_experts, expert_alignment, num_max_tokens_per_rank)
            assert tuple(c if g is None else g for g, c in zip(given, cached)) == cached
            return self._cached_dispatch(x, topk_weights, handle)
        C = (
            self.num_max_tokens_per_rank
            if num_max_tokens_per_rank is None
            else num_max_tokens_per_rank
        )
        alignment = 1 if expert_alignment is None else expert_alignment
        do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
        layout, recv_x, recv_w, src_global_R, counts_L = self._route(
            x, topk_idx, topk_weights, num_experts, C
        )
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += counts_L.to(
                cumulative_local_expert_recv_stats.dtype
            )
        aligned_L = (counts_L + alignment - 1) // alignment * alignment
        R, K, L = recv_x.shape[0], num_topk, counts_L.numel()
        src_rank_R = torch.repeat_interleave(
            torch.arange(self.num_ranks), torch.tensor(layout.recv_splits)
        )
        src_rank_R = src_rank_R[layout.recv_order]
        # the master slot
        first_local_R = torch.where(layout.recv_topk_idx >= 0, torch.arange(K), K).min(1).values
        metadata = torch.full((R, K + 2), -1, dtype=torch.int32)
        metadata[:, 0], metadata[:, 1] = src_global_R, src_rank_R * K + first_local_R
        rows = R if do_cpu_sync else self.num_ranks * C
        handle = EPHandle(
            do_expand=False,
            num_experts=num_experts,
            expert_alignment=alignment,
            num_max_tokens_per_rank=C,
            num_sms=num_sms,
            topk_idx=topk_idx.clone() if do_handle_copy else topk_idx,
            num_recv_tokens=rows,
            num_expanded_tokens=int(aligned_L.sum())
            if do_cpu_sync
            else _align(self.num_ranks * C * min(K, L) + (alignment - 1) * L, alignment),
            num_recv_tokens_per_expert_list=aligned_L.tolist() if do_cpu_sync else [],
            psum_num_recv_tokens_per_scaleup_rank=torch.tensor(layout.recv_splits)
            .cumsum(0)
            .to(torch.int32),
            psum_num_recv_tokens_per_expert=aligned_L.cumsum(0).to(torch.int32),
            num_unaligned_recv_tokens_per_expert=counts_L.to(torch.int32),
            recv_src_metadata=_pad(metadata, rows, -1),
            layout=layout,
        )
        recv_idx = _pad(layout.recv_topk_idx.clone(), rows, -1)
        recv_w = None if recv_w is None else _pad(recv_w, rows, float("nan"))
        return _pad(recv_x, rows, float("nan")), recv_idx, recv_w, handle, EventOverlap()

    def _route(self, x, topk_idx, topk_weights, num_experts: int, C: int):
        """Send every token once to each rank one of its choices lives on; (layout, received rows, their top-k
        weights, their source global token indices, unaligned rows per local expert)."""
        P, r, (T, D), K = self.num_ranks, self.rank_idx, x.shape, topk_idx.shape[1]
        assert topk_idx.dtype == torch.int64 and topk_idx.shape[0] == T and num_experts % P == 0
        assert T <= C, f"num_tokens={T} > num_max_tokens_per_rank={C}"
        assert _num_bytes(P, C, D, K, False) <= self.num_bytes, (
            "the buffer is too small for this dispatch"
        )
        L, valid_TK = num_experts // P, topk_idx >= 0
        ordered = topk_idx.sort(1).values
        assert not ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(), (
            "a token chose an expert twice"
        )
        in_rank_TP = torch.zeros(T, P + 1, dtype=torch.bool).scatter_(
            1, torch.where(valid_TK, topk_idx // L, P), True
        )
        tokens_P = [torch.nonzero(in_rank_TP[:, p]).flatten() for p in range(P)]
        send_token_idx = torch.cat(tokens_P) if T else torch.zeros(0, dtype=torch.long)
        send_splits = [int(t.numel()) for t in tokens_P]
        per_expert_E = torch.zeros(num_experts, dtype=torch.long).scatter_add_(
            0, topk_idx[valid_TK], torch.ones_like(topk_idx[valid_TK])
        )
        header_P = torch.cat(
            [torch.tensor(send_splits)[:, None], torch.full((P, 1), C), per_expert_E.view(P, L)], 1
        )
        # what every peer sends me, source-major
        peers_P = self._exchange(header_P, [1] * P, [1] * P)
        assert (peers_P[:, 1] == C).all(), "num_max_tokens_per_rank differs between ranks"
        recv_splits = peers_P[:, 0].tolist()
        order = self._receive_order(recv_splits)
        send = lambda rows: self._exchange(rows[send_token_idx], send_splits, recv_splits)[order]  # noqa: E731
        recv_global_RK = send(topk_idx)
        local_RK = recv_global_RK - r * L
        mine_RK = (recv_global_RK >= 0) & (local_RK >= 0) & (local_RK < L)
        layout = _Layout(
            send_token_idx, send_splits, recv_splits, order, torch.where(mine_RK, local_RK, -1)
        )
        recv_w = None if topk_weights is None else send(topk_weights.float())
        return layout, send(x), recv_w, send(r * C + torch.arange(T)), peers_P[:, 2:].sum(0)

    def _receive_order(self, recv_splits: list[int]) -> torch.Tensor:
        """Rows arrive grouped by source rank; within one source, DeepEP's order is unspecified (the emulator
        shuffles it) unless the buffer is deterministic (then source-token order, as upstream's sort)."""
        starts = [sum(recv_splits[:p]) for p in range(len(recv_splits))]
        if self.deterministic:
            return torch.arange(sum(recv_splits))
        parts = [s + torch.randperm(n, generator=self._order) for s, n in zip(starts, recv_splits)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def _cached_dispatch(self, x, topk_weights, handle: EPHandle):
        """The handle's layout again (no CPU sync): x (and top-k weights, if given) to the same rows."""
        layout = handle.layout
        assert x.shape[0] == handle.topk_idx.shape[0], (
            "a cached dispatch sends as many tokens as the first"
        )

        def send(rows, fill):
            return _pad(
                self._exchange(rows[layout.send_token_idx], layout.send_splits, layout.recv_splits)[
                    layout.recv_order
                ],
                handle.num_recv_tokens,
                fill,
            )

        recv_w = None if topk_weights is None else send(topk_weights.float(), float("nan"))
        return (
            send(x, float("nan")),
            _pad(layout.recv_topk_idx.clone(), handle.num_recv_tokens, -1),
            recv_w,
            handle,
            EventOverlap(),
        )

    # ------------------------------------------------------------------ combine
    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights=None,
        bias=None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        self._check_alive()
        check_torch_deterministic()
        check_bf16(x, "DeepEP V2 combine")
        if bias is not None:
            raise NotImplementedError("deep_ep emulator: combine bias is not emulated")
        _no_async(
            previous_event,
            previous_event_before_epilogue,
            async_with_compute_stream,
            allocate_on_comm_stream,
        )
        layout, P = handle.layout, self.num_ranks
        T, K = handle.topk_idx.shape
        assert x.dim() == 2 and x.shape[0] == handle.recv_src_metadata.shape[0], (
            "x has one row per received token"
        )
        assert T <= handle.num_max_tokens_per_rank

        def back(rows):  # the real received rows to their sources, in the order they were sent
            R = layout.recv_order.numel()
            canonical = rows.new_empty((R, *rows.shape[1:]))
            canonical[layout.recv_order] = rows[:R]
            return self._exchange(canonical, layout.recv_splits, layout.send_splits)

        # summed in fp32, written as bf16
        combined_x = torch.zeros(T, x.shape[1]).index_add_(
            0, layout.send_token_idx, back(x).float()
        )
        combined_x = combined_x.to(x.dtype)
        combined_w = None
        # slot k: the weight the rank owning expert topk_idx[t, k] sent back, 0 for -1
        if topk_weights is not None:
            dest_N = torch.repeat_interleave(torch.arange(P), torch.tensor(layout.send_splits))
            idx_NK = handle.topk_idx[layout.send_token_idx]
            owner_NK = (idx_NK >= 0) & (idx_NK // (handle.num_experts // P) == dest_N[:, None])
            picked_NK = torch.where(owner_NK, back(topk_weights.float()), 0.0)
            combined_w = picked_NK.new_zeros(T, K).index_add_(0, layout.send_token_idx, picked_NK)
        return combined_x, combined_w, EventOverlap()

    # ------------------------------------------------------------------ helpers
    def _exchange(
        self, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> torch.Tensor:
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=self.group)
        return out

    def _check_alive(self) -> None:
        if self.runtime is None:
            raise RuntimeError("deep_ep emulator: this ElasticBuffer was destroyed")


def _pad(rows: torch.Tensor, num_rows: int, fill) -> torch.Tensor:
    """Rows past the real ones (no CPU sync: P x C rows) are unspecified upstream; the emulator fills them."""
    extra = num_rows - rows.shape[0]
    return rows if extra == 0 else torch.cat([rows, rows.new_full((extra, *rows.shape[1:]), fill)])


def _no_async(*flags) -> None:
    if any(f is not None and f is not False for f in flags):
        raise NotImplementedError(
            "deep_ep emulator: events and asynchronous streams are not emulated"
        )
