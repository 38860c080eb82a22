"""TEST EMULATOR, not DeepEP: the documented semantics of DeepEP's V1 `deep_ep.Buffer` (normal mode,
intranode; upstream `deep_ep/buffers/legacy.py`) over torch.distributed (gloo on the CPU), for moevlm's
adapter tests.  See ../README.md.

Legend: T tokens on this rank, K top-k, D hidden, E experts, P ranks in the group, L = E / P local
experts, R rows received (one per (source token, this rank) pair).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .envs import check_bf16, check_torch_deterministic


class Config:
    """Stands for DeepEP's tuning config; the size hints are the emulator's own formula."""

    def __init__(
        self,
        num_sms: int,
        nvl_chunk: int = 6,
        nvl_buffer: int = 256,
        rdma_chunk: int = 6,
        rdma_buffer: int = 128,
    ):
        self.num_sms, self.nvl_chunk, self.nvl_buffer = num_sms, nvl_chunk, nvl_buffer
        self.rdma_chunk, self.rdma_buffer = rdma_chunk, rdma_buffer

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return num_ranks * self.nvl_buffer * hidden_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0 if num_ranks <= 8 else num_ranks * self.rdma_buffer * hidden_bytes


_TABULATED_RANKS = (
    2,
    4,
    8,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    144,
    160,
)  # the rank counts upstream has configs for


@dataclass
class _Handle:
    """Opaque to callers (DeepEP's is a tuple of tensors): the layout of one dispatch."""

    send_splits: list[int]  # rows to each rank
    recv_splits: list[int]  # rows from each rank
    send_token_idx: torch.Tensor  # source token of every sent row, rank-major
    num_tokens: int  # T on this rank


class Buffer:
    num_sms: int = 20

    def __init__(
        self,
        group,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm=None,
    ):
        if low_latency_mode:
            raise NotImplementedError("deep_ep emulator: low-latency mode is not emulated")
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.group_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.explicitly_destroy = explicitly_destroy

    def destroy(self) -> None:
        pass

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in _TABULATED_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, 6, 256)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        assert num_ranks in _TABULATED_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, 4, 256)

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        _no_async(previous_event, async_finish)
        P = self.group_size
        L = num_experts // P
        valid_TK = topk_idx >= 0
        per_expert_E = torch.zeros(num_experts, dtype=torch.long, device=topk_idx.device)
        per_expert_E.scatter_add_(0, topk_idx[valid_TK], torch.ones_like(topk_idx[valid_TK]))
        rank_TK = torch.where(valid_TK, topk_idx // L, P)  # P: a sentinel column, dropped
        in_rank_TP = torch.zeros(topk_idx.shape[0], P + 1, dtype=torch.bool, device=topk_idx.device)
        in_rank_TP.scatter_(1, rank_TK, True)
        in_rank_TP = in_rank_TP[:, :P].contiguous()
        return (
            in_rank_TP.sum(0).to(torch.int32),
            None,
            per_expert_E.to(torch.int32),
            in_rank_TP,
            None,
        )

    # ------------------------------------------------------------------ dispatch
    def dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config=None,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        if isinstance(x, tuple):
            raise NotImplementedError("deep_ep emulator: fp8 (x, scales) dispatch is not emulated")
        if num_worst_tokens:
            raise NotImplementedError("deep_ep emulator: num_worst_tokens is not emulated")
        if num_tokens_per_rdma_rank is not None:
            raise NotImplementedError("deep_ep emulator: internode (RDMA) layouts are not emulated")
        _no_async(previous_event, async_finish)
        check_torch_deterministic()
        if handle is not None:  # cached mode: the layout of an earlier dispatch, rows only
            assert topk_idx is None and topk_weights is None
            return self._send(x, handle), None, None, None, None, None
        assert (
            num_tokens_per_rank is not None
            and is_token_in_rank is not None
            and num_tokens_per_expert is not None
        )
        P, T = self.group_size, x.shape[0]
        tokens_P = [torch.nonzero(is_token_in_rank[:, p]).flatten() for p in range(P)]
        send_token_idx = (
            torch.cat(tokens_P) if T else torch.zeros(0, dtype=torch.long, device=x.device)
        )
        send_splits = [int(t.numel()) for t in tokens_P]
        assert send_splits == num_tokens_per_rank.tolist(), (
            "num_tokens_per_rank disagrees with is_token_in_rank"
        )
        recv_splits = self._exchange_ints(send_splits)
        handle = _Handle(send_splits, recv_splits, send_token_idx, T)
        recv_x = self._send(x, handle)
        recv_topk_idx, recv_topk_weights = None, None
        if topk_idx is not None:
            L = num_tokens_per_expert.numel() // P
            dest_N = torch.repeat_interleave(
                torch.arange(P, device=x.device), torch.tensor(send_splits, device=x.device)
            )
            local_NK = topk_idx[send_token_idx] - dest_N[:, None] * L
            mine_NK = (topk_idx[send_token_idx] >= 0) & (local_NK >= 0) & (local_NK < L)
            rows = (
                torch.where(mine_NK, local_NK, -1),
                torch.where(mine_NK, topk_weights[send_token_idx].float(), 0.0),
            )
            recv_topk_idx, recv_topk_weights = (
                self._exchange(r, send_splits, recv_splits) for r in rows
            )
        per_expert = self._exchange_ints(num_tokens_per_expert.tolist())  # L per peer
        L = len(per_expert) // P
        recv_per_expert = [sum(per_expert[p * L + i] for p in range(P)) for i in range(L)]
        recv_per_expert = [-(-n // expert_alignment) * expert_alignment for n in recv_per_expert]
        return recv_x, recv_topk_idx, recv_topk_weights, recv_per_expert, handle, None

    # ------------------------------------------------------------------ combine
    def combine(
        self,
        x: torch.Tensor,
        handle: _Handle,
        topk_weights=None,
        bias=None,
        config=None,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        if bias is not None:
            raise NotImplementedError("deep_ep emulator: combine bias is not emulated")
        _no_async(previous_event, async_finish)
        check_torch_deterministic()
        # upstream's combine kernels are instantiated for bf16 only (csrc/kernels/legacy/launch.cuh)
        check_bf16(x, "DeepEP V1 combine")

        # to the source ranks, then summed per source token (in fp32, as the kernels)
        def back(rows):
            rows = self._exchange(rows, handle.recv_splits, handle.send_splits)
            return _sum_rows(rows.float(), handle).to(rows.dtype)

        combined_w = None if topk_weights is None else back(topk_weights.float())
        return back(x), combined_w, None

    # ------------------------------------------------------------------ exchanges
    def _exchange(
        self, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> torch.Tensor:
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=self.group)
        return out

    def _send(self, x: torch.Tensor, handle: _Handle) -> torch.Tensor:
        """This rank's tokens to the ranks the layout names (a token once per rank)."""
        return self._exchange(x[handle.send_token_idx], handle.send_splits, handle.recv_splits)

    def _exchange_ints(self, values: list[int]) -> list[int]:
        """Equal blocks of ints, one per peer, exchanged: what every peer sent me, source-major."""
        send = torch.tensor(values, dtype=torch.long)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.tolist()


def _sum_rows(rows: torch.Tensor, handle: _Handle) -> torch.Tensor:
    out = rows.new_zeros((handle.num_tokens, *rows.shape[1:]))
    return out.index_add_(0, handle.send_token_idx, rows)


def _no_async(previous_event, async_finish) -> None:
    if previous_event is not None or async_finish:
        raise NotImplementedError("deep_ep emulator: events and async_finish are not emulated")
