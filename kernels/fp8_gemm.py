"""FP8 GEMMs for the MoE experts (grouped) and dense linears: forward, input
gradient (dgrad) and weight gradient (wgrad) from quantized operands, fp32
accumulation, output in bf16/fp32/fp16 as asked.

Legend: M rows (tokens x top-k, grouped by expert), K in-features, N out-features,
E experts; `counts_E[e]` rows belong to expert e (zeros allowed; sum = M, not
checked: that needs a host sync).  Suffix `q`: e4m3 codes (torch.float8_e4m3fn);
`s`: their scales.  A scale tensor indexes the same dims as its codes, each
divided (rounding up) by the block length along it, and value ~ code * scale.

Recipes: "blockwise" (Hopper; B = 128, fp32 scales) and "mxfp8" (Blackwell;
B = 32, float8_e8m0fnu scales, blocks along the reduction dim only):

    op      operand      codes     blockwise scales      mxfp8 scales
    mm      x            xq_MK     (M, K/128)  1x128     (M, K/32)
            w            wq_EKN    (E, K/128, N/128)     (E, K/32, N)    32x1, along K
    dgrad   dy           dyq_MN    (M, N/128)  1x128     (M, N/32)
            w            wq_EKN    the same as for mm    (E, K, N/32)    1x32, along N
    wgrad   x^T          xq_KM     (K, M/128)  1x128     (K, M/32)       (x^T contiguous)
            dy^T         dyq_NM    (N, M/128)  1x128     (N, M/32)

    out_MN = fp8_grouped_mm(xq_MK, xs, wq_EKN, ws, counts_E, recipe="blockwise", backend="triton")
    dx_MK  = fp8_grouped_dgrad(dyq_MN, dys, wq_EKN, ws, counts_E, ...)
    dw_EKN = fp8_grouped_wgrad(xq_KM, xs_KM, dyq_NM, dys_NM, counts_E, ..., out_dtype=torch.float32)
    fp8_linear / fp8_linear_dgrad / fp8_linear_wgrad: the same without E (w_KN, dw_KN)
    scaled_mm_support(device) -> {"scaled_mm_blockwise": bool, "scaled_mm_mxfp8": bool,
                                  "scaled_grouped_mm_mxfp8": bool}

Intended training wiring (the autograd rule comes with the model integration):
forward quantizes x 1xB along K and w per the table; backward quantizes dy twice,
1xB along N (dgrad) and, transposed, 1xB along M (wgrad), and x^T 1xB along M.
Blockwise reuses w's 128x128 codes for dgrad (the block is square); MXFP8 needs
a second quantization of w along N.  For wgrad each expert's rows should be a
multiple of B (`permute_plan(pad_multiple=128)`), so M blocks never straddle
experts; the Triton kernel and the emulation are right without it (below).

Backends:
- "triton" (blockwise only): ours.  One persistent kernel for mm and dgrad (w^T
  read through swapped code and scale strides, no copy), one for wgrad, the
  structure of `grouped_gemm_triton.py`: counts_E read on the device, no host
  sync, empty experts give exact zeros in wgrad.  BLOCK_K = 128 = the scale
  block, so each K step is one FP8 `tl.dot` (fp32 result) scaled by one
  activation scale per row times one weight scale per (K block, column) and
  added to an fp32 accumulator: `acc += dot(a, b) * (a_s[:, None] * b_s[None, :])`.
  This is also the promotion that keeps Hopper's reduced-precision FP8 tensor-core
  accumulation to 128-long runs.  wgrad walks the global 128-row blocks that
  overlap the expert and masks rows outside it, so an unaligned expert is still
  right (the scale of a shared block covers both experts' rows).  Only those
  (at most two) shared blocks are masked along M: an M mask on the interior
  blocks would keep Triton from pipelining the loads (sm_90 compile: 32 KB of
  shared memory, one stage, instead of 128 KB).
- Hopper's fp8 wgmma reads both operands K-major.  wgrad's x^T and dy^T and
  dgrad's w^T (from w_EKN, N contiguous) are; forward's w_EKN is not, and
  Triton transposes its tiles through registers (sm_90 compile: 80 KB of shared
  memory at 4 stages vs dgrad's 128 KB).  Codes of w as (E, N, K) passed as a
  `.transpose(1, 2)` view flip which of the two is served K-major; a quantizer
  that writes both layouts serves both (not measured on a GPU yet).
- "torch": `torch._scaled_mm` (dense; grouped blockwise and grouped MXFP8 wgrad
  as a per-expert loop with a host sync) and `torch._scaled_grouped_mm` (grouped
  MXFP8 mm/dgrad; expert rows must be multiples of 128, asserted on the device).
  Which of these work is decided by `scaled_mm_support(device)`, a probe that
  runs our torch path on tiny inputs and compares it with the emulation, cached
  per device; never a version string.  Scale layouts follow cuBLAS: 1x128 scales
  outer-dim-major, 128x128 ones K-block-major with rows padded to 4, MXFP8 scales
  swizzled into 128x4 tiles.  Selecting a path the probe found missing raises,
  naming it and why.
- "emulate": dequantize to fp32 (the values the recipe stands for), GEMM in fp64
  per expert, round once to out_dtype.  The numerics reference on any machine.
- The dense ops are the grouped ones with E = 1 (counts = [M], made on the
  device) for "triton" and "emulate": one kernel to tune and test.
- CPU: the Triton kernels run under the interpreter (TRITON_INTERPRET=1 set
  before this module is imported).  Triton 3.9's interpreter computes fp8
  `tl.dot` correctly (checked against an fp32 matmul of the codes), so the fp8
  tiles go to `tl.dot` unchanged there too: the same code path and math as on
  a GPU.  The interpreter truncates fp32 -> bf16 (a GPU rounds), so bf16 output
  there is within one bf16 ulp, not half.
- Importing this module needs `triton` (as `grouped_gemm_triton.py` does).
"""

