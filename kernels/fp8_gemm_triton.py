"""FP8 GEMMs, the Triton kernels (blockwise recipe): one persistent kernel for mm and dgrad, one for
wgrad, registered as torch custom ops with fakes (moevlm::fp8_grouped_{mm,dgrad,wgrad}_blockwise).

Legend: M rows (grouped by expert), K in-features, N out-features, E experts; `counts_E[e]` rows
belong to expert e, read on the device (no host sync).  Codes e4m3, fp32 scales per 1x128 tile
(activations) or 128x128 block (weights); fp32 accumulation, one dot per 128-long K step.

    out_MN = TRITON_OPS["mm"](xq_MK, xs, wq_EKN, ws, counts_E, out_dtype)
    dx_MK  = TRITON_OPS["dgrad"](dyq_MN, dys, wq_EKN, ws, counts_E, out_dtype)   # w^T via strides
    dw_EKN = TRITON_OPS["wgrad"](xq_KM, xs_KM, dyq_NM, dys_NM, counts_E, out_dtype)

Importing this module needs `triton`.
"""

from __future__ import annotations

import torch
from moevlm.kernels import _common as common
from moevlm.kernels._common import num_programs, require_triton, tl
from moevlm.kernels.grouped_gemm_triton import _expert_rows, _pick

__all__ = ["TRITON_OPS", "dgrad_op", "mm_op", "wgrad_op"]

triton = require_triton("the triton fp8 GEMM")


def _configs(tiles, names):
    # interpreter: one; test shapes span several
    return common.autotune_configs(tiles, names, (64, 64, 4, 1))


# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_K is 128.  The dot result and the accumulator are both
# live, so tiles stay at 128x128 per 8 warps (64 + 64 fp32 registers a thread).
_MM_CONFIGS = _configs(
    [(128, 128, 8, 4), (128, 128, 8, 3), (64, 256, 8, 3), (64, 128, 4, 4)], ("BLOCK_M", "BLOCK_N")
)
# (BLOCK_K, BLOCK_N) of a dw tile; it reduces over 128-row blocks.
_WGRAD_CONFIGS = _configs(
    [(128, 128, 8, 4), (128, 128, 8, 3), (64, 256, 8, 3), (64, 128, 4, 4)], ("BLOCK_K", "BLOCK_N")
)


