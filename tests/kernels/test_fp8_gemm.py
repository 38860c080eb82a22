"""FP8 GEMMs (kernels/fp8_gemm*.py) on CPU, the Triton kernels under the interpreter.

- Triton blockwise forward, dgrad and wgrad against the emulation (dequantize,
  fp64 GEMM): uneven experts with an empty one, experts not on 128-row blocks,
  dense (E = 1); N = 192 is ragged (not a multiple of the 128 scale block nor of
  the interpreter's 64-wide tile).  Bound: ||triton - emulate|| <= 1e-5 ||emulate||
  (Frobenius) and max |diff| <= 1e-5 max |emulate|: both are sums of the same
  exact fp8 products (e4m3 x e4m3 is exact in fp32), so only fp32 rounding of the
  accumulation and of dequantized values (~1e-7) separates them.  bf16 output:
  within one bf16 ulp.  Empty experts: exact zeros in wgrad.
- Emulation vs the unquantized fp64 GEMM, blockwise and MXFP8: the quantization
  error, printed per op, and a loose bound.
- The torch-path probe on CPU (all False, booleans, a clear error naming what is
  missing) and the torch path itself against a stand-in `torch._scaled_mm` that
  checks cuBLAS's operand/scale layouts; MXFP8 scale swizzle by hand.
- Fakes (FakeTensorMode shapes, opcheck) and the sm_90 compile (fp8 wgmma, smem).

Operands are quantized with `moevlm.kernels.fp8_quant_ref`'s torch references, so the
two modules' formats are tested together.  Inputs are fresh every run; the seed is
in every failure message and FP8_GEMM_SEED=<seed> replays it."""

import os
import sys
import zlib

import pytest
import torch

pytest.importorskip("triton")

from moevlm.kernels import fp8_gemm as fg  # noqa: E402
from moevlm.kernels import fp8_gemm_ref as fref  # noqa: E402
from moevlm.kernels import fp8_gemm_torch as fgt  # noqa: E402
from moevlm.kernels import fp8_gemm_triton as fgk  # noqa: E402
from moevlm.kernels.fp8_quant_ref import (  # noqa: E402
    quant_blockwise_act_t_torch,
    quant_blockwise_act_torch,
    quant_blockwise_weight_torch,
    quant_mxfp8_torch,
)
from sm90 import compile_sm90, run_compile_script  # noqa: E402

SEED = int(os.environ.get("FP8_GEMM_SEED", int.from_bytes(os.urandom(4), "little")))
K, N = 256, 192
CASES = {"grouped": [128, 0, 256, 128], "unaligned": [100, 0, 200, 37], "dense": None}
DENSE_M = 200
FNS = {
    ("mm", True): fg.fp8_grouped_mm,
    ("dgrad", True): fg.fp8_grouped_dgrad,
    ("wgrad", True): fg.fp8_grouped_wgrad,
    ("mm", False): fg.fp8_linear,
    ("dgrad", False): fg.fp8_linear_dgrad,
    ("wgrad", False): fg.fp8_linear_wgrad,
}
# emulate vs unquantized, relative Frobenius error on Gaussian data: measured ~3.7e-2 blockwise, ~4.3e-2 MXFP8.
# e4m3 keeps 3 mantissa bits: an element's rounding error is ~2.6% RMS, two operands give ~sqrt(2) x that.  The
# bounds catch a wrong scale (O(1) errors) or no quantization at all, not a slightly different rounding.
QUANT_BOUND = {"blockwise": 0.06, "mxfp8": 0.08}


@pytest.fixture
def gen(request):
    return torch.Generator().manual_seed(SEED + zlib.crc32(request.node.name.encode()))


def _data(counts, gen):
    M = DENSE_M if counts is None else sum(counts)
    E = 1 if counts is None else len(counts)
    x = torch.randn(M, K, generator=gen)
    # per-column spread
    w = torch.randn(E, K, N, generator=gen) * torch.rand(E, 1, N, generator=gen) / K**0.5
    dy = torch.randn(M, N, generator=gen) * (1 + torch.rand(M, 1, generator=gen))
    return x, (w[0] if counts is None else w), dy