from __future__ import annotations

import functools

import torch

from moevlm.kernels import _common as common
from moevlm.kernels._common import cdiv, num_programs, require_triton, tl
from moevlm.kernels.grouped_gemm_triton import _expert_rows, _pick

# what other packages import (moevlm, bench, tests)
__all__ = [
    "BLOCK",
    "dequantize",
    "fp8_grouped_dgrad",
    "fp8_grouped_mm",
    "fp8_grouped_wgrad",
    "fp8_linear",
    "fp8_linear_dgrad",
    "fp8_linear_wgrad",
    "scaled_mm_support",
    "unquantized_reference",
]

triton = require_triton("the triton fp8 GEMM")
E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
BLOCK = {"blockwise": 128, "mxfp8": 32}  # scale block along the reduction dim
_SCALE_DTYPE = {"blockwise": torch.float32, "mxfp8": E8M0}
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OPS = ("mm", "dgrad", "wgrad")
BACKENDS = ("triton", "torch", "emulate")


# ------------------------------------------------------------------- kernels
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


# ------------------------------------------------------------ triton launchers
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


# ---------------------------------------------------------------- custom ops
@torch.library.custom_op("moevlm::fp8_grouped_mm_blockwise", mutates_args=())
def _mm_op(
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
def _dgrad_op(
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
def _wgrad_op(
    xq_KM: torch.Tensor,
    xs_KM: torch.Tensor,
    dyq_NM: torch.Tensor,
    dys_NM: torch.Tensor,
    counts_E: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return _launch_wgrad(xq_KM, xs_KM, dyq_NM, dys_NM, counts_E, out_dtype)


@_mm_op.register_fake
def _(xq_MK, xs, wq_EKN, ws, counts_E, out_dtype):
    return xq_MK.new_empty(xq_MK.shape[0], wq_EKN.shape[2], dtype=out_dtype)


@_dgrad_op.register_fake
def _(dyq_MN, dys, wq_EKN, ws, counts_E, out_dtype):
    return dyq_MN.new_empty(dyq_MN.shape[0], wq_EKN.shape[1], dtype=out_dtype)


@_wgrad_op.register_fake
def _(xq_KM, xs_KM, dyq_NM, dys_NM, counts_E, out_dtype):
    return xq_KM.new_empty(counts_E.shape[0], xq_KM.shape[0], dyq_NM.shape[0], dtype=out_dtype)


_TRITON_OPS = {"mm": _mm_op, "dgrad": _dgrad_op, "wgrad": _wgrad_op}


# ------------------------------------------------------------------ emulation
def _blocks(op: str, recipe: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """Block shapes of the two operands' scales (the weight's without E)."""
    B = BLOCK[recipe]
    if op == "wgrad":
        return (1, B), (1, B)
    if recipe == "blockwise":
        return (1, B), (B, B)
    return (1, B), ((B, 1) if op == "mm" else (1, B))


def unquantized_reference(op: str, x, w, dy, counts: list[int] | None) -> torch.Tensor:
    """What an op approximates, from the high-precision operands, in fp64: mm x @ w[e], dgrad dy @ w[e]^T,
    wgrad x[rows of e]^T @ dy[rows of e]; `counts` None for the dense op (w 2-D)."""
    x, w, dy = x.double(), w.double(), dy.double()
    if counts is None:
        return {"mm": x @ w, "dgrad": dy @ w.T, "wgrad": x.T @ dy}[op]
    xs, dys = x.split(counts), dy.split(counts)
    if op == "wgrad":
        return torch.stack([xe.T @ de for xe, de in zip(xs, dys)])
    return torch.cat(
        [xe @ w[e] if op == "mm" else de @ w[e].T for e, (xe, de) in enumerate(zip(xs, dys))]
    )


def dequantize(q: torch.Tensor, s: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """fp32 values of codes `q` whose scales `s` cover blocks of shape `block` (trailing dims of q)."""
    s = s.float()
    for dim, b in zip(range(q.dim() - len(block), q.dim()), block):
        if b > 1:
            s = s.repeat_interleave(b, dim).narrow(dim, 0, q.shape[dim])
    return q.float() * s


def _emulate(op, recipe, a, a_s, b, b_s, counts_E, out_dtype):
    a_block, b_block = _blocks(op, recipe)
    a = dequantize(a, a_s, a_block).double()
    b = dequantize(b, b_s, b_block).double()
    counts = counts_E.tolist()
    if op == "wgrad":  # a = x^T (K, M), b = dy^T (N, M)
        parts = [xe @ ye.T for xe, ye in zip(a.split(counts, 1), b.split(counts, 1))]
        return (
            torch.stack(parts).to(out_dtype)
            if parts
            else a.new_empty(0, a.shape[0], b.shape[0], dtype=out_dtype)
        )
    w = b if op == "mm" else b.transpose(1, 2)
    return torch.cat([ae @ w[e] for e, ae in enumerate(a.split(counts))]).to(out_dtype)


# -------------------------------------------------------------- torch scaled mm
def _row_major(t):
    return t if t.stride(1) == 1 and t.stride(0) >= max(t.shape[1], 1) else t.contiguous()


def _col_major(t):
    return t if t.stride(0) == 1 and t.stride(1) >= max(t.shape[0], 1) else t.t().contiguous().t()


def _outer_dim_major(s):  # 1x128 scales: the non-reduced dim fastest
    return s if s.stride(0) == 1 else s.t().contiguous().t()


def _scale_128x128(s_RC):
    """(R, C) scales of (reduction, output) 128-blocks with stride (1, R rounded up to 4), as cuBLAS wants."""
    R, C = s_RC.shape
    buf = s_RC.new_zeros(C, cdiv(R, 4) * 4)
    buf[:, :R] = s_RC.t()
    return buf[:, :R].t()


def _swizzle_mx(s):
    """MXFP8 scales (..., rows, cols) -> (..., n) in cuBLAS's blocked layout: rows padded to 128 and cols to 4;
    in each 128x4 tile, element (32a + b, c) goes to offset 16b + 4a + c; tiles row-block-major."""
    *lead, R, C = s.shape
    Rp, Cp = cdiv(R, 128) * 128, cdiv(C, 4) * 4
    u = torch.nn.functional.pad(s.view(torch.uint8), (0, Cp - C, 0, Rp - R))
    u = u.view(*lead, Rp // 128, 4, 32, Cp // 4, 4)
    d = len(lead)
    u = u.permute(*range(d), d, d + 3, d + 2, d + 1, d + 4)  # (row block, col block, b, a, c)
    return u.reshape(*lead, -1).view(s.dtype)


def _scaled_mm_torch(recipe, a, a_s, bt, bt_s, out_dtype, square_b=False):
    """a (rows, red) @ bt (cols, red)^T.  a_s (rows, red/B); bt_s (cols, red/B), or with square_b the 128x128
    scales (red/128, cols/128)."""
    if recipe == "mxfp8":
        sa, sb = _swizzle_mx(a_s), _swizzle_mx(bt_s)
    else:
        sa = _outer_dim_major(a_s)
        sb = _scale_128x128(bt_s) if square_b else bt_s.t().contiguous()
    return torch._scaled_mm(_row_major(a), _col_major(bt.t()), sa, sb, out_dtype=out_dtype)


def _torch_dense(op, recipe, a, a_s, b, b_s, out_dtype):
    square = recipe == "blockwise"
    if op == "mm":  # b = w_KN
        return _scaled_mm_torch(
            recipe, a, a_s, b.t(), b_s if square else b_s.t(), out_dtype, square
        )
    if op == "dgrad":  # dx = dy @ w^T: bt = w_KN
        return _scaled_mm_torch(recipe, a, a_s, b, b_s.t() if square else b_s, out_dtype, square)
    # wgrad: x^T (K, M) @ (dy^T (N, M))^T
    return _scaled_mm_torch(recipe, a, a_s, b, b_s, out_dtype)


def _torch_grouped(op, recipe, a, a_s, b, b_s, counts_E, out_dtype):
    if recipe == "mxfp8" and op != "wgrad":
        return _scaled_grouped_mm_mx(op, a, a_s, b, b_s, counts_E, out_dtype)
    counts = counts_E.tolist()  # host sync: one _scaled_mm per expert
    if op != "wgrad":
        parts = [
            _torch_dense(op, recipe, ae, se, b[e], b_s[e], out_dtype)
            for e, (ae, se) in enumerate(zip(a.split(counts), a_s.split(counts)))
            if counts[e]
        ]
        return (
            torch.cat(parts)
            if parts
            else a.new_empty(0, b.shape[2 if op == "mm" else 1], dtype=out_dtype)
        )
    B, start, dw = BLOCK[recipe], 0, []
    for c in counts:
        if start % B or (c % B and start + c != a.shape[1]):
            raise ValueError(
                f"fp8 wgrad backend='torch' needs every expert's rows to start on a {B}-row scale "
                f"block (counts {counts}); pad them (permute_plan(pad_multiple=128)) or use 'triton'"
            )
        sl, bl = slice(start, start + c), slice(start // B, cdiv(start + c, B))
        dw.append(
            _torch_dense("wgrad", recipe, a[:, sl], a_s[:, bl], b[:, sl], b_s[:, bl], out_dtype)
            if c
            else a.new_zeros(a.shape[0], b.shape[0], dtype=out_dtype)
        )
        start += c
    return torch.stack(dw) if dw else a.new_empty(0, a.shape[0], b.shape[0], dtype=out_dtype)


def _scaled_grouped_mm_mx(op, a, a_s, b, b_s, counts_E, out_dtype):
    if out_dtype != torch.bfloat16:
        raise ValueError(f"torch._scaled_grouped_mm writes bf16 only; got out_dtype={out_dtype}")
    torch._assert_async(
        (counts_E % 128 == 0).all(),
        "fp8 grouped mxfp8 backend='torch' needs expert rows in "
        "multiples of 128 (permute_plan(pad_multiple=128))",
    )
    sa = _swizzle_mx(a_s).view(-1, cdiv(a_s.shape[1], 4) * 4)
    if op == "mm":  # w_EKN as (E, K, N) column-major; scales of each w[e]^T (N, K/32)
        bt, bt_s = b.transpose(1, 2), b_s.transpose(1, 2)
    else:  # dgrad: w[e]^T (N, K) is the right operand; its transpose w[e] (K, N) with scales (K, N/32)
        bt, bt_s = b, b_s
    mat_b = bt.transpose(1, 2)
    if not (mat_b.stride(1) == 1 and mat_b.stride(2) >= mat_b.shape[1]):
        mat_b = bt.contiguous().transpose(1, 2)
    return torch._scaled_grouped_mm(
        _row_major(a),
        mat_b,
        sa,
        _swizzle_mx(bt_s.contiguous()),
        offs=counts_E.cumsum(0, dtype=torch.int32),
        out_dtype=out_dtype,
    )


# ------------------------------------------------------------------------ probe
_PROBES = {  # key -> (what the torch path needs, recipe, grouped)
    "scaled_mm_blockwise": (
        "torch._scaled_mm with blockwise 1x128/128x128 fp32 scales",
        "blockwise",
        False,
    ),
    "scaled_mm_mxfp8": ("torch._scaled_mm with MXFP8 1x32 float8_e8m0fnu scales", "mxfp8", False),
    "scaled_grouped_mm_mxfp8": (
        "torch._scaled_grouped_mm with MXFP8 1x32 float8_e8m0fnu scales",
        "mxfp8",
        True,
    ),
}


def _probe_operands(op, recipe, grouped, device):
    """Random codes and scales of the tiny probe problem, already on `device` (M = 256, K = N = 256)."""
    g = torch.Generator().manual_seed(0)
    M = K = N = 256
    counts = (
        torch.tensor([128, 128], dtype=torch.int32)
        if grouped
        else torch.tensor([M], dtype=torch.int32)
    )
    E = counts.numel()
    a_shape = {"mm": (M, K), "dgrad": (M, N), "wgrad": (K, M)}[op]
    b_shape = (N, M) if op == "wgrad" else (E, K, N)
    a_block, b_block = _blocks(op, recipe)
    b_block = b_block if op == "wgrad" else (1, *b_block)
    out = []
    for shape, block in ((a_shape, a_block), (b_shape, b_block)):
        q = torch.randn(shape, generator=g).to(E4M3)
        s_shape = tuple(cdiv(d, bl) for d, bl in zip(shape, block))
        # powers of two: e8m0 too
        s = torch.exp2(torch.randint(-3, 4, s_shape, generator=g).float())
        out += [q.to(device), s.to(_SCALE_DTYPE[recipe]).to(device)]
    if not grouped and op != "wgrad":
        out[2], out[3] = out[2][0], out[3][0]
    return (*out, counts.to(device))


def _probe_one(key: str, device: str) -> tuple[bool, str]:
    _, recipe, grouped = _PROBES[key]
    worst = 0.0
    try:
        for op in ("mm", "dgrad") if grouped else _OPS:
            a, a_s, b, b_s, counts = _probe_operands(op, recipe, grouped, device)
            if grouped:
                got = _torch_grouped(op, recipe, a, a_s, b, b_s, counts, torch.bfloat16)
            else:
                got = _torch_dense(op, recipe, a, a_s, b, b_s, torch.bfloat16)
            want = _emulate(
                op,
                recipe,
                a,
                a_s,
                *((b, b_s) if grouped or op == "wgrad" else (b.unsqueeze(0), b_s.unsqueeze(0))),
                counts,
                torch.float32,
            )
            worst = max(worst, float((got.float() - want.reshape(got.shape)).norm() / want.norm()))
    except Exception as e:  # refused, not implemented on this device, ...: missing
        return (
            False,
            f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}",
        )
    if worst > 1e-2:  # bf16 output: ~2e-3; a misread scale layout: O(1)
        return False, f"ran, but disagreed with the emulation (relative error {worst:.2g})"
    return True, f"agrees with the emulation (relative error {worst:.2g})"


@functools.cache
def _probe(device: str) -> dict[str, tuple[bool, str]]:
    return {key: _probe_one(key, device) for key in _PROBES}


def _device_key(device) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def scaled_mm_support(device) -> dict[str, bool]:
    """Which torch scaled-GEMM paths run, and agree with the emulation, on `device` (probed once per device)."""
    return {key: ok for key, (ok, _) in _probe(_device_key(device)).items()}


def _require_torch_path(op, recipe, grouped, device):
    key = (
        "scaled_grouped_mm_mxfp8"
        if grouped and recipe == "mxfp8" and op != "wgrad"
        else f"scaled_mm_{recipe}"
    )
    ok, why = _probe(_device_key(device))[key]
    if not ok:
        other = "backend='triton' or 'emulate'" if recipe == "blockwise" else "backend='emulate'"
        raise RuntimeError(
            f"fp8 {'grouped' if grouped else 'dense'} {op} ({recipe}) with backend='torch' needs "
            f"{_PROBES[key][0]}, which the probe found missing on {device} ({why}); use {other}"
        )


# ----------------------------------------------------------------- entry points
def _check(op, recipe, backend, a, a_s, b, b_s, counts_E, out_dtype, grouped):
    name = f"fp8 {'grouped ' if grouped else ''}{op}"
    if recipe not in BLOCK or backend not in BACKENDS:
        raise ValueError(
            f"{name}: recipe {recipe!r} / backend {backend!r}; choose a recipe among {sorted(BLOCK)} "
            f"and a backend among {BACKENDS}"
        )
    if backend == "triton" and recipe != "blockwise":
        raise ValueError(
            f"{name}: the triton backend is blockwise only; use backend='torch' or 'emulate' for "
            f"{recipe}"
        )
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{name}: out_dtype {out_dtype} is not one of {_OUT_DTYPES}")
    b_dims = 2 if op == "wgrad" or not grouped else 3
    if a.dim() != 2 or b.dim() != b_dims:
        raise ValueError(
            f"{name}: codes must be 2-D and {b_dims}-D; got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    red = {
        "mm": (a.shape[1], b.shape[-2]),
        "dgrad": (a.shape[1], b.shape[-1]),
        "wgrad": (a.shape[1], b.shape[1]),
    }
    if red[op][0] != red[op][1]:
        raise ValueError(
            f"{name}: codes {tuple(a.shape)} and {tuple(b.shape)} disagree on the reduction dim"
        )
    a_block, b_block = _blocks(op, recipe)
    for what, q, s, block in (("left", a, a_s, a_block), ("right", b, b_s, b_block)):
        want = (*q.shape[: q.dim() - 2], *(cdiv(d, bl) for d, bl in zip(q.shape[-2:], block)))
        if q.dtype != E4M3 or s.dtype != _SCALE_DTYPE[recipe] or tuple(s.shape) != want:
            raise ValueError(
                f"{name} ({recipe}): {what} operand wants {E4M3} codes with {_SCALE_DTYPE[recipe]} "
                f"scales of shape {want} (blocks {block}); got {q.dtype} {tuple(q.shape)} codes, "
                f"{s.dtype} {tuple(s.shape)} scales"
            )
    if grouped:
        E = b.shape[0] if op != "wgrad" else counts_E.shape[0]
        if (
            counts_E.dim() != 1
            or counts_E.shape[0] != E
            or counts_E.dtype not in (torch.int32, torch.int64)
        ):
            raise ValueError(
                f"{name}: counts_E must be int32/int64 of shape ({E},); got {counts_E.dtype} "
                f"{tuple(counts_E.shape)}"
            )
    devices = {t.device for t in (a, a_s, b, b_s, *((counts_E,) if grouped else ()))}
    if len(devices) > 1:
        raise ValueError(f"{name}: operands on {sorted(map(str, devices))}; put them on one device")


def _gemm(op, a, a_s, b, b_s, counts_E, recipe, backend, out_dtype, grouped):
    _check(op, recipe, backend, a, a_s, b, b_s, counts_E, out_dtype, grouped)
    if backend == "torch":
        _require_torch_path(op, recipe, grouped, a.device)
        if grouped:
            return _torch_grouped(op, recipe, a, a_s, b, b_s, counts_E, out_dtype)
        return _torch_dense(op, recipe, a, a_s, b, b_s, out_dtype)
    if not grouped:  # one expert owning every row
        if op != "wgrad":
            b, b_s = b.unsqueeze(0), b_s.unsqueeze(0)
        counts_E = torch.full(
            (1,), a.shape[1 if op == "wgrad" else 0], dtype=torch.int32, device=a.device
        )
    if backend == "emulate":
        out = _emulate(op, recipe, a, a_s, b, b_s, counts_E, out_dtype)
    else:
        out = _TRITON_OPS[op](a, a_s, b, b_s, counts_E, out_dtype)
    return out if grouped or op != "wgrad" else out[0]


def fp8_grouped_mm(
    xq_MK,
    xs,
    wq_EKN,
    ws,
    counts_E,
    *,
    recipe="blockwise",
    backend="triton",
    out_dtype=torch.bfloat16,
):
    """out_MN[rows of e] = x[rows of e] @ w[e] from codes and scales (module docstring's table)."""
    return _gemm("mm", xq_MK, xs, wq_EKN, ws, counts_E, recipe, backend, out_dtype, grouped=True)


def fp8_grouped_dgrad(
    dyq_MN,
    dys,
    wq_EKN,
    ws,
    counts_E,
    *,
    recipe="blockwise",
    backend="triton",
    out_dtype=torch.bfloat16,
):
    """dx_MK[rows of e] = dy[rows of e] @ w[e]^T; blockwise ws as in forward, mxfp8 ws 1x32 along N."""
    return _gemm(
        "dgrad", dyq_MN, dys, wq_EKN, ws, counts_E, recipe, backend, out_dtype, grouped=True
    )


def fp8_grouped_wgrad(
    xq_KM,
    xs_KM,
    dyq_NM,
    dys_NM,
    counts_E,
    *,
    recipe="blockwise",
    backend="triton",
    out_dtype=torch.float32,
):
    """dw_EKN[e] = x[rows of e]^T @ dy[rows of e], from x^T and dy^T quantized 1xB along M."""
    return _gemm(
        "wgrad", xq_KM, xs_KM, dyq_NM, dys_NM, counts_E, recipe, backend, out_dtype, grouped=True
    )


def fp8_linear(
    xq_MK, xs, wq_KN, ws, *, recipe="blockwise", backend="triton", out_dtype=torch.bfloat16
):
    """out_MN = x @ w (w_KN: nn.Linear's weight transposed)."""
    return _gemm("mm", xq_MK, xs, wq_KN, ws, None, recipe, backend, out_dtype, grouped=False)


def fp8_linear_dgrad(
    dyq_MN, dys, wq_KN, ws, *, recipe="blockwise", backend="triton", out_dtype=torch.bfloat16
):
    """dx_MK = dy @ w^T."""
    return _gemm("dgrad", dyq_MN, dys, wq_KN, ws, None, recipe, backend, out_dtype, grouped=False)


def fp8_linear_wgrad(
    xq_KM, xs_KM, dyq_NM, dys_NM, *, recipe="blockwise", backend="triton", out_dtype=torch.float32
):
    """dw_KN = x^T @ dy, from x^T and dy^T quantized 1xB along M."""
    return _gemm(
        "wgrad", xq_KM, xs_KM, dyq_NM, dys_NM, None, recipe, backend, out_dtype, grouped=False
    )
