"""FP8 quantization, the Triton kernels: one quantize and one dequantize kernel for every tile layout,
registered as torch custom ops with fakes.  Bit-identical to fp8_quant_ref.py.

Legend: G groups (experts, else 1), R rows, C columns; a tile is (1, b), (b, 1) or (b, b) and a
program owns a block of whole tiles (BLOCK_R x BLOCK_C).  Inputs and outputs are read and written
through their strides, so a transposed output is only other strides.

    torch.ops.moevlm.fp8_quant_blockwise_act(x_MK, 128, pow2)      # -> (codes_MK, scales)
    ..._act_t, _weight, fp8_quant_mxfp8(x, 32, dim), fp8_dequant_blockwise, fp8_dequant_mxfp8

Importing this needs no triton (the kernels stay plain functions without it; fp8_quant.py refuses
backend="triton" then).
"""

from __future__ import annotations

import torch
from moevlm.kernels._common import cdiv, jit, tl, triton  # triton, tl: None without triton
from moevlm.kernels.fp8_quant_ref import E8M0, FP8, as_grc, mx_scale_shape, mx_tile, mx_view

__all__ = [
    "dequant_mx_op",
    "dequant_op",
    "quant_act_op",
    "quant_act_t_op",
    "quant_mx_op",
    "quant_weight_op",
]

_TILE_ELEMS = 4096  # elements a quantize program owns when its tiles are thin (1 x b or b x 1)


