"""The Triton grouped GEMM, run by the Triton interpreter on CPU, against the
per-expert loop reference: forward, dx and dw in fp32, fp16 and bf16 with uneven,
empty and all-in-one groups and M=0; strided inputs and non-contiguous incoming
gradients; the custom ops' opcheck and a fullgraph torch.compile; the backend
registry without triton.

Inputs are fresh every run: the seed is printed in every failure message, and
GROUPED_GEMM_SEED=<seed> replays it."""

import os
import subprocess
import sys
import zlib

import pytest
import torch

pytest.importorskip("triton")

from moevlm.kernels.grouped_gemm import GROUPED_GEMMS, grouped_mm, grouped_mm_loop  # noqa: E402
from moevlm.kernels.grouped_gemm_triton import grouped_mm_triton  # noqa: E402
from sm90 import compile_sm90, run_compile_script  # noqa: E402

SEED = int(os.environ.get("GROUPED_GEMM_SEED", int.from_bytes(os.urandom(4), "little")))
E, K, N = (
    6,
    80,
    72,
)  # K and N not multiples of the interpreter's 32-wide blocks: 3 tiles each, masked tails
# The kernels accumulate in fp32 and round once, so fp16/bf16 results sit within an ulp of the fp32 reference
# (bf16: a whole ulp, as the interpreter truncates fp32 -> bf16 where a GPU rounds to nearest).
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-4),
    torch.float16: dict(rtol=2e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-3),
}


@pytest.fixture
def gen(request):
    """A generator seeded from SEED and the test's name; its seed is in every failure message."""
    return torch.Generator().manual_seed(SEED + zlib.crc32(request.node.name.encode()))


def _counts(case: str, gen: torch.Generator) -> list[int]:
    if case == "empty_M":
        return [0] * E
    M = int(torch.randint(60, 120, (1,), generator=gen))
    if case == "one_expert":
        counts = [0] * E
        counts[int(torch.randint(E, (1,), generator=gen))] = M
        return counts
    # uneven: 1-2 random experts empty, the rest cut at random points (more zeros may fall out)
    live = torch.randperm(E, generator=gen)[: E - int(torch.randint(1, 3, (1,), generator=gen))]
    cuts = torch.randint(0, M + 1, (len(live) - 1,), generator=gen).sort().values.tolist()
    counts = [0] * E
    for e, lo, hi in zip(sorted(live.tolist()), [0, *cuts], [*cuts, M]):
        counts[e] = hi - lo
    return counts


def _fwd_bwd(fn, x, w, counts_E, dy=None):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w, counts_E)
    y.sum().backward() if dy is None else y.backward(dy)
    return y.detach(), x.grad, w.grad


def _compare(got, want, tol, what):
    errs = []
    for name, g, r in zip(("out", "dx", "dw"), got, want):
        torch.testing.assert_close(
            g.float(),
            r.float(),
            **tol,
            msg=lambda m, name=name: f"{name} {what} (GROUPED_GEMM_SEED={SEED}): {m}",
        )
        errs.append(float((g.float() - r.float()).abs().max()) if g.numel() else 0.0)
    print(f"max |err| {what}: out {errs[0]:.3g}  dx {errs[1]:.3g}  dw {errs[2]:.3g}")


# fp32 in the fast tier, the 2-byte types in the slow one
@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        *(pytest.param(d, marks=pytest.mark.slow) for d in (torch.float16, torch.bfloat16)),
    ],
    ids=str,
)
@pytest.mark.parametrize("case", ["uneven", "one_expert", "empty_M"])
def test_matches_loop_reference(case, dtype, gen):
    counts = _counts(case, gen)
    M = sum(counts)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = torch.randn(E, K, N, generator=gen).to(dtype)
    dy = torch.randn(M, N, generator=gen).to(dtype)
    got = _fwd_bwd(grouped_mm_triton, x, w, torch.tensor(counts), dy)
    want = _fwd_bwd(grouped_mm_loop, x.float(), w.float(), torch.tensor(counts), dy.float())
    assert [t.dtype for t in got] == [dtype] * 3 and got[0].shape == (M, N)
    _compare(got, want, TOL[dtype], f"{case} {dtype} counts={counts}")
    for e in (e for e, c in enumerate(counts) if c == 0):  # no rows: exact zeros, not just small
        assert float(got[2][e].abs().max()) == 0.0, (
            f"dw[{e}] of an empty expert, counts={counts}, seed {SEED}"
        )


def test_strided_inputs_and_noncontiguous_gradients(gen):
    """x a column slice, w a transposed view, int32 counts; dy expanded (`.sum()`) or transposed."""
    counts = torch.tensor(_counts("uneven", gen), dtype=torch.int32)
    M = int(counts.sum())
    x = torch.randn(M, K + 8, generator=gen)[:, 3 : 3 + K]
    w = torch.randn(E, N, K, generator=gen).transpose(1, 2)
    dy_t = torch.randn(N, M, generator=gen).t()
    for dy in (None, dy_t):
        got = _fwd_bwd(grouped_mm_triton, x, w, counts, dy)
        want = _fwd_bwd(grouped_mm_loop, x, w, counts, dy)
        _compare(
            got, want, TOL[torch.float32], f"strided, dy={'sum' if dy is None else 'transposed'}"
        )


