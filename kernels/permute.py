"""Fused permute / unpermute for top-k routing: token rows to expert-grouped rows and back, a torch
reference beside each Triton kernel (`backend="torch" | "triton"`, torch by default).

Legend: T tokens, K top-k choices per token, D hidden, E experts, M rows after permute (T*K, plus
padding when `pad_multiple` > 1).

    plan = permute_plan(topk_idx_TK, num_experts, pad_multiple=1)
    x_MD = permute(x_TD, plan)                               # K copies of each token
    y_MD = experts(x_MD, plan.rows_per_expert_E)             # e.g. grouped_mm
    y_TD = unpermute(y_MD, plan, topk_w_TK)                  # sum_k w[t,k] * y_MD[row(t,k)]

Router weights are applied in `unpermute`, exactly once; `permute` never scales rows.
"""

import functools
from typing import NamedTuple

import torch
from moevlm.kernels import _common as common
from moevlm.kernels._common import FLOAT_DTYPES, cdiv, tl  # tl: None without triton

# what other packages import (moevlm, bench, tests)
__all__ = ["permute", "permute_plan", "unpermute"]

BACKENDS = ("torch", "triton")


class PermutePlan(NamedTuple):
    row_of_choice_TK: torch.Tensor  # int64 destination row of every (token, choice)
    rows_per_expert_E: torch.Tensor  # int64 padded rows per expert, the grouped GEMM's counts
    num_rows: int  # M = rows_per_expert_E.sum()
    tokens_per_expert_E: torch.Tensor  # int64 real (unpadded) rows per expert


