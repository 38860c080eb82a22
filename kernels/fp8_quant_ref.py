"""FP8 quantization, the torch reference (the spec): blockwise e4m3 and MXFP8 tiles, scales and codes.

Legend: G groups (experts, else 1), R rows, C columns, b the block (128 blockwise, 32 MX); `Rb` =
ceil(R/b) and so on.  Codes are torch.float8_e4m3fn (max 448); blockwise scales fp32, MX scales
torch.float8_e8m0fnu.  x ~= codes * scale per tile.

    codes, scales = quant_blockwise_act_torch(x_MK)     # 1 x 128 tiles along K (likewise _act_t, _weight)
    codes, scales = quant_mxfp8_torch(x, dim=-1)         # 1 x 32 along the last dim (dim=0: 32 x 1)

The Triton kernels (fp8_quant_triton.py) give the same bits; fp8_quant.py chooses between them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from moevlm.kernels._common import cdiv

__all__ = [
    "dequant_blockwise_torch",
    "dequant_mxfp8_torch",
    "dequant_tiles_torch",
    "quant_blockwise_act_t_torch",
    "quant_blockwise_act_torch",
    "quant_blockwise_weight_torch",
    "quant_mxfp8_torch",
    "row_block_starts",
]

E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
_MIN_SCALE = 2.0**-126  # smallest normal fp32
_NAN_CODE = 0x7F


def _exp2i(n: torch.Tensor) -> torch.Tensor:
    """2^n as fp32, exactly, for integer n in [-126, 127] (built from the exponent bits)."""
    return ((n.to(torch.int32) + 127) << 23).view(torch.float32)


def _tiles(x_GRC: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """x (G, R, C) zero-padded to whole tiles, viewed (G, Rb, tr, Cb, tc) (no copy when whole)."""
    (G, R, C), (tr, tc) = x_GRC.shape, tile
    Rb, Cb = cdiv(R, tr), cdiv(C, tc)
    if Rb * tr != R or Cb * tc != C:  # zero padding never raises an amax
        x_GRC = F.pad(x_GRC, (0, Cb * tc - C, 0, Rb * tr - R))
    return x_GRC.contiguous().view(G, Rb, tr, Cb, tc)


def _expand(t_GRbCb: torch.Tensor, tile: tuple[int, int], R: int, C: int) -> torch.Tensor:
    """Per-tile values -> per-element (G, R, C) (a copy)."""
    (G, Rb, Cb), (tr, tc) = t_GRbCb.shape, tile
    return _untile(_each(t_GRbCb).expand(G, Rb, tr, Cb, tc), R, C)


def _untile(t: torch.Tensor, R: int, C: int) -> torch.Tensor:
    """(G, Rb, tr, Cb, tc) tiles -> (G, R, C), contiguous."""
    G, Rb, tr, Cb, tc = t.shape
    return t.reshape(G, Rb * tr, Cb * tc)[:, :R, :C].contiguous()


def _each(t_GRbCb: torch.Tensor) -> torch.Tensor:
    """Per-tile values broadcast over the tiles' elements."""
    return t_GRbCb[:, :, None, :, None]


def _quant_tiles_torch(x_GRC: torch.Tensor, tile: tuple[int, int], mx: bool, pow2: bool):
    """The spec for every layout: (G, R, C) in, tiles (tr, tc); codes (G, R, C), scales (G, Rb, Cb)."""
    _, R, C = x_GRC.shape
    t = _tiles(x_GRC.float(), tile)  # codes come out contiguous whatever x's strides
    amax = t.abs().amax(dim=(2, 4))
    bad = ~amax.isfinite()  # a tile holding a NaN or an infinity (amax propagates NaN)
    if mx:
        e = (torch.frexp(amax).exponent - 1 - 8).clamp(-127, 127)  # floor(log2 amax) - 8
        e = torch.where((amax == 0) | bad, -127, e)
        scaled = t * _each(_exp2i(-e))
        scales = torch.where(bad, 0xFF, e + 127).to(torch.uint8).view(E8M0)
    else:
        s = (amax / E4M3_MAX).clamp_min(_MIN_SCALE)
        if pow2:
            # s = m * 2^ex, m in [0.5, 1): ceil to 2^ex, or 2^(ex-1) when m == 0.5
            m, ex = torch.frexp(s)
            s = _exp2i(torch.where(bad, 0, torch.where(m == 0.5, ex - 1, ex)))
        scales = torch.where(bad, torch.nan, torch.where(amax == 0, 1.0, s))
        scaled = t / _each(scales)
    codes = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(FP8).view(torch.uint8)
    codes = codes.masked_fill(_each(bad), _NAN_CODE)
    return _untile(codes, R, C).view(FP8), scales


def dequant_tiles_torch(codes_GRC, scales_GRbCb, tile):
    """fp32 values of codes (G, R, C) with one scale per (tr, tc) tile, scales (G, Rb, Cb)."""
    _, R, C = codes_GRC.shape
    return _untile(_tiles(codes_GRC.float(), tile) * _each(scales_GRbCb.float()), R, C)


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


def check_counts(counts_E, M: int, block: int) -> None:
    """With counts (rows per expert): whole blocks per expert, summing to M (host checks)."""
    if counts_E is None:
        return
    row_block_starts(counts_E, block)
    if int(counts_E.sum()) != M:
        raise ValueError(
            f"quant_blockwise_act_t: counts_E sum to {int(counts_E.sum())}, x has {M} rows"
        )


def as_grc(x: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor as (1, R, C); a 3-D one as it is."""
    return x.unsqueeze(0) if x.dim() == 2 else x


def mx_view(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """(1, R, C) view of x with the MX blocks along C (dim=-1) or R (dim=0); and the dim as -1 or 0."""
    if dim in (-1, x.dim() - 1):
        return x.reshape(1, -1, x.shape[-1]), -1
    if dim == 0:
        return x.reshape(1, x.shape[0], -1), 0
    raise ValueError(f"quant_mxfp8 takes dim=-1 or dim=0, got {dim}")


def mx_tile(dim: int, block: int) -> tuple[int, int]:
    return (1, block) if dim == -1 else (block, 1)


def mx_scale_shape(shape, dim: int, block: int) -> list[int]:
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
    check_counts(counts_E, x_MK.shape[0], block)
    return quant_blockwise_act_torch(x_MK.t(), block, pow2_scales)


def quant_blockwise_weight_torch(w: torch.Tensor, block: int = 128, pow2_scales: bool = False):
    codes, scales = _quant_tiles_torch(as_grc(w), (block, block), False, pow2_scales)
    return codes.view(w.shape), scales.view(*w.shape[:-2], *scales.shape[1:])


def dequant_blockwise_torch(
    codes: torch.Tensor, scales: torch.Tensor, block: int = 128, layout: str = "act"
):
    tile = (block, block) if layout == "weight" else (1, block)
    return dequant_tiles_torch(as_grc(codes), as_grc(scales), tile).view(codes.shape)


def quant_mxfp8_torch(x: torch.Tensor, block: int = 32, dim: int = -1):
    x_GRC, dim = mx_view(x, dim)
    codes, scales = _quant_tiles_torch(x_GRC, mx_tile(dim, block), True, False)
    return codes.view(x.shape), scales.view(mx_scale_shape(x.shape, dim, block))


def dequant_mxfp8_torch(codes: torch.Tensor, scales: torch.Tensor, block: int = 32, dim: int = -1):
    codes_GRC, dim = mx_view(codes, dim)
    scales_GRC = mx_view(scales, dim)[0]
    return dequant_tiles_torch(codes_GRC, scales_GRC, mx_tile(dim, block)).view(codes.shape)
