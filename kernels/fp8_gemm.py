"""FP8 GEMMs for the MoE experts (grouped) and dense linears: forward, input gradient (dgrad) and
weight gradient (wgrad) from quantized operands, fp32 accumulation, output in bf16/fp32/fp16.

Legend: M rows (grouped by expert), K in-features, N out-features, E experts; `counts_E[e]` rows
belong to expert e.  Suffix q: e4m3 codes, s: their scales (formats: fp8_gemm_ref.operand_blocks).
Recipes "blockwise" (128, fp32 scales) and "mxfp8" (32, e8m0); backends "triton" (blockwise;
fp8_gemm_triton.py), "torch" (fp8_gemm_torch.py) and "emulate" (fp8_gemm_ref.py).

    out_MN = fp8_grouped_mm(xq_MK, xs, wq_EKN, ws, counts_E, recipe="blockwise", backend="triton")
    dx_MK  = fp8_grouped_dgrad(dyq_MN, dys, wq_EKN, ws, counts_E, ...)
    dw_EKN = fp8_grouped_wgrad(xq_KM, xs_KM, dyq_NM, dys_NM, counts_E, ..., out_dtype=torch.float32)
    fp8_linear / fp8_linear_dgrad / fp8_linear_wgrad: the same without E (w_KN, dw_KN)
"""

from __future__ import annotations

import torch
from moevlm.kernels import fp8_gemm_torch as fp8_torch
from moevlm.kernels._common import cdiv
from moevlm.kernels.fp8_gemm_ref import BLOCK, E4M3, SCALE_DTYPE, emulate, operand_blocks
from moevlm.kernels.fp8_gemm_triton import TRITON_OPS

# what other packages import (moevlm, bench, tests)
__all__ = [
    "BACKENDS",
    "fp8_grouped_dgrad",
    "fp8_grouped_mm",
    "fp8_grouped_wgrad",
    "fp8_linear",
    "fp8_linear_dgrad",
    "fp8_linear_wgrad",
]

BACKENDS = ("triton", "torch", "emulate")
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    a_block, b_block = operand_blocks(op, recipe)
    for what, q, s, block in (("left", a, a_s, a_block), ("right", b, b_s, b_block)):
        want = (*q.shape[: q.dim() - 2], *(cdiv(d, bl) for d, bl in zip(q.shape[-2:], block)))
        if q.dtype != E4M3 or s.dtype != SCALE_DTYPE[recipe] or tuple(s.shape) != want:
            raise ValueError(
                f"{name} ({recipe}): {what} operand wants {E4M3} codes with {SCALE_DTYPE[recipe]} "
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
        fp8_torch.require_torch_path(op, recipe, grouped, a.device)
        if grouped:
            return fp8_torch.torch_grouped(op, recipe, a, a_s, b, b_s, counts_E, out_dtype)
        return fp8_torch.torch_dense(op, recipe, a, a_s, b, b_s, out_dtype)
    if not grouped:  # one expert owning every row
        if op != "wgrad":
            b, b_s = b.unsqueeze(0), b_s.unsqueeze(0)
        counts_E = torch.full(
            (1,), a.shape[1 if op == "wgrad" else 0], dtype=torch.int32, device=a.device
        )
    if backend == "emulate":
        out = emulate(op, recipe, a, a_s, b, b_s, counts_E, out_dtype)
    else:
        out = TRITON_OPS[op](a, a_s, b, b_s, counts_E, out_dtype)
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
    """out_MN[rows of e] = x[rows of e] @ w[e] from codes and scales (formats: fp8_gemm_ref.operand_blocks)."""
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
