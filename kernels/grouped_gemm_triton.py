"""Triton grouped GEMM for MoE experts, `out[rows of e] = x[rows of e] @ w[e]`, with both gradients, as
torch custom ops (torch.compile traces them as single nodes).

Legend: M rows (tokens x top-k, sorted by expert), K in-features, N out-features, E experts;
`counts_E[e]` rows belong to expert e (zeros allowed; sum = M, not checked: that needs a host sync).

    out_MN = grouped_mm_triton(x_MK, w_EKN, counts_E)      # differentiable
    forward  out_MN = x_MK @ w_EKN[e]                      _grouped_mm_kernel, persistent
    dgrad    dx_MK = dy_MN @ w_EKN[e]^T                    the same kernel, w through swapped strides
    wgrad    dw_EKN[e] = x_MK[rows e]^T @ dy_MN[rows e]    _grouped_wgrad_kernel

Importing this module needs `triton`.
"""

from __future__ import annotations

import torch
from moevlm.kernels import _common as common
from moevlm.kernels._common import FLOAT_DTYPES, num_programs, require_triton, tl

# what other packages import (moevlm, bench, tests)
__all__ = ["grouped_mm_triton"]

triton = require_triton("the triton grouped GEMM")
_INTERPRET_TILE = (
    32,
    32,
    32,
    4,
    1,
)  # one config under the interpreter; test shapes still span several tiles


def _configs(tiles: list[tuple[int, int, int, int, int]], names: tuple[str, str, str]) -> list:
    return common.autotune_configs(tiles, names, _INTERPRET_TILE)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
_FWD_CONFIGS = _configs(
    [
        (128, 256, 64, 8, 3),
        (128, 128, 64, 8, 4),
        (128, 128, 64, 4, 4),
        (64, 256, 64, 8, 3),
        (64, 128, 64, 4, 4),
    ],
    ("BLOCK_M", "BLOCK_N", "BLOCK_K"),
)
# (BLOCK_K, BLOCK_N, BLOCK_M): an output tile of dw, and the row chunk it reduces over.
_WGRAD_CONFIGS = _configs(
    [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4)],
    ("BLOCK_K", "BLOCK_N", "BLOCK_M"),
)


@triton.jit
def _expert_rows(counts_ptr, E, E_P2: tl.constexpr):
    """Per expert (an E_P2-wide vector, zero past E): first row and row count."""
    e = tl.arange(0, E_P2)
    counts = tl.load(counts_ptr + e, mask=e < E, other=0).to(tl.int32)
    return e, tl.cumsum(counts, 0) - counts, counts


@triton.jit
def _pick(vec, e_idx, e):
    return tl.sum(tl.where(e_idx == e, vec, 0))


@triton.jit
def _dot(a, b, acc, DOT_IN_FP32: tl.constexpr, PRECISION: tl.constexpr):
    if DOT_IN_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


# stride_wn: w (1) or w^T (dgrad)
@triton.autotune(configs=_FWD_CONFIGS, key=["N", "K", "stride_wn"])
@triton.jit
def _grouped_mm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    counts_ptr,
    N,
    K,
    E,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wn,
    stride_om,
    stride_on,
    E_P2: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e_idx, starts, counts = _expert_rows(counts_ptr, E, E_P2)
    m_tiles = tl.cdiv(counts, BLOCK_M)
    # expert e owns global M tiles [tile_ends[e] - m_tiles[e], tile_ends[e])
    tile_ends = tl.cumsum(m_tiles, 0)
    num_n = tl.cdiv(N, BLOCK_N)
    total = tl.max(tile_ends, 0) * num_n
    ms = tl.arange(0, BLOCK_M)
    ns = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    for item in tl.range(tl.program_id(0), total, tl.num_programs(0)):
        m_tile = item // num_n
        # the first expert whose tiles end past m_tile
        ex = tl.sum((tile_ends <= m_tile).to(tl.int32), 0)
        local_tile = m_tile - (_pick(tile_ends, e_idx, ex) - _pick(m_tiles, e_idx, ex))
        rows = _pick(starts, e_idx, ex) + local_tile * BLOCK_M + ms
        row_mask = rows < _pick(starts + counts, e_idx, ex)
        cols = (item % num_n) * BLOCK_N + ns
        col_mask = cols < N
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :] * stride_xk
        w_ptrs = (
            w_ptr
            + ex.to(tl.int64) * stride_we
            + ks[:, None] * stride_wk
            + cols[None, :] * stride_wn
        )
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_mask = ks < K - k
            a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = _dot(a, b, acc, DOT_IN_FP32, PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(
            out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :]
        )