def _quantize(op, recipe, x, w, dy):
    """The operands of `op` in the formats of fp8_gemm's docstring table, from fp8_quant's references."""
    if recipe == "blockwise":
        if op == "wgrad":
            return (*quant_blockwise_act_t_torch(x), *quant_blockwise_act_t_torch(dy))
        return (
            *quant_blockwise_act_torch(x if op == "mm" else dy),
            *quant_blockwise_weight_torch(w),
        )
    if op == "wgrad":
        return (*quant_mxfp8_torch(x.t()), *quant_mxfp8_torch(dy.t()))
    if op == "dgrad":  # w quantized 1x32 along N
        return (*quant_mxfp8_torch(dy), *quant_mxfp8_torch(w))
    wq, ws = quant_mxfp8_torch(w.transpose(-1, -2))  # 32x1 along K: quantize w^T along its last dim
    return (*quant_mxfp8_torch(x), wq.transpose(-1, -2), ws.transpose(-1, -2))


def _run(op, recipe, backend, args, counts, out_dtype=torch.float32):
    if counts is None:
        return FNS[op, False](*args, recipe=recipe, backend=backend, out_dtype=out_dtype)
    return FNS[op, True](
        *args, torch.tensor(counts), recipe=recipe, backend=backend, out_dtype=out_dtype
    )


def _rel(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm())


