"""FP8 quantization for training: blockwise e4m3 (DeepSeek-V3 / Hopper recipe) and
MXFP8 (OCP Microscaling v1.0 / Blackwell recipe), each a torch reference (the spec)
beside a Triton kernel registered as a custom op with a fake.

Legend: M rows (tokens, expert-grouped after permute), K in-features, N
out-features, E experts, b = block (128 blockwise, 32 MX); `Kb` = ceil(K/b) and
so on.  Codes are torch.float8_e4m3fn (max 448); blockwise scales are fp32, MX
scales torch.float8_e8m0fnu (a bare power of two).  x ~= codes * scale per tile.

    codes_MK, scales_MKb = quant_blockwise_act(x_MK)                # 1 x 128 tiles along K
    codes_KN, scales_KbNb = quant_blockwise_weight(w_KN)            # 128 x 128 blocks (or w_EKN)
    codes_KM, scales_KMb = quant_blockwise_act_t(x_MK, counts_E=c)  # x^T, 1 x 128 tiles along M
    x_MK ~= dequant_blockwise(codes_MK, scales_MKb, layout="act")   # "act" | "act_t" | "weight"
    codes, scales_e8m0 = quant_mxfp8(x_MK, dim=-1)                  # 1 x 32 along K (dim=0: 32 x 1 along M)
    x_MK ~= dequant_mxfp8(codes, scales_e8m0, dim=-1)

Every function takes `backend="torch" | "triton"` (torch by default); `*_torch` are
the references.  The Triton backend gives bit-identical codes and scales.

Design choices:
- Tiles.  Activations get 1 x 128 tiles along K (the GEMM's reduction dim, so a
  scale is constant along each dot product's 128-step), weights 128 x 128 blocks
  (one scale per (K, N) block serves every row, and a weight's transpose for
  dgrad reuses the same blocks), MX 1 x 32 (the OCP block size, what Blackwell's
  tensor cores read).  `quant_blockwise_act_t` quantizes x^T (K, M) with 1 x 128
  tiles along M: the operand of the weight gradient dW = x^T dy, which reduces
  over M.  Its codes are the transpose, contiguous; its scales (K, ceil(M/128)).
  For expert-grouped rows, `counts_E` (rows per expert) are checked on the host
  (a sync): every count must be a multiple of the block (permute's
  `pad_multiple=128`), so no tile crosses two experts; `row_block_starts(counts_E)`
  gives each expert's first scale column.  Without counts no check is made.
- Blockwise scale = amax(|tile|) / 448 (fp32, IEEE division), floored at 2^-126
  (the smallest normal fp32: a tile with amax < 448 * 2^-126 ~ 5e-36 never gets a
  subnormal or zero scale).  `pow2_scales`: that scale rounded *up* to a power of
  two (so amax / scale <= 448 and a rescale is an exponent shift).  Codes =
  saturate(x / scale, +-448) cast to e4m3 with round to nearest even (torch's
  cast).  Ragged tails: the last tile is shorter and its amax covers only real
  elements.
- MX: e = floor(log2(amax)) - 8 (8 = e4m3's max exponent), clamped to e8m0's
  [-127, 127] (the upper bound is never reached from fp32 inputs); scale 2^e
  stored as the e8m0 byte e + 127.  Codes = saturate(x * 2^-e, +-448) cast to
  e4m3 (x * 2^-e equals x / 2^e exactly); a block amax with mantissa above
  1.75 saturates to 448, as the spec allows.
- All-zero tile (zeros or -0.0): blockwise scale 1.0 (pow2 too), MX scale 2^-127
  (byte 0x00: e8m0's floor, where the clamp puts log2(0)); codes are zeros with
  the input's sign bit (0x00 or 0x80).  Nothing ever divides by zero.
- NaN/Inf rule: a tile holding any NaN or +-Inf gets a NaN scale (fp32 0x7FC00000;
  e8m0 0xFF) and all its codes NaN (0x7F), so a non-finite check on the scales or
  on dequantized values catches it; other tiles are untouched.  Saturation
  applies only to finite values.  Dequantizing a NaN code or scale gives NaN.
- Dequantize = float32(code) * scale, float32 out, the shape of the codes.
- Triton, bit-exact to torch: the tile amax is an integer max over |x|'s fp32 bit
  patterns (the order of non-negative floats; no NaN-dropping float max), the
  division is `tl.div_rn` (IEEE; `/` lowers to an approximate `div.full.f32` on
  NVIDIA), MX scaling multiplies by an exact power of two, and the e4m3 cast is
  done in integer arithmetic (saturate on the bit pattern, round to nearest
  even), stored as uint8 into a `.view(torch.uint8)` of the fp8 output.  Reason:
  Triton 3.9's interpreter gets `.to(tl.float8e4nv)` wrong (a rounding carry
  into the exponent is lost: 126.96 becomes 64), and the integer path is the same
  on every GPU.  Decoding for dequantize is integer too.  bf16 inputs are read
  as int16 and shifted into fp32's top half: the interpreter decodes bf16
  subnormals wrongly (-1.84e-39 becomes -2.94e-39); a GPU's cvt is the same shift.  No multiply feeds an
  add, so FMA contraction changes nothing.
- One quantize kernel serves every layout: the input is read as (G, R, C) through
  its strides (G = experts, else 1), a tile is (1, b), (b, 1) or (b, b), a
  program owns a block of whole tiles (~4k elements; (b, b) for weights) and
  writes codes and scales through output strides (a transposed output is just
  other strides).  A flat 1-D grid.  Block sizes not tuned on a GPU.
- The Triton backend runs on CUDA tensors, or on CPU under the Triton interpreter
  (TRITON_INTERPRET=1 set before moevlm.kernels is imported; the tests' conftest
  does).  Importing this module does not need triton; asking for
  backend="triton" without it names the package.  Inputs: fp32, fp16, bf16
  (any strides); block sizes must be powers of two for Triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moevlm.kernels import _common as common
from moevlm.kernels._common import (
    FLOAT_DTYPES,
    cdiv,
    jit,
    tl,
    triton,
)  # triton, tl: None without triton

# what other packages import (moevlm, bench, tests)
__all__ = [
    "BACKENDS",
    "dequant_blockwise",
    "dequant_mxfp8",
    "quant_blockwise_act",
    "quant_blockwise_act_t",
    "quant_blockwise_act_t_torch",
    "quant_blockwise_act_torch",
    "quant_blockwise_weight",
    "quant_blockwise_weight_torch",
    "quant_mxfp8",
    "quant_mxfp8_torch",
    "row_block_starts",
]

BACKENDS = ("torch", "triton")
LAYOUTS = ("act", "act_t", "weight")
E4M3_MAX = 448.0
_MIN_SCALE = 2.0**-126  # smallest normal fp32
_FP8 = torch.float8_e4m3fn
_E8M0 = torch.float8_e8m0fnu
_NAN_CODE = 0x7F
_TILE_ELEMS = 4096  # elements a quantize program owns when its tiles are thin (1 x b or b x 1)


# ---------------------------------------------------------------- torch reference (the spec)


def _exp2i(n: torch.Tensor) -> torch.Tensor:
    """2^n as fp32, exactly, for integer n in [-126, 127] (built from the exponent bits)."""
    return ((n.to(torch.int32) + 127) << 23).view(torch.float32)


def _expand(t_GRbCb: torch.Tensor, tile: tuple[int, int], R: int, C: int) -> torch.Tensor:
    """Per-tile values -> per-element (G, R, C)."""
    tr, tc = tile
    return t_GRbCb.repeat_interleave(tr, 1).repeat_interleave(tc, 2)[:, :R, :C]


def _quant_tiles_torch(x_GRC: torch.Tensor, tile: tuple[int, int], mx: bool, pow2: bool):
    """The spec for every layout: (G, R, C) in, tiles (tr, tc); codes (G, R, C), scales (G, Rb, Cb)."""
    (G, R, C), (tr, tc) = x_GRC.shape, tile
    Rb, Cb = cdiv(R, tr), cdiv(C, tc)
    x = x_GRC.float().contiguous()  # codes come out contiguous whatever x's strides
    # zero padding never raises an amax
    t = F.pad(x, (0, Cb * tc - C, 0, Rb * tr - R)).view(G, Rb, tr, Cb, tc)
    amax = t.abs().amax(dim=(2, 4))
    bad = ~t.isfinite().all(dim=4).all(dim=2)
    if mx:
        e = (torch.frexp(amax).exponent - 1 - 8).clamp(-127, 127)  # floor(log2 amax) - 8
        e = torch.where((amax == 0) | bad, -127, e)
        scaled = x * _expand(_exp2i(-e), tile, R, C)
        scales = torch.where(bad, 0xFF, e + 127).to(torch.uint8).view(_E8M0)
    else:
        s = (amax / E4M3_MAX).clamp_min(_MIN_SCALE)
        if pow2:
            # s = m * 2^ex, m in [0.5, 1): ceil to 2^ex, or 2^(ex-1) when m == 0.5
            m, ex = torch.frexp(s)
            s = _exp2i(torch.where(bad, 0, torch.where(m == 0.5, ex - 1, ex)))
        scales = torch.where(bad, torch.nan, torch.where(amax == 0, 1.0, s))
        scaled = x / _expand(scales, tile, R, C)
    codes = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(_FP8).view(torch.uint8)
    codes = codes.masked_fill(_expand(bad, tile, R, C), _NAN_CODE).view(_FP8)
    return codes, scales


def _dequant_tiles_torch(codes_GRC, scales_GRbCb, tile):
    G, R, C = codes_GRC.shape
    return codes_GRC.float() * _expand(scales_GRbCb.float(), tile, R, C)


def row_block_starts(counts_E: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Each expert's first tile (scale column of `quant_blockwise_act_t`), int64 (E,).  Host check: every
    count must be a multiple of `block`, so no tile crosses two experts."""
    if counts_E.dim() != 1 or counts_E.dtype.is_floating_point:
        raise TypeError(
            f"counts_E must be a 1-D integer tensor of rows per expert, got {counts_E.dtype} "
            f"{tuple(counts_E.shape)}"
        )
    bad = (counts_E % block != 0).nonzero().flatten().tolist()  # host sync
    if bad:
        raise ValueError(
            f"quant_blockwise_act_t: rows per expert must be multiples of block={block} so no 1x{block} "
            f"tile crosses two experts; experts {bad[:8]} have counts "
            f"{counts_E[bad[:8]].tolist()} (permute with pad_multiple={block})"
        )
    return (counts_E.cumsum(0) - counts_E).long() // block