@triton.autotune(configs=_WGRAD_CONFIGS, key=["N", "K"])
@triton.jit
def _grouped_wgrad_kernel(
    x_ptr,
    dy_ptr,
    dw_ptr,
    counts_ptr,
    N,
    K,
    E,
    stride_xm,
    stride_xk,
    stride_dym,
    stride_dyn,
    stride_we,
    stride_wk,
    stride_wn,
    E_P2: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(K, BLOCK_K) * num_n
    ex = pid // tiles
    kk = (pid % tiles) // num_n * BLOCK_K + tl.arange(0, BLOCK_K)
    nn = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = kk < K
    n_mask = nn < N
    e_idx, starts, counts = _expert_rows(counts_ptr, E, E_P2)
    count = _pick(counts, e_idx, ex)
    rows = _pick(starts, e_idx, ex) + tl.arange(0, BLOCK_M)
    ms = tl.arange(0, BLOCK_M)
    # x^T tile (BLOCK_K, BLOCK_M)
    xt_ptrs = x_ptr + rows.to(tl.int64)[None, :] * stride_xm + kk[:, None] * stride_xk
    dy_ptrs = dy_ptr + rows.to(tl.int64)[:, None] * stride_dym + nn[None, :] * stride_dyn
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m in range(0, count, BLOCK_M):
        m_mask = ms < count - m
        a = tl.load(xt_ptrs, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        b = tl.load(dy_ptrs, mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _dot(a, b, acc, DOT_IN_FP32, PRECISION)
        xt_ptrs += BLOCK_M * stride_xm
        dy_ptrs += BLOCK_M * stride_dym
    dw_ptrs = (
        dw_ptr + ex.to(tl.int64) * stride_we + kk[:, None] * stride_wk + nn[None, :] * stride_wn
    )
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])


# ------------------------------------------------------------------ launchers
def _kernel_flags(x: torch.Tensor, counts_E: torch.Tensor) -> dict:
    common.require_kernel_device("the triton grouped GEMM", x)
    interpret = common.INTERPRET
    ieee = x.dtype == torch.float32 and (interpret or not torch.backends.cuda.matmul.allow_tf32)
    return dict(
        E_P2=triton.next_power_of_2(max(counts_E.shape[0], 1)),
        DOT_IN_FP32=interpret and x.dtype == torch.bfloat16,
        PRECISION="ieee" if ieee else "tf32",
    )  # tf32, the default, means nothing to 16-bit inputs


def _launch_mm(x_MK, w_EKN, counts_E, N, w_strides_EKN) -> torch.Tensor:
    """x_MK @ w[e] -> (M, N), reading w through the given (E, K, N) strides (swapped ones read w^T)."""
    (M, K), E = x_MK.shape, counts_E.shape[0]
    out = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    if out.numel() == 0:
        return out
    if K == 0:
        return out.zero_()
    programs = num_programs(x_MK.device)

    def grid(meta):
        return (
            min(programs, (triton.cdiv(M, meta["BLOCK_M"]) + E) * triton.cdiv(N, meta["BLOCK_N"])),
        )

    _grouped_mm_kernel[grid](
        x_MK,
        w_EKN,
        out,
        counts_E,
        N,
        K,
        E,
        *x_MK.stride(),
        *w_strides_EKN,
        *out.stride(),
        **_kernel_flags(x_MK, counts_E),
    )
    return out


def _launch_wgrad(x_MK, dy_MN, counts_E) -> torch.Tensor:
    (M, K), N, E = x_MK.shape, dy_MN.shape[1], counts_E.shape[0]
    dw = torch.empty(E, K, N, dtype=x_MK.dtype, device=x_MK.device)
    if dw.numel() == 0:
        return dw

    def grid(meta):
        return (E * triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _grouped_wgrad_kernel[grid](
        x_MK,
        dy_MN,
        dw,
        counts_E,
        N,
        K,
        E,
        *x_MK.stride(),
        *dy_MN.stride(),
        *dw.stride(),
        **_kernel_flags(x_MK, counts_E),
    )
    return dw


# ---------------------------------------------------------------- custom ops
@torch.library.custom_op("moevlm::grouped_mm_triton", mutates_args=())
def _grouped_mm_op(x_MK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    return _launch_mm(x_MK, w_EKN, counts_E, w_EKN.shape[2], w_EKN.stride())


@torch.library.custom_op("moevlm::grouped_mm_triton_dgrad", mutates_args=())
def _dgrad_op(dy_MN: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    s_e, s_k, s_n = w_EKN.stride()
    # w[e]^T: (N, K) through swapped strides
    return _launch_mm(dy_MN, w_EKN, counts_E, w_EKN.shape[1], (s_e, s_n, s_k))


@torch.library.custom_op("moevlm::grouped_mm_triton_wgrad", mutates_args=())
def _wgrad_op(x_MK: torch.Tensor, dy_MN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    return _launch_wgrad(x_MK, dy_MN, counts_E)


@_grouped_mm_op.register_fake
def _(x_MK, w_EKN, counts_E):
    return x_MK.new_empty(x_MK.shape[0], w_EKN.shape[2])


@_dgrad_op.register_fake
def _(dy_MN, w_EKN, counts_E):
    return dy_MN.new_empty(dy_MN.shape[0], w_EKN.shape[1])


@_wgrad_op.register_fake
def _(x_MK, dy_MN, counts_E):
    return x_MK.new_empty(counts_E.shape[0], x_MK.shape[1], dy_MN.shape[1])


def _setup_context(ctx, inputs, output):
    x_MK, w_EKN, counts_E = inputs
    ctx.save_for_backward(x_MK, w_EKN, counts_E)


def _backward(ctx, dy_MN):
    x_MK, w_EKN, counts_E = ctx.saved_tensors
    dx = _dgrad_op(dy_MN, w_EKN, counts_E) if ctx.needs_input_grad[0] else None
    dw = _wgrad_op(x_MK, dy_MN, counts_E) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm_triton(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor
) -> torch.Tensor:
    """out_MN[rows of e] = x_MK[rows of e] @ w_EKN[e]; rows grouped by expert in order, counts_E rows each."""
    if x_MK.dim() != 2 or w_EKN.dim() != 3 or counts_E.dim() != 1:
        raise ValueError(
            f"grouped_mm_triton wants x (M, K), w (E, K, N), counts (E,); got shapes "
            f"{tuple(x_MK.shape)}, {tuple(w_EKN.shape)}, {tuple(counts_E.shape)}"
        )
    if x_MK.shape[1] != w_EKN.shape[1] or counts_E.shape[0] != w_EKN.shape[0]:
        raise ValueError(
            f"grouped_mm_triton: x (M, K)={tuple(x_MK.shape)}, w (E, K, N)={tuple(w_EKN.shape)} and "
            f"counts (E,)={tuple(counts_E.shape)} disagree on K or E"
        )
    if x_MK.dtype != w_EKN.dtype or x_MK.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"grouped_mm_triton wants x and w of one dtype among fp32/fp16/bf16; got {x_MK.dtype} "
            f"and {w_EKN.dtype}"
        )
    if counts_E.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"grouped_mm_triton wants integer counts (int32 or int64); got {counts_E.dtype}"
        )
    if not (x_MK.device == w_EKN.device == counts_E.device):
        raise ValueError(
            f"grouped_mm_triton: x, w, counts on {x_MK.device}, {w_EKN.device}, {counts_E.device}; "
            "put them on one device"
        )
    return _grouped_mm_op(x_MK, w_EKN, counts_E)