# stride_bn: w (1) or w^T (dgrad)
@triton.autotune(configs=_MM_CONFIGS, key=["N", "K", "stride_bn"])
@triton.jit
def _fp8_mm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    out_ptr,
    counts_ptr,
    N,
    K,
    E,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_be,
    stride_bk,
    stride_bn,
    stride_bse,
    stride_bsk,
    stride_bsn,
    stride_om,
    stride_on,
    E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[rows of e] = (a * a_s)[rows of e] @ (b[e] * b_s[e]); a_s per (row, K block), b_s per (K block, N block)."""
    e_idx, starts, counts = _expert_rows(counts_ptr, E, E_P2)
    m_tiles = tl.cdiv(counts, BLOCK_M)
    tile_ends = tl.cumsum(m_tiles, 0)
    num_n = tl.cdiv(N, BLOCK_N)
    total = tl.max(tile_ends, 0) * num_n
    ms = tl.arange(0, BLOCK_M)
    ns = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    for item in tl.range(tl.program_id(0), total, tl.num_programs(0)):
        m_tile = item // num_n
        ex = tl.sum((tile_ends <= m_tile).to(tl.int32), 0)
        local_tile = m_tile - (_pick(tile_ends, e_idx, ex) - _pick(m_tiles, e_idx, ex))
        rows = _pick(starts, e_idx, ex) + local_tile * BLOCK_M + ms
        row_mask = rows < _pick(starts + counts, e_idx, ex)
        cols = (item % num_n) * BLOCK_N + ns
        col_mask = cols < N
        rows64 = rows.to(tl.int64)
        a_ptrs = a_ptr + rows64[:, None] * stride_am + ks[None, :] * stride_ak
        b_ptrs = (
            b_ptr
            + ex.to(tl.int64) * stride_be
            + ks[:, None] * stride_bk
            + cols[None, :] * stride_bn
        )
        as_ptrs = as_ptr + rows64 * stride_asm
        bs_ptrs = bs_ptr + ex.to(tl.int64) * stride_bse + (cols // BLOCK_K) * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_mask = ks < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            a_s = tl.load(as_ptrs + kb * stride_ask, mask=row_mask, other=0.0)
            b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=col_mask, other=0.0)
            acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        out_ptrs = out_ptr + rows64[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(
            out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :]
        )


@triton.jit
def _wgrad_block(
    acc,
    a_base,
    b_base,
    as_base,
    bs_base,
    k_mask,
    n_mask,
    mb,
    start,
    end,
    stride_am,
    stride_bm,
    stride_asm,
    stride_bsm,
    BLOCK_M: tl.constexpr,
    MASK_M: tl.constexpr,
):
    """acc += one BLOCK_M-row scale block mb of x^T @ dy; with MASK_M only the rows in [start, end)."""
    rows = (mb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    if MASK_M:
        m_mask = (rows >= start) & (rows < end)
        a_mask = k_mask[:, None] & m_mask[None, :]
        b_mask = m_mask[:, None] & n_mask[None, :]
    else:  # a mask along M would stop the loads from being vectorized and pipelined
        a_mask = k_mask[:, None]
        b_mask = n_mask[None, :]
    a = tl.load(a_base + rows[None, :] * stride_am, mask=a_mask, other=0.0)
    b = tl.load(b_base + rows[:, None] * stride_bm, mask=b_mask, other=0.0)
    a_s = tl.load(as_base + mb * stride_asm, mask=k_mask, other=0.0)
    b_s = tl.load(bs_base + mb * stride_bsm, mask=n_mask, other=0.0)
    return acc + tl.dot(a, b) * (a_s[:, None] * b_s[None, :])


@triton.autotune(configs=_WGRAD_CONFIGS, key=["N", "K"])
@triton.jit
def _fp8_wgrad_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    dw_ptr,
    counts_ptr,
    N,
    K,
    E,
    stride_ak,
    stride_am,
    stride_ask,
    stride_asm,
    stride_bn,
    stride_bm,
    stride_bsn,
    stride_bsm,
    stride_we,
    stride_wk,
    stride_wn,
    E_P2: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """dw[e] = (x^T * s)[:, rows of e] @ (dy^T * s)[:, rows of e]^T, over the global BLOCK_M-row scale blocks:
    those inside the expert unmasked, then the (at most two) it shares with a neighbour masked to its rows."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(K, BLOCK_K) * num_n
    ex = pid // tiles
    kk = ((pid % tiles) // num_n * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    nn = ((pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k_mask = kk < K
    n_mask = nn < N
    e_idx, starts, counts = _expert_rows(counts_ptr, E, E_P2)
    start = _pick(starts, e_idx, ex)
    end = start + _pick(counts, e_idx, ex)
    full_lo = tl.cdiv(start, BLOCK_M)
    full_hi = tl.maximum(end // BLOCK_M, full_lo)  # whole blocks [full_lo, full_hi); no rows: none
    a_base = a_ptr + kk[:, None] * stride_ak
    b_base = b_ptr + nn[None, :] * stride_bn
    as_base = as_ptr + kk * stride_ask
    bs_base = bs_ptr + nn * stride_bsn
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for mb in range(full_lo, full_hi):
        acc = _wgrad_block(
            acc,
            a_base,
            b_base,
            as_base,
            bs_base,
            k_mask,
            n_mask,
            mb,
            start,
            end,
            stride_am,
            stride_bm,
            stride_asm,
            stride_bsm,
            BLOCK_M,
            False,
        )
    if (end > start) & (start // BLOCK_M < full_lo):  # the block holding an unaligned start
        acc = _wgrad_block(
            acc,
            a_base,
            b_base,
            as_base,
            bs_base,
            k_mask,
            n_mask,
            start // BLOCK_M,
            start,
            end,
            stride_am,
            stride_bm,
            stride_asm,
            stride_bsm,
            BLOCK_M,
            True,
        )
    # the block holding an unaligned end, if another one
    if (end > start) & ((end - 1) // BLOCK_M >= full_hi):
        acc = _wgrad_block(
            acc,
            a_base,
            b_base,
            as_base,
            bs_base,
            k_mask,
            n_mask,
            (end - 1) // BLOCK_M,
            start,
            end,
            stride_am,
            stride_bm,
            stride_asm,
            stride_bsm,
            BLOCK_M,
            True,
        )
    dw_ptrs = (
        dw_ptr + ex.to(tl.int64) * stride_we + kk[:, None] * stride_wk + nn[None, :] * stride_wn
    )
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])


def _launch_mm(aq, a_s, bq, b_s, counts_E, N, K, b_strides, bs_strides, out_dtype):
    """(a * a_s) @ (b[e] * b_s[e]) -> (M, N), reading b and its scales through (E, K, N)-ordered strides."""
    M, E = aq.shape[0], counts_E.shape[0]
    out = torch.empty(M, N, dtype=out_dtype, device=aq.device)
    if out.numel() == 0:
        return out
    if K == 0:
        return out.zero_()
    common.require_kernel_device("the triton fp8 GEMM", aq)
    programs = num_programs(aq.device)

    def grid(meta):
        return (
            min(programs, (triton.cdiv(M, meta["BLOCK_M"]) + E) * triton.cdiv(N, meta["BLOCK_N"])),
        )

    _fp8_mm_kernel[grid](
        aq,
        a_s,
        bq,
        b_s,
        out,
        counts_E,
        N,
        K,
        E,
        *aq.stride(),
        *a_s.stride(),
        *b_strides,
        *bs_strides,
        *out.stride(),
        E_P2=triton.next_power_of_2(max(E, 1)),
        BLOCK_K=128,
    )
    return out


def _launch_wgrad(xq_KM, xs_KM, dyq_NM, dys_NM, counts_E, out_dtype):
    K, N, E = xq_KM.shape[0], dyq_NM.shape[0], counts_E.shape[0]
    dw = torch.empty(E, K, N, dtype=out_dtype, device=xq_KM.device)
    if dw.numel() == 0:
        return dw
    common.require_kernel_device("the triton fp8 GEMM", xq_KM)

    def grid(meta):
        return (E * triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _fp8_wgrad_kernel[grid](
        xq_KM,
        xs_KM,
        dyq_NM,
        dys_NM,
        dw,
        counts_E,
        N,
        K,
        E,
        *xq_KM.stride(),
        *xs_KM.stride(),
        *dyq_NM.stride(),
        *dys_NM.stride(),
        *dw.stride(),
        E_P2=triton.next_power_of_2(max(E, 1)),
        BLOCK_M=128,
    )
    return dw


@torch.library.custom_op("moevlm::fp8_grouped_mm_blockwise", mutates_args=())
def mm_op(
    xq_MK: torch.Tensor,
    xs: torch.Tensor,
    wq_EKN: torch.Tensor,
    ws: torch.Tensor,
    counts_E: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    _, K, N = wq_EKN.shape
    return _launch_mm(
        xq_MK, xs, wq_EKN, ws, counts_E, N, K, wq_EKN.stride(), ws.stride(), out_dtype
    )


@torch.library.custom_op("moevlm::fp8_grouped_dgrad_blockwise", mutates_args=())
def dgrad_op(
    dyq_MN: torch.Tensor,
    dys: torch.Tensor,
    wq_EKN: torch.Tensor,
    ws: torch.Tensor,
    counts_E: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    (_, K, N), (s_e, s_k, s_n), (t_e, t_k, t_n) = wq_EKN.shape, wq_EKN.stride(), ws.stride()
    # w^T
    return _launch_mm(
        dyq_MN, dys, wq_EKN, ws, counts_E, K, N, (s_e, s_n, s_k), (t_e, t_n, t_k), out_dtype
    )


@torch.library.custom_op("moevlm::fp8_grouped_wgrad_blockwise", mutates_args=())
def wgrad_op(
    xq_KM: torch.Tensor,
    xs_KM: torch.Tensor,
    dyq_NM: torch.Tensor,
    dys_NM: torch.Tensor,
    counts_E: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return _launch_wgrad(xq_KM, xs_KM, dyq_NM, dys_NM, counts_E, out_dtype)


@mm_op.register_fake
def _(xq_MK, xs, wq_EKN, ws, counts_E, out_dtype):
    return xq_MK.new_empty(xq_MK.shape[0], wq_EKN.shape[2], dtype=out_dtype)


@dgrad_op.register_fake
def _(dyq_MN, dys, wq_EKN, ws, counts_E, out_dtype):
    return dyq_MN.new_empty(dyq_MN.shape[0], wq_EKN.shape[1], dtype=out_dtype)


@wgrad_op.register_fake
def _(xq_KM, xs_KM, dyq_NM, dys_NM, counts_E, out_dtype):
    return xq_KM.new_empty(counts_E.shape[0], xq_KM.shape[0], dyq_NM.shape[0], dtype=out_dtype)


TRITON_OPS = {"mm": mm_op, "dgrad": dgrad_op, "wgrad": wgrad_op}