@jit
def _e4m3_bits(v, is_nan):
    """fp32 -> e4m3fn bit pattern (int32 in [0, 255]): saturate to +-448, round to nearest even; 0x7F where
    `is_nan`.  Integer only (bit-exact to torch's cast everywhere)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = tl.where(bits < 0, 0x80, 0)
    a = tl.minimum(bits & 0x7FFFFFFF, 0x43E00000)  # |v| saturated at 448 (bit order = value order)
    exp = a >> 23
    # |v| >= 2^-6: keep 3 of 23 mantissa bits, ties to even (a carry moves into the exponent); rebias 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # |v| < 2^-6: the code is |v| * 2^9 rounded to an integer, ties to even; |v| = mant * 2^(exp - 150)
    mant = tl.where(exp > 0, (a & 0x7FFFFF) | 0x800000, a)
    shift = tl.minimum(141 - tl.maximum(exp, 1), 25)  # past 25 the result is 0 anyway (mant < 2^24)
    q = mant >> shift
    rem = mant - (q << shift)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    return tl.where(is_nan, 0x7F, sign | tl.where(exp >= 121, normal, sub))


@jit
def _nan_like(x):
    """fp32 NaN (0x7FC00000, the bits of torch.nan) in x's shape."""
    return tl.full(x.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


@jit
def _e4m3_value(b):
    """e4m3fn bit pattern (int32) -> fp32, exactly; NaN for 0x7F / 0xFF."""
    normal = (((b & 0x7F) << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    sub = (b & 7).to(tl.float32) * 0.001953125  # 2^-9
    mag = tl.where((b & 0x78) == 0, sub, normal)
    mag = tl.where((b & 0x7F) == 0x7F, _nan_like(mag), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@jit
def _block_offsets(pid, G, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program pid of a flat grid over (G, R blocks, C blocks) -> (g, block row, block col)."""
    nr = tl.cdiv(R, BLOCK_R)
    nc = tl.cdiv(C, BLOCK_C)
    return pid // (nr * nc), (pid // nc) % nr, pid % nc


@jit
def _quant_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    G,
    R,
    C,
    sx_g,
    sx_r,
    sx_c,
    sq_g,
    sq_r,
    sq_c,
    ss_g,
    ss_r,
    ss_c,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    MX: tl.constexpr,
    POW2: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    g, br, bc = _block_offsets(tl.program_id(0), G, R, C, BLOCK_R, BLOCK_C)
    rows = br * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = bc * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    g64 = g.to(tl.int64)
    x = tl.load(
        x_ptr + g64 * sx_g + rows.to(tl.int64)[:, None] * sx_r + cols.to(tl.int64)[None, :] * sx_c,
        mask=mask,
        other=0,
    )
    # bf16 read as int16: its bits are the top half of the fp32's (exact, subnormals included)
    if BF16_BITS:
        x = ((x.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        x = x.to(tl.float32)
    amax_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # masked-off elements are +0
    if TILE_R > 1:  # a tile spans the block's rows (TILE_R == BLOCK_R), else one row
        amax_bits = tl.max(amax_bits, axis=0, keep_dims=True)
    if TILE_C > 1:
        amax_bits = tl.max(amax_bits, axis=1, keep_dims=True)
    bad = amax_bits >= 0x7F800000  # a NaN or an Inf in the tile
    if MX:
        byte = tl.maximum((amax_bits >> 23) - 8, 0)  # e + 127, e = floor(log2 amax) - 8
        scaled = x * ((254 - byte) << 23).to(tl.float32, bitcast=True)  # x * 2^-e, exact
        scale_out = tl.where(bad, 0xFF, byte).to(tl.uint8)
    else:
        amax = amax_bits.to(tl.float32, bitcast=True)
        # 2^-126
        s = tl.maximum(
            tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.1754943508222875e-38
        )
        if POW2:
            s_bits = s.to(tl.int32, bitcast=True)
            s_bits = tl.where((s_bits & 0x7FFFFF) != 0, (s_bits & 0x7F800000) + 0x800000, s_bits)
            s = s_bits.to(tl.float32, bitcast=True)
        s = tl.where(amax_bits == 0, 1.0, s)
        s = tl.where(bad, _nan_like(s), s)
        scaled = tl.div_rn(x, tl.broadcast_to(s, x.shape))
        scale_out = s
    codes = _e4m3_bits(scaled, tl.broadcast_to(bad, x.shape)).to(tl.uint8)
    tl.store(
        codes_ptr
        + g64 * sq_g
        + rows.to(tl.int64)[:, None] * sq_r
        + cols.to(tl.int64)[None, :] * sq_c,
        codes,
        mask=mask,
    )
    SR: tl.constexpr = BLOCK_R // TILE_R
    SC: tl.constexpr = BLOCK_C // TILE_C
    srows = br * SR + tl.arange(0, SR)
    scols = bc * SC + tl.arange(0, SC)
    smask = (srows < tl.cdiv(R, TILE_R))[:, None] & (scols < tl.cdiv(C, TILE_C))[None, :]
    tl.store(
        scales_ptr
        + g64 * ss_g
        + srows.to(tl.int64)[:, None] * ss_r
        + scols.to(tl.int64)[None, :] * ss_c,
        scale_out,
        mask=smask,
    )


@jit
def _dequant_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    G,
    R,
    C,
    sq_g,
    sq_r,
    sq_c,
    ss_g,
    ss_r,
    ss_c,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    MX: tl.constexpr,
):
    g, br, bc = _block_offsets(tl.program_id(0), G, R, C, BLOCK_R, BLOCK_C)
    rows = br * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = bc * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    g64, r64, c64 = g.to(tl.int64), rows.to(tl.int64), cols.to(tl.int64)
    b = tl.load(
        codes_ptr + g64 * sq_g + r64[:, None] * sq_r + c64[None, :] * sq_c, mask=mask, other=0
    )
    b = b.to(tl.int32) & 0xFF
    s = tl.load(
        scales_ptr + g64 * ss_g + (r64 // TILE_R)[:, None] * ss_r + (c64 // TILE_C)[None, :] * ss_c,
        mask=mask,
        other=0,
    )  # per element: a gather the cache serves
    if MX:  # e8m0 byte -> 2^(byte - 127); byte 0 is the fp32 subnormal 2^-127, 0xFF is NaN
        byte = s.to(tl.int32) & 0xFF  # whether u8 -> i32 sign-extends or not
        s = tl.where(byte == 0, 0x400000, byte << 23).to(tl.float32, bitcast=True)
        s = tl.where(byte == 0xFF, _nan_like(s), s)
    tl.store(out_ptr + g64 * R * C + r64[:, None] * C + c64[None, :], _e4m3_value(b) * s, mask=mask)


# ---------------------------------------------------------------- launchers


def _blocks(tile: tuple[int, int], R: int, C: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C): whole tiles; a thin tile is stacked to ~_TILE_ELEMS elements (fewer for small inputs)."""
    tr, tc = tile
    if tr > 1 and tc > 1:
        return tr, tc
    if tr == 1:
        return max(1, min(triton.next_power_of_2(R), _TILE_ELEMS // tc)), tc
    return tr, max(1, min(triton.next_power_of_2(C), _TILE_ELEMS // tr))


def _launch_quant(x_GRC, tile, codes_GRC, scales_GRbCb, mx: bool, pow2: bool) -> None:
    """Quantize x (G, R, C) into codes (an fp8 tensor's view, any strides) and scales (G, Rb, Cb views)."""
    G, R, C = x_GRC.shape
    if x_GRC.numel() == 0:
        return
    br, bc = _blocks(tile, R, C)
    grid = (G * cdiv(R, br) * cdiv(C, bc),)
    scales = scales_GRbCb.view(torch.uint8) if mx else scales_GRbCb
    bf16 = x_GRC.dtype == torch.bfloat16
    _quant_kernel[grid](
        x_GRC.view(torch.int16) if bf16 else x_GRC,
        codes_GRC.view(torch.uint8),
        scales,
        G,
        R,
        C,
        *x_GRC.stride(),
        *codes_GRC.stride(),
        *scales.stride(),
        TILE_R=tile[0],
        TILE_C=tile[1],
        BLOCK_R=br,
        BLOCK_C=bc,
        MX=mx,
        POW2=pow2,
        BF16_BITS=bf16,
        num_warps=8 if br * bc > _TILE_ELEMS else 4,
    )


def _launch_dequant(codes_GRC, scales_GRbCb, tile, mx: bool) -> torch.Tensor:
    G, R, C = codes_GRC.shape
    out = torch.empty(G, R, C, dtype=torch.float32, device=codes_GRC.device)
    if out.numel() == 0:
        return out
    br, bc = _blocks((1, 128), R, C)  # any block works: scales are gathered per element
    scales = scales_GRbCb.view(torch.uint8) if mx else scales_GRbCb
    _dequant_kernel[(G * cdiv(R, br) * cdiv(C, bc),)](
        codes_GRC.view(torch.uint8),
        scales,
        out,
        G,
        R,
        C,
        *codes_GRC.stride(),
        *scales.stride(),
        TILE_R=tile[0],
        TILE_C=tile[1],
        BLOCK_R=br,
        BLOCK_C=bc,
        MX=mx,
    )
    return out


def _empty_codes(shape, like):
    return torch.empty(shape, dtype=FP8, device=like.device)


# ---------------------------------------------------------------- custom ops


@torch.library.custom_op("moevlm::fp8_quant_blockwise_act", mutates_args=())
def quant_act_op(
    x_MK: torch.Tensor, block: int, pow2_scales: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    (M, K) = x_MK.shape
    codes, scales = (
        _empty_codes((M, K), x_MK),
        x_MK.new_empty(M, cdiv(K, block), dtype=torch.float32),
    )
    _launch_quant(
        x_MK.unsqueeze(0), (1, block), codes.unsqueeze(0), scales.unsqueeze(0), False, pow2_scales
    )
    return codes, scales


@torch.library.custom_op("moevlm::fp8_quant_blockwise_act_t", mutates_args=())
def quant_act_t_op(
    x_MK: torch.Tensor, block: int, pow2_scales: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    (M, K) = x_MK.shape
    codes_KM, scales = (
        _empty_codes((K, M), x_MK),
        x_MK.new_empty(K, cdiv(M, block), dtype=torch.float32),
    )
    # x read as (1, M, K) with (block, 1) tiles; codes and scales written through their transposes
    _launch_quant(
        x_MK.unsqueeze(0),
        (block, 1),
        codes_KM.t().unsqueeze(0),
        scales.t().unsqueeze(0),
        False,
        pow2_scales,
    )
    return codes_KM, scales


@torch.library.custom_op("moevlm::fp8_quant_blockwise_weight", mutates_args=())
def quant_weight_op(
    w: torch.Tensor, block: int, pow2_scales: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    codes = _empty_codes(w.shape, w)
    scales = w.new_empty(
        *w.shape[:-2], cdiv(w.shape[-2], block), cdiv(w.shape[-1], block), dtype=torch.float32
    )
    _launch_quant(as_grc(w), (block, block), as_grc(codes), as_grc(scales), False, pow2_scales)
    return codes, scales


@torch.library.custom_op("moevlm::fp8_quant_mxfp8", mutates_args=())
def quant_mx_op(x: torch.Tensor, block: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    x_GRC, dim = mx_view(x, dim)
    codes = _empty_codes(x.shape, x)
    scales = torch.empty(mx_scale_shape(x.shape, dim, block), dtype=E8M0, device=x.device)
    _launch_quant(
        x_GRC, mx_tile(dim, block), mx_view(codes, dim)[0], mx_view(scales, dim)[0], True, False
    )
    return codes, scales


@torch.library.custom_op("moevlm::fp8_dequant_blockwise", mutates_args=())
def dequant_op(codes: torch.Tensor, scales: torch.Tensor, block: int, layout: str) -> torch.Tensor:
    tile = (block, block) if layout == "weight" else (1, block)
    return _launch_dequant(as_grc(codes), as_grc(scales), tile, False).view(codes.shape)


@torch.library.custom_op("moevlm::fp8_dequant_mxfp8", mutates_args=())
def dequant_mx_op(codes: torch.Tensor, scales: torch.Tensor, block: int, dim: int) -> torch.Tensor:
    codes_GRC, dim = mx_view(codes, dim)
    return _launch_dequant(codes_GRC, mx_view(scales, dim)[0], mx_tile(dim, block), True).view(
        codes.shape
    )


@quant_act_op.register_fake
def _(x_MK, block, pow2_scales):
    M, K = x_MK.shape
    return x_MK.new_empty(M, K, dtype=FP8), x_MK.new_empty(M, cdiv(K, block), dtype=torch.float32)


@quant_act_t_op.register_fake
def _(x_MK, block, pow2_scales):
    M, K = x_MK.shape
    return x_MK.new_empty(K, M, dtype=FP8), x_MK.new_empty(K, cdiv(M, block), dtype=torch.float32)


@quant_weight_op.register_fake
def _(w, block, pow2_scales):
    scales_shape = (*w.shape[:-2], cdiv(w.shape[-2], block), cdiv(w.shape[-1], block))
    return w.new_empty(w.shape, dtype=FP8), w.new_empty(scales_shape, dtype=torch.float32)


@quant_mx_op.register_fake
def _(x, block, dim):
    dim = -1 if dim in (-1, x.dim() - 1) else dim
    return x.new_empty(x.shape, dtype=FP8), x.new_empty(
        mx_scale_shape(x.shape, dim, block), dtype=E8M0
    )


@dequant_op.register_fake
def _(codes, scales, block, layout):
    return codes.new_empty(codes.shape, dtype=torch.float32)


@dequant_mx_op.register_fake
def _(codes, scales, block, dim):
    return codes.new_empty(codes.shape, dtype=torch.float32)
