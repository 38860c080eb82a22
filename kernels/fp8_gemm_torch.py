"""FP8 GEMMs through torch: `torch._scaled_mm` (dense, and grouped as a per-expert loop with a host
sync) and `torch._scaled_grouped_mm` (grouped MXFP8 mm/dgrad), with operands and scales laid out as
cuBLAS wants them, and the probe that decides per device which of these run.

Legend: M rows (grouped by expert), K in-features, N out-features, E experts; operand formats as in
fp8_gemm_ref.operand_blocks.

    scaled_mm_support(device)   # {"scaled_mm_blockwise": bool, "scaled_mm_mxfp8": bool,
                                #  "scaled_grouped_mm_mxfp8": bool}, probed once per device
    require_torch_path(op, recipe, grouped, device)   # raises, naming the missing path and why
    out = torch_grouped(op, recipe, a, a_s, b, b_s, counts_E, out_dtype)   # or torch_dense(...)
"""

from __future__ import annotations

import functools

import torch
from moevlm.kernels._common import cdiv
from moevlm.kernels.fp8_gemm_ref import BLOCK, E4M3, OPS, SCALE_DTYPE, emulate, operand_blocks

__all__ = ["require_torch_path", "scaled_mm_support", "torch_dense", "torch_grouped"]


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


def torch_dense(op, recipe, a, a_s, b, b_s, out_dtype):
    square = recipe == "blockwise"
    if op == "mm":  # b = w_KN
        return _scaled_mm_torch(
            recipe, a, a_s, b.t(), b_s if square else b_s.t(), out_dtype, square
        )
    if op == "dgrad":  # dx = dy @ w^T: bt = w_KN
        return _scaled_mm_torch(recipe, a, a_s, b, b_s.t() if square else b_s, out_dtype, square)
    # wgrad: x^T (K, M) @ (dy^T (N, M))^T
    return _scaled_mm_torch(recipe, a, a_s, b, b_s, out_dtype)


def torch_grouped(op, recipe, a, a_s, b, b_s, counts_E, out_dtype):
    if recipe == "mxfp8" and op != "wgrad":
        return _scaled_grouped_mm_mx(op, a, a_s, b, b_s, counts_E, out_dtype)
    counts = counts_E.tolist()  # host sync: one _scaled_mm per expert
    if op != "wgrad":
        parts = [
            torch_dense(op, recipe, ae, se, b[e], b_s[e], out_dtype)
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
            torch_dense("wgrad", recipe, a[:, sl], a_s[:, bl], b[:, sl], b_s[:, bl], out_dtype)
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
    a_block, b_block = operand_blocks(op, recipe)
    b_block = b_block if op == "wgrad" else (1, *b_block)
    out = []
    for shape, block in ((a_shape, a_block), (b_shape, b_block)):
        q = torch.randn(shape, generator=g).to(E4M3)
        s_shape = tuple(cdiv(d, bl) for d, bl in zip(shape, block))
        # powers of two: e8m0 too
        s = torch.exp2(torch.randint(-3, 4, s_shape, generator=g).float())
        out += [q.to(device), s.to(SCALE_DTYPE[recipe]).to(device)]
    if not grouped and op != "wgrad":
        out[2], out[3] = out[2][0], out[3][0]
    return (*out, counts.to(device))


def _not_tried(recipe: str, device: str) -> str | None:
    """Why a torch path is not even probed on `device`: torch's MXFP8 kernels are Blackwell's (sm_100+);
    on an H200 (sm_90, torch 2.11) they launched anyway and failed, which poisons the CUDA context."""
    d = torch.device(device)
    if recipe != "mxfp8" or d.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(d)
    if major >= 10:
        return None
    return f"needs compute capability 10.0+ (Blackwell); {device} is sm_{major}{minor}: not tried"


def _probe_one(key: str, device: str) -> tuple[bool, str]:
    _, recipe, grouped = _PROBES[key]
    why = _not_tried(recipe, device)
    if why is not None:
        return False, why
    worst = 0.0
    try:
        for op in ("mm", "dgrad") if grouped else OPS:
            a, a_s, b, b_s, counts = _probe_operands(op, recipe, grouped, device)
            if grouped:
                got = torch_grouped(op, recipe, a, a_s, b, b_s, counts, torch.bfloat16)
            else:
                got = torch_dense(op, recipe, a, a_s, b, b_s, torch.bfloat16)
            want = emulate(
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


def require_torch_path(op, recipe, grouped, device):
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
