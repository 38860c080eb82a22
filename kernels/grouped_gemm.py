"""Grouped GEMM for MoE experts: `out[rows of e] = x[rows of e] @ w[e]`, behind one function.

Legend: M rows (tokens x top-k, grouped by expert), K in-features, N out-features, E experts;
`counts_E` rows per expert, in order (zeros allowed).

    out_MN = grouped_mm(x_MK, w_EKN, counts_E, backend="torch")    # GROUPED_GEMMS: the backends

`loop`: the reference, one matmul per expert (a host sync for the counts); `torch`:
`torch._grouped_mm` (one call, no host sync); `triton`: ours (grouped_gemm_triton.py), registered
only when triton imports.
"""

from __future__ import annotations

import torch
from moevlm.kernels._common import triton

# what other packages import (moevlm, bench, tests)
__all__ = ["GROUPED_GEMMS", "grouped_mm", "grouped_mm_loop"]

grouped_mm_triton = None  # the "triton" backend exists only when triton imports
if triton is not None:
    from moevlm.kernels.grouped_gemm_triton import grouped_mm_triton


def grouped_mm_loop(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor
) -> torch.Tensor:
    chunks = x_MK.split(counts_E.tolist())
    return torch.cat([xe @ w_EKN[e] for e, xe in enumerate(chunks)])


def _contiguous_grad(g: torch.Tensor) -> torch.Tensor:
    return g.contiguous()


def grouped_mm_torch(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor
) -> torch.Tensor:
    device = x_MK.device.type
    offs = counts_E.cumsum(0, dtype=torch.int32)
    if torch.is_autocast_enabled(device):
        # torch._grouped_mm is on no autocast list: both operands take autocast's dtype here, as
        # F.linear's would (the CUDA kernel takes bf16 only; fp32 master weights would be refused)
        dtype = torch.get_autocast_dtype(device)
        x_MK = x_MK.to(dtype)
        if w_EKN.dtype != dtype and torch.is_grad_enabled() and w_EKN.requires_grad:
            return CastWeightGroupedMM.apply(x_MK, w_EKN, offs)
        w_EKN = w_EKN.to(dtype)
    out = torch._grouped_mm(x_MK, w_EKN, offs=offs)
    if out.requires_grad:
        # runs on the gradient before _grouped_mm's backward sees it
        out.register_hook(_contiguous_grad)
    return out


class CastWeightGroupedMM(torch.autograd.Function):
    """`torch._grouped_mm(x, w.to(x.dtype))` with autograd's values and gradients, op for op, that
    keeps the weight itself for backward (a parameter, alive anyway) and casts it again there, instead
    of keeping its cast copy from every layer's forward to its backward."""

    @staticmethod
    def forward(ctx, x_MK, w_EKN, offs):
        ctx.save_for_backward(x_MK, w_EKN, offs)
        return torch._grouped_mm(x_MK, w_EKN.to(x_MK.dtype), offs=offs)

    @staticmethod
    def backward(ctx, grad_MN):
        x_MK, w_EKN, offs = ctx.saved_tensors
        grad_MN = grad_MN.contiguous()  # torch._grouped_mm's backward needs it
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = torch._grouped_mm(x_MK.transpose(-2, -1), grad_MN, offs=offs).to(w_EKN.dtype)
        if ctx.needs_input_grad[0]:
            w_c = w_EKN.to(x_MK.dtype)
            grad_x = torch._grouped_mm(grad_MN, w_c.transpose(-2, -1), offs=offs)
        return grad_x, grad_w, None


GROUPED_GEMMS = {"loop": grouped_mm_loop, "torch": grouped_mm_torch}
if grouped_mm_triton is not None:
    GROUPED_GEMMS["triton"] = grouped_mm_triton


def grouped_mm(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor, backend: str = "torch"
):
    if backend == "triton" and grouped_mm_triton is None:
        raise ImportError(
            "grouped GEMM backend 'triton' needs the `triton` package, which is not installed: "
            "`pip install triton` (CUDA builds of torch bring it), "
            f"or choose one of {sorted(GROUPED_GEMMS)}"
        )
    if backend not in GROUPED_GEMMS:
        raise ValueError(
            f"grouped GEMM backend {backend!r} is not available; choose one of {sorted(GROUPED_GEMMS)}"
        )
    return GROUPED_GEMMS[backend](x_MK, w_EKN, counts_E)