# the grouped case in the fast tier, the others in the slow one
@pytest.mark.parametrize(
    "case", [c if c == "grouped" else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
@pytest.mark.parametrize("op", ["mm", "dgrad", "wgrad"])
def test_triton_matches_emulation(op, case, gen):
    counts = CASES[case]
    args = _quantize(op, "blockwise", *_data(counts, gen))
    got = _run(op, "blockwise", "triton", args, counts)
    want = _run(op, "blockwise", "emulate", args, counts)
    assert got.shape == want.shape and got.dtype == torch.float32
    rel, peak = _rel(got, want), float((got - want).abs().max() / want.abs().max())
    print(f"triton vs emulate {op:5s} {case:9s}: rel {rel:.2e}  max/peak {peak:.2e}")
    assert rel <= 1e-5 and peak <= 1e-5, (
        f"{op} {case} counts={counts}: rel {rel:.2e} peak {peak:.2e} (seed {SEED})"
    )
    if op == "wgrad" and counts is not None:
        for e in (e for e, c in enumerate(counts) if c == 0):
            assert float(got[e].abs().max()) == 0.0, (
                f"dw[{e}] of an empty expert, counts={counts}, seed {SEED}"
            )


def test_triton_bf16_output_within_one_ulp(gen):
    counts = CASES["grouped"]
    args = _quantize("mm", "blockwise", *_data(counts, gen))
    got = _run("mm", "blockwise", "triton", args, counts, torch.bfloat16)
    want = _run("mm", "blockwise", "emulate", args, counts)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(
        got.float(), want, rtol=2**-7, atol=1e-6, msg=lambda m: f"{m} (seed {SEED})"
    )


def test_strided_operands(gen):
    """Scales transposed (M-major, what cuBLAS wants for 1x128) and w^T views: the kernels read strides."""
    counts = CASES["grouped"]
    x, w, dy = _data(counts, gen)
    xq, xs, wq, ws = _quantize("mm", "blockwise", x, w, dy)
    strided = (xq, xs.t().contiguous().t(), wq.transpose(1, 2).contiguous().transpose(1, 2), ws)
    torch.testing.assert_close(
        _run("mm", "blockwise", "triton", strided, counts),
        _run("mm", "blockwise", "emulate", (xq, xs, wq, ws), counts),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_quantization_error_vs_unquantized(recipe, gen):
    table = []
    for case in ("grouped", "dense"):
        counts = CASES[case]
        x, w, dy = _data(counts, gen)
        for op in ("mm", "dgrad", "wgrad"):
            got = _run(op, recipe, "emulate", _quantize(op, recipe, x, w, dy), counts)
            table.append(
                (
                    case,
                    op,
                    _rel(
                        got.reshape(-1),
                        fref.unquantized_reference(op, x, w, dy, counts).reshape(-1),
                    ),
                )
            )
    print(f"\n{recipe} emulate vs unquantized fp64 (relative Frobenius error):")
    for case, op, rel in table:
        print(f"  {case:8s} {op:5s} {rel:.2e}")
    worst = max(rel for *_, rel in table)
    assert 1e-3 < worst < QUANT_BOUND[recipe], f"{recipe}: {table} (seed {SEED})"


def test_mxfp8_is_not_probed_below_blackwell(monkeypatch):
    """torch's MXFP8 kernels need sm_100+: on an sm_90 GPU (an H200 with torch 2.11) running them failed
    the launch and poisoned the CUDA context, so the probe answers without running them there."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(fgt, "_probe_operands", lambda *a: pytest.fail("an MXFP8 kernel was tried"))
    for key in ("scaled_mm_mxfp8", "scaled_grouped_mm_mxfp8"):
        ok, why = fgt._probe_one(key, "cuda:0")
        assert not ok and "compute capability 10.0+" in why and "sm_90" in why, why
    assert fgt._not_tried("blockwise", "cuda:0") is None  # blockwise runs on sm_90
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    assert fgt._not_tried("mxfp8", "cuda:0") is None


def test_probe_on_cpu_reports_missing_and_selection_names_it(gen):
    support = fgt.scaled_mm_support("cpu")
    assert set(support) == {"scaled_mm_blockwise", "scaled_mm_mxfp8", "scaled_grouped_mm_mxfp8"}
    assert all(type(v) is bool for v in support.values()) and not any(support.values()), support
    # a fresh dict from the cached probe
    assert fgt.scaled_mm_support(torch.device("cpu")) is not support
    counts = CASES["grouped"]
    args = _quantize("mm", "blockwise", *_data(counts, gen))
    with pytest.raises(
        RuntimeError, match=r"torch\._scaled_mm with blockwise 1x128/128x128.*missing on cpu"
    ):
        _run("mm", "blockwise", "torch", args, counts)
    args = _quantize("dgrad", "mxfp8", *_data(counts, gen))
    with pytest.raises(
        RuntimeError, match=r"torch\._scaled_grouped_mm with MXFP8.*NotImplementedError"
    ):
        _run("dgrad", "mxfp8", "torch", args, counts, torch.bfloat16)


# ------------------------------------------------- the torch path against a stand-in _scaled_mm
def _unswizzle(s_flat, rows, cols):
    Rp, Cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    # rb, a, b, cb, c
    u = s_flat.view(torch.uint8).view(Rp // 128, Cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return u.reshape(Rp, Cp)[:rows, :cols].view(s_flat.dtype)


def _scaled_mm_standin(a, b, scale_a, scale_b, out_dtype=None):
    """cuBLAS's rules as fp8_gemm reads them (row-major a, column-major b; 1x128 scales outer-dim-major, 128x128
    scales (Kb, Nb) with stride (1, Kb rounded up to 4); MXFP8 swizzled), then the exact product."""
    (M, Kr), Nc = a.shape, b.shape[1]
    kb, kb32, nb = -(-Kr // 128), -(-Kr // 32), -(-Nc // 128)
    assert a.stride(1) == 1 and b.stride(0) == 1, (a.stride(), b.stride())
    if scale_a.dtype == torch.float8_e8m0fnu:
        sa, sb = _unswizzle(scale_a, M, kb32), _unswizzle(scale_b, Nc, kb32).T
        blk_a, blk_b = (1, 32), (32, 1)
    else:
        assert scale_a.stride(0) == 1, scale_a.stride()
        sa, sb, blk_a = scale_a, scale_b, (1, 128)
        if scale_b.shape == (kb, nb):
            assert scale_b.stride() == (1, -(-kb // 4) * 4), scale_b.stride()
            blk_b = (128, 128)
        else:
            assert scale_b.shape == (kb, Nc) and scale_b.is_contiguous()
            blk_b = (128, 1)
    out = fref.dequantize(a, sa, blk_a).double() @ fref.dequantize(b, sb, blk_b).double()
    return out.to(out_dtype)


def test_torch_path_against_a_standin_scaled_mm(monkeypatch, gen):
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_standin)
    fgt._probe.cache_clear()
    try:
        support = fgt.scaled_mm_support("cpu")
        assert support["scaled_mm_blockwise"] and support["scaled_mm_mxfp8"], fgt._probe("cpu")
        assert not support["scaled_grouped_mm_mxfp8"]
        for recipe in ("blockwise", "mxfp8"):
            for case in ("dense", "grouped"):
                counts = CASES[case]
                data = _data(counts, gen)
                for op in ("mm", "dgrad", "wgrad"):
                    if recipe == "mxfp8" and case == "grouped" and op != "wgrad":
                        continue  # _scaled_grouped_mm: no stand-in
                    args = _quantize(op, recipe, *data)
                    got = _run(op, recipe, "torch", args, counts)
                    want = _run(op, recipe, "emulate", args, counts)
                    assert _rel(got, want) < 1e-6, (recipe, case, op, _rel(got, want))
        with pytest.raises(ValueError, match="start on a 128-row scale block"):
            _run(
                "wgrad",
                "blockwise",
                "torch",
                _quantize("wgrad", "blockwise", *_data(CASES["unaligned"], gen)),
                CASES["unaligned"],
            )
        monkeypatch.setattr(
            torch,
            "_scaled_mm",
            lambda a, b, sa, sb, out_dtype=None: (
                _scaled_mm_standin(
                    a,
                    b,
                    sa.t().contiguous().t() if sa.dtype == torch.float32 else sa,
                    sb,
                    out_dtype,
                )
                * 1.5
            ),
        )
        fgt._probe.cache_clear()
        assert "disagreed with the emulation" in fgt._probe("cpu")["scaled_mm_blockwise"][1]
    finally:
        fgt._probe.cache_clear()


def test_mx_scale_swizzle_by_hand():
    rows, cols = 130, 5  # padded to 256 x 8: two row blocks, two column blocks
    s = (torch.arange(rows * cols) % 251).to(torch.uint8).view(rows, cols)
    flat = fgt._swizzle_mx(s.view(torch.float8_e8m0fnu)).view(torch.uint8)
    assert flat.numel() == 256 * 8
    for r, c in [(0, 0), (1, 0), (31, 3), (32, 0), (33, 2), (127, 3), (128, 0), (129, 4), (5, 4)]:
        tile = (r // 128) * 2 + c // 4
        pos = tile * 512 + 16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4
        assert int(flat[pos]) == int(s[r, c]), (r, c)


# -------------------------------------------------------------------------- ops, fakes, errors
def test_fakes_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    M, E = 384, 3
    with FakeTensorMode():
        e4 = torch.float8_e4m3fn
        x, xs = torch.empty(M, K, dtype=e4), torch.empty(M, 2)
        w, ws = torch.empty(E, K, N, dtype=e4), torch.empty(E, 2, 2)
        dy, dys = torch.empty(M, N, dtype=e4), torch.empty(M, 2)
        xt, xts, dyt, dyts = (
            torch.empty(K, M, dtype=e4),
            torch.empty(K, 3),
            torch.empty(N, M, dtype=e4),
            torch.empty(N, 3),
        )
        counts = torch.empty(E, dtype=torch.int64)
        out = fg.fp8_grouped_mm(x, xs, w, ws, counts)
        dx = fg.fp8_grouped_dgrad(dy, dys, w, ws, counts, out_dtype=torch.float32)
        dw = fg.fp8_grouped_wgrad(xt, xts, dyt, dyts, counts)
        lin = fg.fp8_linear(x, xs, w[0], ws[0])
    assert (out.shape, out.dtype) == ((M, N), torch.bfloat16)
    assert (dx.shape, dx.dtype) == ((M, K), torch.float32)
    assert (dw.shape, dw.dtype) == ((E, K, N), torch.float32)
    assert lin.shape == (M, N)


def test_opcheck_the_custom_ops(gen):
    """opcheck's schema test cannot compare fp8 inputs (torch's SchemaCheckMode multiplies them: not implemented
    for float8 on CPU), so the ops' no-mutation promise is checked byte for byte here and opcheck runs the rest."""
    counts = torch.tensor([40, 0, 90])
    x, w, dy = _data([40, 0, 90], gen)
    ops = torch.ops.moevlm
    for op, name, out_dtype in (
        ("mm", "fp8_grouped_mm_blockwise", torch.bfloat16),
        ("dgrad", "fp8_grouped_dgrad_blockwise", torch.float32),
        ("wgrad", "fp8_grouped_wgrad_blockwise", torch.float32),
    ):
        args = (*_quantize(op, "blockwise", x, w, dy), counts, out_dtype)
        before = [a.clone() for a in args[:5]]
        getattr(ops, name).default(*args)
        assert all(
            torch.equal(
                a.view(torch.uint8) if a.element_size() == 1 else a,
                b.view(torch.uint8) if b.element_size() == 1 else b,
            )
            for a, b in zip(args[:5], before)
        ), name
        torch.library.opcheck(
            getattr(ops, name).default,
            args,
            test_utils=(
                "test_autograd_registration",
                "test_faketensor",
                "test_aot_dispatch_dynamic",
            ),
        )


def test_compiles_fullgraph(gen):
    counts = [100, 0, 200]
    args = _quantize("mm", "blockwise", *_data(counts, gen))
    fn = torch.compile(
        lambda *a: fg.fp8_grouped_mm(*a, out_dtype=torch.float32).square().sum(),
        backend="aot_eager",
        fullgraph=True,
    )
    got = fn(*args, torch.tensor(counts))
    want = _run("mm", "blockwise", "emulate", args, counts).double().square().sum()
    assert abs(float(got) / float(want) - 1) < 1e-5, (float(got), float(want))


def test_bad_inputs_are_named(gen):
    counts = CASES["grouped"]
    xq, xs, wq, ws = _quantize("mm", "blockwise", *_data(counts, gen))
    c = torch.tensor(counts)
    with pytest.raises(ValueError, match=r"scales of shape \(512, 2\)"):
        fg.fp8_grouped_mm(xq, xs[:, :1], wq, ws, c)
    with pytest.raises(ValueError, match="float8_e4m3fn codes"):
        fg.fp8_grouped_mm(xq.float(), xs, wq, ws, c)
    with pytest.raises(ValueError, match="triton backend is blockwise only"):
        fg.fp8_grouped_mm(xq, xs, wq, ws, c, recipe="mxfp8")
    with pytest.raises(ValueError, match="counts_E must be"):
        fg.fp8_grouped_mm(xq, xs, wq, ws, c[:2])
    with pytest.raises(ValueError, match="reduction dim"):
        fg.fp8_grouped_dgrad(xq, xs, wq, ws, c)


@pytest.mark.slow
def test_kernels_compile_for_hopper_without_a_gpu():
    """Every autotune config compiles for sm_90 with ptxas into fp8 wgmma, within an H100's shared memory."""
    stdout = run_compile_script(__file__)
    lines = stdout.splitlines()
    assert len(lines) == 3 * 4 and all("e4m3.e4m3" in line for line in lines), stdout


def _compile_sm90():
    mm = [
        "stride_am",
        "stride_ak",
        "stride_asm",
        "stride_ask",
        "stride_be",
        "stride_bk",
        "stride_bn",
        "stride_bse",
        "stride_bsk",
        "stride_bsn",
        "stride_om",
        "stride_on",
    ]
    wg = [
        "stride_ak",
        "stride_am",
        "stride_ask",
        "stride_asm",
        "stride_bn",
        "stride_bm",
        "stride_bsn",
        "stride_bsm",
        "stride_we",
        "stride_wk",
        "stride_wn",
    ]
    cases = [
        (
            fgk._fp8_mm_kernel,
            fgk._MM_CONFIGS,
            mm,
            ("stride_ak", "stride_bn", "stride_on"),
            dict(BLOCK_K=128),
        ),
        (
            fgk._fp8_mm_kernel,
            fgk._MM_CONFIGS,
            mm,
            ("stride_ak", "stride_bk", "stride_on"),
            dict(BLOCK_K=128),
        ),
        (
            fgk._fp8_wgrad_kernel,
            fgk._WGRAD_CONFIGS,
            wg,
            ("stride_am", "stride_bm", "stride_wn"),
            dict(BLOCK_M=128),
        ),
    ]
    for kernel, configs, strides, ones, fixed in cases:
        fn = kernel.fn
        for cfg in configs:
            sig = dict(
                zip(fn.arg_names[:6], ["*fp8e4nv", "*fp32", "*fp8e4nv", "*fp32", "*bf16", "*i64"])
            )
            sig.update({n: "i32" for n in ["N", "K", "E", *strides]})
            consts = dict(cfg.kwargs, E_P2=128, **fixed, **{n: 1 for n in ones})
            c = compile_sm90(fn, sig, consts, cfg.num_warps, cfg.num_stages, divisible=True)
            assert c.metadata.shared <= 227 * 1024, (fn.__name__, cfg, c.metadata.shared)
            mma = (
                "wgmma e4m3.e4m3"
                if ".e4m3.e4m3" in c.asm["ptx"] and "wgmma" in c.asm["ptx"]
                else "no fp8 wgmma"
            )
            print(fn.__name__, ones[1], cfg.kwargs, cfg.num_stages, "smem", c.metadata.shared, mma)


if __name__ == "__main__" and sys.argv[1:] == ["--compile-sm90"]:
    _compile_sm90()