def test_opcheck_the_custom_ops(gen):
    # All four default checks (schema, autograd registration, fake tensor, aot dispatch) run under the
    # interpreter; they call the kernels several times, so the inputs are small.
    counts = torch.tensor([3, 0, 17, 5])
    x = torch.randn(25, 40, generator=gen, requires_grad=True)
    w = torch.randn(4, 40, 24, generator=gen, requires_grad=True)
    dy = torch.randn(25, 24, generator=gen)
    torch.library.opcheck(torch.ops.moevlm.grouped_mm_triton.default, (x, w, counts))
    torch.library.opcheck(
        torch.ops.moevlm.grouped_mm_triton_dgrad.default, (dy, w.detach(), counts)
    )
    torch.library.opcheck(
        torch.ops.moevlm.grouped_mm_triton_wgrad.default, (x.detach(), dy, counts)
    )


def test_compiles_fullgraph_through_the_backend_registry(gen):
    counts = torch.tensor([9, 0, 30, 1])
    x = torch.randn(40, 32, generator=gen)
    w = torch.randn(4, 32, 48, generator=gen)
    compiled = torch.compile(
        lambda a, b, c: grouped_mm(a, b, c, "triton").square().sum(),
        backend="aot_eager",
        fullgraph=True,
    )
    got = _fwd_bwd(compiled, x, w, counts)
    want = _fwd_bwd(lambda a, b, c: grouped_mm_loop(a, b, c).square().sum(), x, w, counts)
    _compare(got, want, dict(rtol=1e-5, atol=1e-3), "compiled")


def test_bad_inputs_are_named():
    x, w, c = torch.zeros(4, 8), torch.zeros(2, 8, 5), torch.tensor([1, 3])
    with pytest.raises(ValueError, match="disagree on K or E"):
        grouped_mm_triton(x, torch.zeros(3, 8, 5), c)
    with pytest.raises(TypeError, match="one dtype"):
        grouped_mm_triton(x.half(), w, c)
    with pytest.raises(TypeError, match="integer counts"):
        grouped_mm_triton(x, w, c.float())


def test_registry_without_triton():
    """moevlm.kernels imports without triton; selecting the backend then names the package."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, moevlm.kernels as k\n"
        "assert 'triton' not in k.GROUPED_GEMMS, k.GROUPED_GEMMS\n"
        "try:\n"
        "    k.grouped_mm(torch.zeros(1, 4), torch.zeros(1, 4, 4), torch.tensor([1]), 'triton')\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "needs the `triton` package" in out.stdout and "pip install triton" in out.stdout
    assert "triton" in GROUPED_GEMMS


@pytest.mark.slow
def test_kernels_compile_for_hopper_without_a_gpu():
    """The GPU path (bf16 straight into tl.dot, software pipelining) compiles for sm_90 with ptxas: the interpreter
    never compiles, so this is what catches GPU-only compile errors on CPU."""
    stdout = run_compile_script(__file__)
    assert stdout.count("wgmma") == 3, stdout


def _compile_sm90():
    """Compile each kernel's first config, bf16, as a launch with contiguous operands would specialize it."""
    from moevlm.kernels import grouped_gemm_triton as g

    strides = [
        "stride_xm",
        "stride_xk",
        "stride_we",
        "stride_wk",
        "stride_wn",
        "stride_om",
        "stride_on",
    ]
    wgrad_strides = [
        "stride_xm",
        "stride_xk",
        "stride_dym",
        "stride_dyn",
        "stride_we",
        "stride_wk",
        "stride_wn",
    ]
    cases = [
        (g._grouped_mm_kernel, g._FWD_CONFIGS[0], strides, ("stride_xk", "stride_wn", "stride_on")),
        (
            g._grouped_mm_kernel,
            g._FWD_CONFIGS[0],
            strides,
            ("stride_xk", "stride_wk", "stride_on"),
        ),  # dgrad
        (
            g._grouped_wgrad_kernel,
            g._WGRAD_CONFIGS[0],
            wgrad_strides,
            ("stride_xk", "stride_dyn", "stride_wn"),
        ),
    ]
    for kernel, cfg, stride_names, ones in cases:
        fn = kernel.fn
        sig = dict(zip(fn.arg_names[:4], ["*bf16", "*bf16", "*bf16", "*i64"]))
        sig.update({n: "i32" for n in ["N", "K", "E", *stride_names]})
        consts = dict(
            cfg.kwargs, E_P2=128, DOT_IN_FP32=False, PRECISION="tf32", **{n: 1 for n in ones}
        )
        c = compile_sm90(fn, sig, consts, cfg.num_warps, cfg.num_stages, divisible=True)
        assert c.metadata.shared <= 227 * 1024, (fn.__name__, c.metadata.shared)
        print(
            fn.__name__,
            ones[1],
            cfg,
            "smem",
            c.metadata.shared,
            "wgmma" if "wgmma" in c.asm["ptx"] else "no-mma",
        )


if __name__ == "__main__" and sys.argv[1:] == ["--compile-sm90"]:
    _compile_sm90()