def _check_counts(counts_E, M: int, block: int) -> None:
    if counts_E is None:
        return
    row_block_starts(counts_E, block)
    if int(counts_E.sum()) != M:
        raise ValueError(
            f"quant_blockwise_act_t: counts_E sum to {int(counts_E.sum())}, x has {M} rows"
        )


def _as_grc(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(0) if x.dim() == 2 else x


def _mx_view(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """(1, R, C) view of x with the MX blocks along C (dim=-1) or R (dim=0); and the dim as -1 or 0."""
    if dim in (-1, x.dim() - 1):
        return x.reshape(1, -1, x.shape[-1]), -1
    if dim == 0:
        return x.reshape(1, x.shape[0], -1), 0
    raise ValueError(f"quant_mxfp8 takes dim=-1 or dim=0, got {dim}")


def _mx_tile(dim: int, block: int) -> tuple[int, int]:
    return (1, block) if dim == -1 else (block, 1)


def _mx_scale_shape(shape, dim: int, block: int) -> list[int]:
    shape = list(shape)
    shape[dim] = cdiv(shape[dim], block)
    return shape


def quant_blockwise_act_torch(x_MK: torch.Tensor, block: int = 128, pow2_scales: bool = False):
    codes, scales = _quant_tiles_torch(x_MK.unsqueeze(0), (1, block), False, pow2_scales)
    return codes[0], scales[0]


def quant_blockwise_act_t_torch(
    x_MK: torch.Tensor,
    block: int = 128,
    pow2_scales: bool = False,
    counts_E: torch.Tensor | None = None,
):
    _check_counts(counts_E, x_MK.shape[0], block)
    return quant_blockwise_act_torch(x_MK.t(), block, pow2_scales)


def quant_blockwise_weight_torch(w: torch.Tensor, block: int = 128, pow2_scales: bool = False):
    codes, scales = _quant_tiles_torch(_as_grc(w), (block, block), False, pow2_scales)
    return codes.view(w.shape), scales.view(*w.shape[:-2], *scales.shape[1:])


def dequant_blockwise_torch(
    codes: torch.Tensor, scales: torch.Tensor, block: int = 128, layout: str = "act"
):
    tile = (block, block) if layout == "weight" else (1, block)
    return _dequant_tiles_torch(_as_grc(codes), _as_grc(scales), tile).view(codes.shape)


def quant_mxfp8_torch(x: torch.Tensor, block: int = 32, dim: int = -1):
    x_GRC, dim = _mx_view(x, dim)
    codes, scales = _quant_tiles_torch(x_GRC, _mx_tile(dim, block), True, False)
    return codes.view(x.shape), scales.view(_mx_scale_shape(x.shape, dim, block))


def dequant_mxfp8_torch(codes: torch.Tensor, scales: torch.Tensor, block: int = 32, dim: int = -1):
    codes_GRC, dim = _mx_view(codes, dim)
    scales_GRC = _mx_view(scales, dim)[0]
    return _dequant_tiles_torch(codes_GRC, scales_GRC, _mx_tile(dim, block)).view(codes.shape)


# ---------------------------------------------------------------- Triton kernels


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
    return torch.empty(shape, dtype=_FP8, device=like.device)


# ---------------------------------------------------------------- custom ops


@torch.library.custom_op("moevlm::fp8_quant_blockwise_act", mutates_args=())
def _quant_act_op(
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
def _quant_act_t_op(
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
def _quant_weight_op(
    w: torch.Tensor, block: int, pow2_scales: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    codes = _empty_codes(w.shape, w)
    scales = w.new_empty(
        *w.shape[:-2], cdiv(w.shape[-2], block), cdiv(w.shape[-1], block), dtype=torch.float32
    )
    _launch_quant(_as_grc(w), (block, block), _as_grc(codes), _as_grc(scales), False, pow2_scales)
    return codes, scales


@torch.library.custom_op("moevlm::fp8_quant_mxfp8", mutates_args=())
def _quant_mx_op(x: torch.Tensor, block: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    x_GRC, dim = _mx_view(x, dim)
    codes = _empty_codes(x.shape, x)
    scales = torch.empty(_mx_scale_shape(x.shape, dim, block), dtype=_E8M0, device=x.device)
    _launch_quant(
        x_GRC, _mx_tile(dim, block), _mx_view(codes, dim)[0], _mx_view(scales, dim)[0], True, False
    )
    return codes, scales


@torch.library.custom_op("moevlm::fp8_dequant_blockwise", mutates_args=())
def _dequant_op(codes: torch.Tensor, scales: torch.Tensor, block: int, layout: str) -> torch.Tensor:
    tile = (block, block) if layout == "weight" else (1, block)
    return _launch_dequant(_as_grc(codes), _as_grc(scales), tile, False).view(codes.shape)


@torch.library.custom_op("moevlm::fp8_dequant_mxfp8", mutates_args=())
def _dequant_mx_op(codes: torch.Tensor, scales: torch.Tensor, block: int, dim: int) -> torch.Tensor:
    codes_GRC, dim = _mx_view(codes, dim)
    return _launch_dequant(codes_GRC, _mx_view(scales, dim)[0], _mx_tile(dim, block), True).view(
        codes.shape
    )


@_quant_act_op.register_fake
def _(x_MK, block, pow2_scales):
    M, K = x_MK.shape
    return x_MK.new_empty(M, K, dtype=_FP8), x_MK.new_empty(M, cdiv(K, block), dtype=torch.float32)


@_quant_act_t_op.register_fake
def _(x_MK, block, pow2_scales):
    M, K = x_MK.shape
    return x_MK.new_empty(K, M, dtype=_FP8), x_MK.new_empty(K, cdiv(M, block), dtype=torch.float32)


@_quant_weight_op.register_fake
def _(w, block, pow2_scales):
    scales_shape = (*w.shape[:-2], cdiv(w.shape[-2], block), cdiv(w.shape[-1], block))
    return w.new_empty(w.shape, dtype=_FP8), w.new_empty(scales_shape, dtype=torch.float32)


@_quant_mx_op.register_fake
def _(x, block, dim):
    dim = -1 if dim in (-1, x.dim() - 1) else dim
    return x.new_empty(x.shape, dtype=_FP8), x.new_empty(
        _mx_scale_shape(x.shape, dim, block), dtype=_E8M0
    )


@_dequant_op.register_fake
def _(codes, scales, block, layout):
    return codes.new_empty(codes.shape, dtype=torch.float32)


@_dequant_mx_op.register_fake
def _(codes, scales, block, dim):
    return codes.new_empty(codes.shape, dtype=torch.float32)


# ---------------------------------------------------------------- public API


def _check(
    name: str,
    backend: str,
    x: torch.Tensor,
    block: int,
    dims: tuple[int, ...],
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
) -> None:
    if backend not in BACKENDS:
        raise ValueError(
            f"{name}: backend {backend!r} is not available; choose one of {list(BACKENDS)}"
        )
    if x.dtype not in dtypes:
        raise TypeError(f"{name} takes {', '.join(str(d) for d in dtypes)} input, got {x.dtype}")
    if x.dim() not in dims:
        raise ValueError(
            f"{name} takes a tensor of {' or '.join(map(str, dims))} dims, got shape {tuple(x.shape)}"
        )
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"{name}: block must be a positive int, got {block!r}")
    if backend != "triton":
        return
    common.require_triton(f"{name} backend='triton'")
    if block & (block - 1):
        raise ValueError(f"{name} backend='triton' needs a power-of-two block, got {block}")
    common.require_kernel_device(f"{name} backend='triton'", x)


def quant_blockwise_act(
    x_MK: torch.Tensor, block: int = 128, pow2_scales: bool = False, backend: str = "torch"
):
    """(codes_MK e4m3, scales (M, ceil(K/block)) fp32): 1 x block tiles along K."""
    _check("quant_blockwise_act", backend, x_MK, block, (2,))
    if backend == "torch":
        return quant_blockwise_act_torch(x_MK, block, pow2_scales)
    return _quant_act_op(x_MK, block, pow2_scales)


def quant_blockwise_act_t(
    x_MK: torch.Tensor,
    block: int = 128,
    pow2_scales: bool = False,
    counts_E: torch.Tensor | None = None,
    backend: str = "torch",
):
    """(codes_KM e4m3 = x^T contiguous, scales (K, ceil(M/block)) fp32): 1 x block tiles along M of x^T.  With
    `counts_E` (rows per expert) every count must be a multiple of block (host check)."""
    _check("quant_blockwise_act_t", backend, x_MK, block, (2,))
    if backend == "torch":
        return quant_blockwise_act_t_torch(x_MK, block, pow2_scales, counts_E)
    _check_counts(counts_E, x_MK.shape[0], block)
    return _quant_act_t_op(x_MK, block, pow2_scales)


def quant_blockwise_weight(
    w: torch.Tensor, block: int = 128, pow2_scales: bool = False, backend: str = "torch"
):
    """w (K, N) or (E, K, N) -> (codes e4m3, scales (..., ceil(K/block), ceil(N/block)) fp32): block x block."""
    _check("quant_blockwise_weight", backend, w, block, (2, 3))
    if backend == "torch":
        return quant_blockwise_weight_torch(w, block, pow2_scales)
    return _quant_weight_op(w, block, pow2_scales)


def dequant_blockwise(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: int = 128,
    layout: str = "act",
    backend: str = "torch",
) -> torch.Tensor:
    """fp32 codes * scales for a layout: "act" (M, K), "act_t" (K, M) (both 1 x block tiles along the last dim)
    or "weight" ((E,) K, N; block x block)."""
    if layout not in LAYOUTS:
        raise ValueError(f"dequant_blockwise: layout {layout!r}; choose one of {list(LAYOUTS)}")
    _check(
        "dequant_blockwise", backend, codes, block, (2, 3) if layout == "weight" else (2,), (_FP8,)
    )
    tile = (block, block) if layout == "weight" else (1, block)
    want = (*codes.shape[:-2], *(cdiv(n, t) for n, t in zip(codes.shape[-2:], tile)))
    if tuple(scales.shape) != want or scales.dtype != torch.float32:
        raise ValueError(
            f"dequant_blockwise: codes {tuple(codes.shape)} with layout {layout!r} want fp32 scales "
            f"{want}, got {scales.dtype} {tuple(scales.shape)}"
        )
    if backend == "torch":
        return dequant_blockwise_torch(codes, scales, block, layout)
    return _dequant_op(codes, scales, block, layout)


def quant_mxfp8(x: torch.Tensor, block: int = 32, dim: int = -1, backend: str = "torch"):
    """(codes e4m3 shaped like x, scales e8m0 shaped like x with `dim` cut to ceil(n/block)); dim -1 or 0."""
    _check("quant_mxfp8", backend, x, block, tuple(range(1, 9)))
    _mx_view(x, dim)  # validates dim
    if backend == "torch":
        return quant_mxfp8_torch(x, block, dim)
    return _quant_mx_op(x, block, dim)


def dequant_mxfp8(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: int = 32,
    dim: int = -1,
    backend: str = "torch",
) -> torch.Tensor:
    _check("dequant_mxfp8", backend, codes, block, tuple(range(1, 9)), (_FP8,))
    want = _mx_scale_shape(codes.shape, _mx_view(codes, dim)[1], block)
    if list(scales.shape) != want or scales.dtype != _E8M0:
        raise ValueError(
            f"dequant_mxfp8: codes {tuple(codes.shape)} with dim={dim} want e8m0 scales {tuple(want)}, "
            f"got {scales.dtype} {tuple(scales.shape)}"
        )
    if backend == "torch":
        return dequant_mxfp8_torch(codes, scales, block, dim)
    return _dequant_mx_op(codes, scales, block, dim)
