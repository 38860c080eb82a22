"""FP8 GEMMs, the torch reference: the operands' scale blocks, dequantization, and the emulation
(dequantized operands, fp64 GEMM per expert) that the Triton and torch paths are tested against.

Legend: M rows (grouped by expert), K in-features, N out-features, E experts, B the recipe's scale
block along the reduction dim (BLOCK: 128 blockwise, 32 MXFP8).  Suffix q: e4m3 codes, s: scales.

    a_block, b_block = operand_blocks("mm", "blockwise")     # ((1, 128), (128, 128)); the table there
    x = dequantize(xq, xs, a_block)                           # fp32 values the codes stand for
    out = emulate("mm", "blockwise", xq, xs, wq_EKN, ws, counts_E, torch.float32)
"""

from __future__ import annotations

import torch
from moevlm.kernels.fp8_quant_ref import dequant_tiles_torch

__all__ = [
    "BLOCK",
    "dequantize",
    "emulate",
    "operand_blocks",
    "unquantized_reference",
]

E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
BLOCK = {"blockwise": 128, "mxfp8": 32}  # scale block along the reduction dim
SCALE_DTYPE = {"blockwise": torch.float32, "mxfp8": E8M0}
OPS = ("mm", "dgrad", "wgrad")


def operand_blocks(op: str, recipe: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """Block shapes of the two operands' scales (the weight's without E).  A scale tensor indexes the
    same dims as its codes, each divided (rounding up) by the block length along it:

        op      operand  codes    blockwise scales      mxfp8 scales
        mm      x        xq_MK    (M, K/128)  1x128     (M, K/32)
                w        wq_EKN   (E, K/128, N/128)     (E, K/32, N)    32x1, along K
        dgrad   dy       dyq_MN   (M, N/128)  1x128     (M, N/32)
                w        wq_EKN   the same as for mm    (E, K, N/32)    1x32, along N
        wgrad   x^T      xq_KM    (K, M/128)  1x128     (K, M/32)       (x^T contiguous)
                dy^T     dyq_NM   (N, M/128)  1x128     (N, M/32)
    """
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


def dequantize(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 values of codes `q` whose scales `s` cover blocks of shape `block` (the last two dims of
    q; any leading dims are groups): fp8_quant_ref's tile dequantization."""
    R, C = q.shape[-2:]
    grc = q.reshape(-1, R, C), s.reshape(-1, *s.shape[-2:])
    return dequant_tiles_torch(*grc, block).view(q.shape)


def emulate(op, recipe, a, a_s, b, b_s, counts_E, out_dtype):
    """The recipe's numerics: dequantize both operands, GEMM in fp64 per expert, round once to out_dtype.
    Grouped form (b with E; for wgrad a = x^T (K, M), b = dy^T (N, M)); a host sync for the counts."""
    a_block, b_block = operand_blocks(op, recipe)
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