def permute_plan(topk_idx_TK: torch.Tensor, num_experts: int, pad_multiple: int = 1) -> PermutePlan:
    """Destination rows in stable expert order, each expert padded to `pad_multiple`."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    flat_idx = topk_idx_TK.reshape(-1).long()
    # scatter_add_, not bincount: a fixed-size output, so no host sync on CUDA.
    tokens_E = flat_idx.new_zeros(num_experts).scatter_add_(0, flat_idx, torch.ones_like(flat_idx))
    rows_E = (tokens_E + pad_multiple - 1) // pad_multiple * pad_multiple
    # A row's destination = its place in the stable sort + the padding before its expert.
    shift_E = (rows_E.cumsum(0) - rows_E) - (tokens_E.cumsum(0) - tokens_E)
    order = torch.sort(flat_idx, stable=True).indices
    row = torch.empty_like(flat_idx)
    row[order] = torch.arange(flat_idx.numel(), device=flat_idx.device)
    row += shift_E[flat_idx]
    num_rows = flat_idx.numel() if pad_multiple == 1 else int(rows_E.sum())
    return PermutePlan(row.view(topk_idx_TK.shape), rows_E, num_rows, tokens_E)


# ---------------------------------------------------------------- torch reference


def _scatter_torch(x_TD, row_TK, w_TK, rows_E, tokens_E, num_rows):
    """out[row(t,k)] = (w[t,k] *) x[t]; padding rows zero."""
    T, K = row_TK.shape
    src_TKD = x_TD[:, None, :].expand(T, K, x_TD.shape[1])
    if w_TK is not None:
        src_TKD = (src_TKD.float() * w_TK.float()[:, :, None]).to(x_TD.dtype)
    out_MD = x_TD.new_zeros(num_rows, x_TD.shape[1])
    out_MD[row_TK.reshape(-1)] = src_TKD.reshape(T * K, x_TD.shape[1])
    return out_MD


def _gather_torch(y_MD, row_TK, w_TK):
    """out[t] = sum_k (w[t,k] *) y[row(t,k)], in fp32."""
    rows_TKD = y_MD[row_TK].float()
    if w_TK is not None:
        rows_TKD = rows_TKD * w_TK.float()[:, :, None]
    return rows_TKD.sum(1).to(y_MD.dtype)


def _weight_grad_torch(dy_TD, y_MD, row_TK):
    return (dy_TD.float()[:, None, :] * y_MD[row_TK].float()).sum(-1)


# ---------------------------------------------------------------- Triton kernels


def _require_triton():
    return common.require_triton("permute backend='triton'")


@functools.cache
def _kernels():
    """Build the kernels on first use (nothing to build when only the torch backend runs)."""
    jit = _require_triton().jit

    @jit
    def scatter_rows(
        x_ptr,
        row_ptr,
        w_ptr,
        out_ptr,
        T,
        D,
        stride_xt,
        stride_xd,
        K: tl.constexpr,
        HAS_W: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_t = offs_t < T
        mask = mask_t[:, None] & (offs_d < D)[None, :]
        x = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_d[None, :] * stride_xd, mask=mask)
        for k in tl.static_range(K):
            row = tl.load(row_ptr + offs_t * K + k, mask=mask_t, other=0)
            val = x
            if HAS_W:
                w = tl.load(w_ptr + offs_t * K + k, mask=mask_t, other=0.0).to(tl.float32)
                val = (x.to(tl.float32) * w[:, None]).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + row[:, None] * D + offs_d[None, :], val, mask=mask)

    @jit
    def gather_rows(
        y_ptr,
        row_ptr,
        w_ptr,
        out_ptr,
        T,
        D,
        stride_ym,
        stride_yd,
        K: tl.constexpr,
        HAS_W: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_t = offs_t < T
        mask = mask_t[:, None] & (offs_d < D)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for k in tl.static_range(K):
            row = tl.load(row_ptr + offs_t * K + k, mask=mask_t, other=0)
            y = tl.load(
                y_ptr + row[:, None] * stride_ym + offs_d[None, :] * stride_yd, mask=mask, other=0.0
            )
            if HAS_W:
                w = tl.load(w_ptr + offs_t * K + k, mask=mask_t, other=0.0).to(tl.float32)
                acc += y.to(tl.float32) * w[:, None]
            else:
                acc += y.to(tl.float32)
        tl.store(
            out_ptr + offs_t[:, None] * D + offs_d[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask,
        )

    @jit
    def unpermute_bwd(
        dy_ptr,
        y_ptr,
        row_ptr,
        w_ptr,
        dyrows_ptr,
        dw_ptr,
        T,
        D,
        stride_dyt,
        stride_dyd,
        stride_ym,
        stride_yd,
        K: tl.constexpr,
        K_P2: tl.constexpr,
        NEED_DW: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        ks = tl.arange(0, K_P2)
        dw = tl.zeros([BLOCK_T, K_P2], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask = mask_t[:, None] & (offs_d < D)[None, :]
            dy = tl.load(
                dy_ptr + offs_t[:, None] * stride_dyt + offs_d[None, :] * stride_dyd,
                mask=mask,
                other=0.0,
            ).to(tl.float32)
            for k in tl.static_range(K):
                row = tl.load(row_ptr + offs_t * K + k, mask=mask_t, other=0)
                w = tl.load(w_ptr + offs_t * K + k, mask=mask_t, other=0.0).to(tl.float32)
                val = (dy * w[:, None]).to(dyrows_ptr.dtype.element_ty)
                tl.store(dyrows_ptr + row[:, None] * D + offs_d[None, :], val, mask=mask)
                if NEED_DW:
                    y = tl.load(
                        y_ptr + row[:, None] * stride_ym + offs_d[None, :] * stride_yd,
                        mask=mask,
                        other=0.0,
                    ).to(tl.float32)
                    dw += tl.where(ks[None, :] == k, tl.sum(dy * y, axis=1)[:, None], 0.0)
        if NEED_DW:
            tl.store(
                dw_ptr + offs_t[:, None] * K + ks[None, :],
                dw,
                mask=mask_t[:, None] & (ks < K)[None, :],
            )

    @jit
    def zero_padding(out_ptr, ends_ptr, pads_ptr, D, BLOCK_D: tl.constexpr):
        end = tl.load(ends_ptr + tl.program_id(0))
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        zeros = tl.zeros([BLOCK_D], dtype=out_ptr.dtype.element_ty)
        for r in range(end - tl.load(pads_ptr + tl.program_id(0)), end):
            tl.store(out_ptr + r * D + offs_d, zeros, mask=offs_d < D)

    return scatter_rows, gather_rows, unpermute_bwd, zero_padding


def _blocks(T: int, D: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_D): tiles of ~4k elements.  Not tuned on a GPU."""
    np2 = _require_triton().next_power_of_2
    block_d = min(np2(D), 256)
    return max(1, min(np2(T), 4096 // block_d)), block_d


def _zero_padding_triton(out_MD, row_TK, rows_E, tokens_E):
    if out_MD.shape[0] == row_TK.numel() or out_MD.shape[1] == 0:
        return  # no padding rows
    _, block_d = _blocks(1, out_MD.shape[1])
    grid = (rows_E.numel(), cdiv(out_MD.shape[1], block_d))
    _kernels()[3][grid](
        out_MD, rows_E.cumsum(0), rows_E - tokens_E, out_MD.shape[1], BLOCK_D=block_d
    )


def _scatter_triton(x_TD, row_TK, w_TK, rows_E, tokens_E, num_rows):
    (T, K), D = row_TK.shape, x_TD.shape[1]
    out_MD = x_TD.new_empty(num_rows, D)
    if T * D > 0:
        bt, bd = _blocks(T, D)
        grid = (cdiv(T, bt), cdiv(D, bd))
        _kernels()[0][grid](
            x_TD,
            row_TK.contiguous(),
            w_TK if w_TK is not None else row_TK,
            out_MD,
            T,
            D,
            *x_TD.stride(),
            K=K,
            HAS_W=w_TK is not None,
            BLOCK_T=bt,
            BLOCK_D=bd,
        )
    _zero_padding_triton(out_MD, row_TK, rows_E, tokens_E)
    return out_MD


def _gather_triton(y_MD, row_TK, w_TK):
    (T, K), D = row_TK.shape, y_MD.shape[1]
    out_TD = y_MD.new_empty(T, D)
    if T * D > 0:
        bt, bd = _blocks(T, D)
        grid = (cdiv(T, bt), cdiv(D, bd))
        _kernels()[1][grid](
            y_MD,
            row_TK.contiguous(),
            w_TK if w_TK is not None else row_TK,
            out_TD,
            T,
            D,
            *y_MD.stride(),
            K=K,
            HAS_W=w_TK is not None,
            BLOCK_T=bt,
            BLOCK_D=bd,
        )
    return out_TD


def _unpermute_bwd_triton(dy_TD, y_MD, row_TK, w_TK, rows_E, tokens_E, need_dw):
    (T, K), D = row_TK.shape, y_MD.shape[1]
    dy_MD = y_MD.new_empty(y_MD.shape)
    dw_TK = torch.zeros(T, K, dtype=torch.float32, device=y_MD.device) if need_dw else None
    if T * D > 0:
        bt, bd = _blocks(T, D)
        _kernels()[2][(cdiv(T, bt),)](
            dy_TD,
            y_MD,
            row_TK.contiguous(),
            w_TK.contiguous(),
            dy_MD,
            dw_TK if need_dw else w_TK,
            T,
            D,
            *dy_TD.stride(),
            *y_MD.stride(),
            K=K,
            K_P2=_require_triton().next_power_of_2(K),
            NEED_DW=need_dw,
            BLOCK_T=bt,
            BLOCK_D=bd,
        )
    _zero_padding_triton(dy_MD, row_TK, rows_E, tokens_E)
    return dy_MD, dw_TK


# ---------------------------------------------------------------- custom ops


def _scatter(backend, *args):
    return (_scatter_triton if backend == "triton" else _scatter_torch)(*args)


def _gather(backend, *args):
    return (_gather_triton if backend == "triton" else _gather_torch)(*args)


@torch.library.custom_op("moevlm::permute", mutates_args=())
def _permute_op(
    x_TD: torch.Tensor,
    row_TK: torch.Tensor,
    rows_E: torch.Tensor,
    tokens_E: torch.Tensor,
    num_rows: int,
    backend: str,
) -> torch.Tensor:
    return _scatter(backend, x_TD, row_TK, None, rows_E, tokens_E, num_rows)


@torch.library.custom_op("moevlm::permute_backward", mutates_args=())
def _permute_backward_op(dx_MD: torch.Tensor, row_TK: torch.Tensor, backend: str) -> torch.Tensor:
    return _gather(backend, dx_MD, row_TK, None)


@torch.library.custom_op("moevlm::unpermute", mutates_args=())
def _unpermute_op(
    y_MD: torch.Tensor,
    row_TK: torch.Tensor,
    topk_w_TK: torch.Tensor,
    rows_E: torch.Tensor,
    tokens_E: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    return _gather(backend, y_MD, row_TK, topk_w_TK)


@torch.library.custom_op("moevlm::unpermute_backward", mutates_args=())
def _unpermute_backward_op(
    dy_TD: torch.Tensor,
    y_MD: torch.Tensor,
    row_TK: torch.Tensor,
    topk_w_TK: torch.Tensor,
    rows_E: torch.Tensor,
    tokens_E: torch.Tensor,
    need_dw: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d y_MD, d topk_w_TK); the latter is empty (0, K) when not `need_dw`."""
    if backend == "triton":
        dy_MD, dw_TK = _unpermute_bwd_triton(
            dy_TD, y_MD, row_TK, topk_w_TK, rows_E, tokens_E, need_dw
        )
    else:
        dy_MD = _scatter_torch(dy_TD, row_TK, topk_w_TK, rows_E, tokens_E, y_MD.shape[0])
        dw_TK = _weight_grad_torch(dy_TD, y_MD, row_TK) if need_dw else None
    if dw_TK is None:
        return dy_MD, topk_w_TK.new_empty(0, topk_w_TK.shape[1])
    return dy_MD, dw_TK.to(topk_w_TK.dtype)


@_permute_op.register_fake
def _(x_TD, row_TK, rows_E, tokens_E, num_rows, backend):
    return x_TD.new_empty(num_rows, x_TD.shape[1])


@_permute_backward_op.register_fake
def _(dx_MD, row_TK, backend):
    return dx_MD.new_empty(row_TK.shape[0], dx_MD.shape[1])


@_unpermute_op.register_fake
def _(y_MD, row_TK, topk_w_TK, rows_E, tokens_E, backend):
    return y_MD.new_empty(row_TK.shape[0], y_MD.shape[1])


@_unpermute_backward_op.register_fake
def _(dy_TD, y_MD, row_TK, topk_w_TK, rows_E, tokens_E, need_dw, backend):
    dw_rows = topk_w_TK.shape[0] if need_dw else 0
    return y_MD.new_empty(y_MD.shape), topk_w_TK.new_empty(dw_rows, topk_w_TK.shape[1])


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.backend = inputs[5]


def _permute_backward(ctx, dx_MD):
    (row_TK,) = ctx.saved_tensors
    return _permute_backward_op(dx_MD, row_TK, ctx.backend), None, None, None, None, None


def _unpermute_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])
    ctx.backend = inputs[5]


def _unpermute_backward(ctx, dy_TD):
    y_MD, row_TK, topk_w_TK, rows_E, tokens_E = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[2]
    dy_MD, dw_TK = _unpermute_backward_op(
        dy_TD, y_MD, row_TK, topk_w_TK, rows_E, tokens_E, need_dw, ctx.backend
    )
    return dy_MD, None, dw_TK if need_dw else None, None, None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)
_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


# ---------------------------------------------------------------- public API


def _check(backend: str, *tensors: torch.Tensor) -> None:
    if backend not in BACKENDS:
        raise ValueError(
            f"permute backend {backend!r} is not available; choose one of {list(BACKENDS)}"
        )
    for t in tensors:
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"permute/unpermute take fp32, fp16 or bf16 rows, got {t.dtype}")
    if backend == "triton":
        _require_triton()
        common.require_kernel_device("permute backend='triton'", *tensors)


def permute(x_TD: torch.Tensor, plan: PermutePlan, backend: str = "torch") -> torch.Tensor:
    """x_MD[row(t,k)] = x_TD[t] for every choice; padding rows are zeros.  Unweighted."""
    _check(backend, x_TD)
    return _permute_op(
        x_TD,
        plan.row_of_choice_TK,
        plan.rows_per_expert_E,
        plan.tokens_per_expert_E,
        plan.num_rows,
        backend,
    )


def unpermute(
    y_MD: torch.Tensor, plan: PermutePlan, topk_w_TK: torch.Tensor, backend: str = "torch"
) -> torch.Tensor:
    """y_TD[t] = sum_k topk_w[t,k] * y_MD[row(t,k)], in fp32, returned in y's dtype."""
    _check(backend, y_MD)
    if y_MD.shape[0] != plan.num_rows:
        raise ValueError(f"unpermute got {y_MD.shape[0]} rows, the plan has {plan.num_rows}")
    return _unpermute_op(
        y_MD,
        plan.row_of_choice_TK,
        topk_w_TK,
        plan.rows_per_expert_E,
        plan.tokens_per_expert_E,
        backend,
    )
