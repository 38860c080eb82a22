"""FP8 quantization for training: blockwise e4m3 (Hopper recipe) and MXFP8 (Blackwell recipe), each
with backend="torch" (the reference, fp8_quant_ref.py, the default) or "triton" (fp8_quant_triton.py,
the same bits).

Legend: M rows, K in-features, N out-features, E experts, b the block (128 blockwise, 32 MX).

    codes_MK, scales_MKb = quant_blockwise_act(x_MK)                # 1 x 128 tiles along K
    codes_KN, scales_KbNb = quant_blockwise_weight(w_KN)            # 128 x 128 blocks (or w_EKN)
    codes_KM, scales_KMb = quant_blockwise_act_t(x_MK, counts_E=c)  # x^T, 1 x 128 tiles along M
    x_MK ~= dequant_blockwise(codes_MK, scales_MKb, layout="act")   # "act" | "act_t" | "weight"
    codes, scales_e8m0 = quant_mxfp8(x_MK, dim=-1)                  # 1 x 32 along K (dim=0: along M)
    x_MK ~= dequant_mxfp8(codes, scales_e8m0, dim=-1)
"""

from __future__ import annotations

import torch
from moevlm.kernels import _common as common
from moevlm.kernels import fp8_quant_ref as ref
from moevlm.kernels import fp8_quant_triton as kern
from moevlm.kernels._common import FLOAT_DTYPES, cdiv
from moevlm.kernels.fp8_quant_ref import E8M0, FP8, check_counts, mx_scale_shape, mx_view

# what other packages import (moevlm, bench, tests)
__all__ = [
    "BACKENDS",
    "dequant_blockwise",
    "dequant_mxfp8",
    "quant_blockwise_act",
    "quant_blockwise_act_t",
    "quant_blockwise_weight",
    "quant_mxfp8",
]

BACKENDS = ("torch", "triton")
LAYOUTS = ("act", "act_t", "weight")


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
        return ref.quant_blockwise_act_torch(x_MK, block, pow2_scales)
    return kern.quant_act_op(x_MK, block, pow2_scales)


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
        return ref.quant_blockwise_act_t_torch(x_MK, block, pow2_scales, counts_E)
    check_counts(counts_E, x_MK.shape[0], block)
    return kern.quant_act_t_op(x_MK, block, pow2_scales)


def quant_blockwise_weight(
    w: torch.Tensor, block: int = 128, pow2_scales: bool = False, backend: str = "torch"
):
    """w (K, N) or (E, K, N) -> (codes e4m3, scales (..., ceil(K/block), ceil(N/block)) fp32): block x block."""
    _check("quant_blockwise_weight", backend, w, block, (2, 3))
    if backend == "torch":
        return ref.quant_blockwise_weight_torch(w, block, pow2_scales)
    return kern.quant_weight_op(w, block, pow2_scales)


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
        "dequant_blockwise", backend, codes, block, (2, 3) if layout == "weight" else (2,), (FP8,)
    )
    tile = (block, block) if layout == "weight" else (1, block)
    want = (*codes.shape[:-2], *(cdiv(n, t) for n, t in zip(codes.shape[-2:], tile)))
    if tuple(scales.shape) != want or scales.dtype != torch.float32:
        raise ValueError(
            f"dequant_blockwise: codes {tuple(codes.shape)} with layout {layout!r} want fp32 scales "
            f"{want}, got {scales.dtype} {tuple(scales.shape)}"
        )
    if backend == "torch":
        return ref.dequant_blockwise_torch(codes, scales, block, layout)
    return kern.dequant_op(codes, scales, block, layout)


def quant_mxfp8(x: torch.Tensor, block: int = 32, dim: int = -1, backend: str = "torch"):
    """(codes e4m3 shaped like x, scales e8m0 shaped like x with `dim` cut to ceil(n/block)); dim -1 or 0."""
    _check("quant_mxfp8", backend, x, block, tuple(range(1, 9)))
    mx_view(x, dim)  # validates dim
    if backend == "torch":
        return ref.quant_mxfp8_torch(x, block, dim)
    return kern.quant_mx_op(x, block, dim)


def dequant_mxfp8(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: int = 32,
    dim: int = -1,
    backend: str = "torch",
) -> torch.Tensor:
    _check("dequant_mxfp8", backend, codes, block, tuple(range(1, 9)), (FP8,))
    want = mx_scale_shape(codes.shape, mx_view(codes, dim)[1], block)
    if list(scales.shape) != want or scales.dtype != E8M0:
        raise ValueError(
            f"dequant_mxfp8: codes {tuple(codes.shape)} with dim={dim} want e8m0 scales {tuple(want)}, "
            f"got {scales.dtype} {tuple(scales.shape)}"
        )
    if backend == "torch":
        return ref.dequant_mxfp8_torch(codes, scales, block, dim)
    return kern.dequant_mx_op(codes, scales, block, dim)
