"""FP8 quantization: the Triton kernels (interpreter on CPU, conftest) against the
torch references, bit for bit (codes and scales compared as integers, NaN
included), for blockwise act / act_t / weight (2-D and 3-D) and MXFP8 along
dim -1 and 0, fp32 and bf16, pow2 on and off, ragged tails (M=130, K=200),
blocks of magnitudes 10^U(-6, 6), zero, huge and tiny blocks; the e4m3 rounding
against torch's cast on every tie; the NaN/Inf rule; round-trip error bounds;
hand-worked cases; counts_E checks; the custom ops' fakes and opcheck; backend
errors; and that the kernels compile for sm_90 with IEEE division.

Inputs are fresh every run: the seed is printed (shown with a failure) and
MOEVLM_TEST_SEED=<seed> replays it.
"""

import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from moevlm.kernels import _common as common  # noqa: E402
from moevlm.kernels import fp8_quant as Q  # noqa: E402
from moevlm.kernels import fp8_quant_ref as R  # noqa: E402
from moevlm.kernels import fp8_quant_triton as QT  # noqa: E402
from sm90 import compile_sm90, run_compile_script  # noqa: E402

FP8, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
M, K = 130, 200  # ragged: neither a multiple of 128 nor of 32
DTYPES = [torch.float32, torch.bfloat16]


pytestmark = pytest.mark.usefixtures("seed")  # fresh inputs every run (tests/conftest.py)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-exact comparison (NaN payloads and -0.0 included)."""
    return t.contiguous().view({1: torch.uint8, 4: torch.int32}[t.element_size()])


def assert_bits_equal(got, want, seed, what):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (
            what,
            i,
            g.dtype,
            w.dtype,
            g.shape,
            w.shape,
        )
        diff = (bits(g) != bits(w)).nonzero()
        assert diff.numel() == 0, (
            f"{what} output {i}: {diff.shape[0]} of {g.numel()} differ, first at "
            f"{diff[:4].tolist()} (seed={seed})"
        )


def data(shape, tile, dtype=torch.float32):
    """Normal values times 10^U(-6, 6) per tile (tile along the last two dims), one tile zero, one tile of
    huge (1e30) and one of tiny (1e-37, below the scale floor) values when there are enough tiles."""
    *lead, R, C = shape
    tr, tc = tile
    Rb, Cb = common.cdiv(R, tr), common.cdiv(C, tc)
    mag = 10.0 ** (torch.rand(*lead, Rb, Cb) * 12 - 6)
    flat = mag.view(-1, Rb * Cb)
    flat[:, 0], flat[:, -1] = 0.0, 1e30
    if Rb * Cb > 2:
        flat[:, 1] = 1e-37
    per_elem = mag.repeat_interleave(tr, -2).repeat_interleave(tc, -1)[..., :R, :C]
    return (torch.randn(shape) * per_elem).to(dtype)


# ---------------------------------------------------------------- Triton == torch, bit for bit


@pytest.mark.parametrize("pow2", [False, True], ids=["scale", "pow2"])
# fp32 in the fast tier, bf16 in the slow one
@pytest.mark.parametrize(
    "dtype", [DTYPES[0], *(pytest.param(d, marks=pytest.mark.slow) for d in DTYPES[1:])], ids=str
)
@pytest.mark.parametrize("layout", ["act", "act_t", "weight", "weight_E"])
def test_blockwise_triton_matches_torch(layout, dtype, pow2, seed):
    if layout == "act":
        x, fn = data((M, K), (1, 128), dtype), Q.quant_blockwise_act
    elif layout == "act_t":
        x, fn = data((M, K), (128, 1), dtype), Q.quant_blockwise_act_t
    else:
        shape = (K, M) if layout == "weight" else (3, K, M)
        x, fn = data(shape, (128, 128), dtype), Q.quant_blockwise_weight
    want = fn(x, pow2_scales=pow2)
    got = fn(x, pow2_scales=pow2, backend="triton")
    assert_bits_equal(got, want, seed, f"quant {layout}")
    codes, scales = want
    out_shape = (K, M) if layout == "act_t" else tuple(x.shape)
    assert (
        codes.dtype == FP8
        and codes.shape == out_shape
        and codes.is_contiguous()
        and scales.dtype == torch.float32
    )
    if layout == "act_t":
        assert_bits_equal(
            want,
            Q.quant_blockwise_act(x.t().contiguous(), pow2_scales=pow2),
            seed,
            "act_t = act(x^T)",
        )
    if pow2:
        m, _ = torch.frexp(scales)
        assert bool((m == 0.5).all()), "pow2 scales are powers of two"
    dq_layout = "weight" if layout.startswith("weight") else layout
    assert_bits_equal(
        [Q.dequant_blockwise(codes, scales, layout=dq_layout, backend="triton")],
        [Q.dequant_blockwise(codes, scales, layout=dq_layout)],
        seed,
        f"dequant {layout}",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [-1, 0])
def test_mxfp8_triton_matches_torch(dim, dtype, seed):
    x = data((M, K), (1, 32) if dim == -1 else (32, 1), dtype)
    want = Q.quant_mxfp8(x, dim=dim)
    got = Q.quant_mxfp8(x, dim=dim, backend="triton")
    assert_bits_equal(got, want, seed, f"mxfp8 dim={dim}")
    codes, scales = want
    assert codes.dtype == FP8 and scales.dtype == E8M0
    assert scales.shape == ((M, common.cdiv(K, 32)) if dim == -1 else (common.cdiv(M, 32), K))
    assert_bits_equal(
        [Q.dequant_mxfp8(codes, scales, dim=dim, backend="triton")],
        [Q.dequant_mxfp8(codes, scales, dim=dim)],
        seed,
        f"dequant mxfp8 dim={dim}",
    )


def test_fp16_3d_and_strided_inputs(seed):
    x = torch.randn(2, 3, 70) * 10.0 ** (torch.rand(2, 3, 1) * 8 - 4)
    assert_bits_equal(Q.quant_mxfp8(x, backend="triton"), Q.quant_mxfp8(x), seed, "mxfp8 3-D")
    assert Q.quant_mxfp8(x)[1].shape == (2, 3, 3)
    assert_bits_equal(
        Q.quant_mxfp8(x, dim=0, backend="triton"), Q.quant_mxfp8(x, dim=0), seed, "mxfp8 3-D dim=0"
    )
    # fp16 subnormals below 6e-5
    x16 = (torch.randn(M, K) * 10.0 ** (torch.rand(M, 1) * 11 - 7)).half()
    assert_bits_equal(
        Q.quant_blockwise_act(x16, backend="triton"), Q.quant_blockwise_act(x16), seed, "act fp16"
    )
    assert_bits_equal(Q.quant_mxfp8(x16, backend="triton"), Q.quant_mxfp8(x16), seed, "mxfp8 fp16")
    x_t = data((K, M), (128, 128)).t()  # a transposed view: read through its strides
    assert_bits_equal(
        Q.quant_blockwise_act(x_t, backend="triton"),
        Q.quant_blockwise_act(x_t.contiguous()),
        seed,
        "act of a transposed view",
    )
    w_t = data((2, M, K), (128, 128)).transpose(1, 2)
    assert_bits_equal(
        Q.quant_blockwise_weight(w_t, backend="triton"),
        Q.quant_blockwise_weight(w_t.contiguous()),
        seed,
        "weight of a transposed view",
    )


def test_empty_inputs():
    for backend in Q.BACKENDS:
        codes, scales = Q.quant_blockwise_act(torch.zeros(0, K), backend=backend)
        assert codes.shape == (0, K) and scales.shape == (0, 2)
        codes, scales = Q.quant_blockwise_act_t(torch.zeros(0, K), backend=backend)
        assert codes.shape == (K, 0) and scales.shape == (K, 0)


# ---------------------------------------------------------------- rounding, saturation, hand-worked


def _e4m3_grid() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours (ties), one fp32 ulp either side of each
    midpoint, values past 448 (saturate), all with both signs."""
    vals = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()  # 0 .. 448
    mids = (vals[1:] + vals[:-1]) / 2
    ups, downs = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))
    past = torch.tensor([448.5, 463.99, 464.0, 464.01, 479.0, 480.0, 500.0, 511.9])
    pos = torch.cat([vals, mids, ups, downs, past, torch.tensor([1e-45, 2.0**-10, 2.0**-11])])
    return torch.cat([pos, -pos])


def test_e4m3_rounding_is_torchs_cast_on_every_tie():
    """MX blocks led by 500 have e = floor(log2 500) - 8 = 0, scale 1: codes are saturate(x) cast, so the integer
    encoder meets torch's cast on every tie, both sides of each, subnormals and saturation."""
    grid = _e4m3_grid()
    n = grid.numel()
    x = torch.full((common.cdiv(n, 31), 32), 1.0)
    x[:, 0] = 500.0
    x.view(-1)[torch.arange(n) // 31 * 32 + 1 + torch.arange(n) % 31] = grid
    for backend in Q.BACKENDS:
        codes, scales = Q.quant_mxfp8(x, backend=backend)
        assert bits(scales).unique().tolist() == [127], "every block scale is 2^0"
        want = x.clamp(-448, 448).to(FP8)
        assert torch.equal(bits(codes), bits(want)), (backend, x[bits(codes) != bits(want)][:8])


def test_hand_worked_blockwise():
    x = torch.zeros(2, 256)
    x[0, :4] = torch.tensor([896.0, -448.0, 1.0, 3.0])  # amax 896 = 448 * 2 -> scale 2
    x[0, 128] = 448.0 * 3  # amax 1344: scale 3; pow2 -> 4
    x[1, 128:132] = -0.0  # an all-zero tile of -0.0: scale 1, codes 0x80
    for backend in Q.BACKENDS:
        codes, scales = Q.quant_blockwise_act(x, backend=backend)
        assert scales.tolist() == [[2.0, 3.0], [1.0, 1.0]]
        assert (
            codes[0, :4].float().tolist() == [448.0, -224.0, 0.5, 1.5]
            and codes[0, 128].float() == 448.0
        )
        assert bits(codes)[1, 128:132].tolist() == [0x80] * 4 and bits(codes)[1, :128].eq(0).all()
        codes, scales = Q.quant_blockwise_act(x, pow2_scales=True, backend=backend)
        # 1344 / 4 = 336 is a tie between e4m3's 320 (mantissa 010) and 352 (011): to even, 320
        assert scales.tolist() == [[2.0, 4.0], [1.0, 1.0]] and codes[0, 128].float() == 320.0
        # one ragged block
        codes, scales = Q.quant_blockwise_weight(torch.full((130, 5), 7.0), backend=backend)
        assert scales.tolist() == [[7.0 / 448.0], [7.0 / 448.0]] and bool(
            (codes.float() == 448.0).all()
        )


def test_hand_worked_mxfp8():
    x = torch.zeros(4, 32)
    # amax 3: e = floor(log2 3) - 8 = 1 - 8 = -7, x * 2^7
    x[0, :3] = torch.tensor([3.0, -1.0, 0.25])
    x[1, :2] = torch.tensor([3.9, 1.0])  # e = -7 too; 3.9 * 128 = 499.2 saturates to 448
    # an fp32 subnormal: e = -130 - 8 clamps to -127; code 2^-130 * 2^127 = 0.125
    x[3, 0] = 2.0**-130
    for backend in Q.BACKENDS:
        codes, scales = Q.quant_mxfp8(x, backend=backend)
        assert bits(scales).flatten().tolist() == [
            120,
            120,
            0,
            0,
        ]  # e + 127; all-zero row: 2^-127 (byte 0)
        assert scales.float()[2, 0] == 2.0**-127
        assert codes[0, :3].float().tolist() == [384.0, -128.0, 32.0]
        assert codes[1, :2].float().tolist() == [448.0, 128.0]
        assert bits(codes)[2].eq(0).all() and codes[3, 0].float() == 0.125


# ---------------------------------------------------------------- NaN / Inf


@pytest.mark.parametrize("fmt", ["act", "act_t", "weight", "mx_-1", "mx_0"])
def test_non_finite_tile_gets_nan_scale_and_nan_codes(fmt, seed):
    """A NaN, +Inf or -Inf anywhere in a tile: that tile's scale is NaN (fp32 0x7FC00000 / e8m0 0xFF) and all
    its codes 0x7F; every other tile is quantized as if the bad tiles were zeros."""
    x = torch.randn(M, K)
    if fmt == "act":
        fn, tile, bad_tiles = Q.quant_blockwise_act, (1, 128), [(0, 0), (5, 1), (129, 1)]
    elif fmt == "act_t":
        fn, tile, bad_tiles = Q.quant_blockwise_act_t, (128, 1), [(0, 0), (1, 7), (1, 199)]
    elif fmt == "weight":
        fn, tile, bad_tiles = Q.quant_blockwise_weight, (128, 128), [(0, 1), (1, 0)]
    else:
        dim = int(fmt[3:])
        fn, tile = (
            (lambda t, backend: Q.quant_mxfp8(t, dim=dim, backend=backend)),
            (1, 32) if dim == -1 else (32, 1),
        )
        bad_tiles = [(0, 0), (3, 6)] if dim == -1 else [(0, 0), (4, 3)]
    bad = torch.zeros(common.cdiv(M, tile[0]), common.cdiv(K, tile[1]), dtype=torch.bool)
    for (i, j), v in zip(bad_tiles, [torch.nan, torch.inf, -torch.inf]):
        bad[i, j] = True
        x[min(i * tile[0] + tile[0] // 2, M - 1), min(j * tile[1] + tile[1] // 2, K - 1)] = (
            v  # inside tile (i, j)
        )
    bad_elem = R._expand(bad[None], tile, M, K)[0]
    for backend in Q.BACKENDS:
        codes, scales = fn(x, backend=backend)
        clean_codes, clean_scales = fn(x.masked_fill(bad_elem, 0.0), backend=backend)
        dq = (
            Q.dequant_mxfp8(codes, scales, dim=int(fmt[3:]), backend=backend)
            if fmt.startswith("mx")
            else Q.dequant_blockwise(codes, scales, layout=fmt, backend=backend)
        )
        if fmt == "act_t":  # outputs are transposed
            codes, clean_codes, scales, clean_scales, dq = (
                t.t() for t in (codes, clean_codes, scales, clean_scales, dq)
            )
        nan_scale = 0xFF if fmt.startswith("mx") else 0x7FC00000
        assert bits(scales)[bad].eq(nan_scale).all() and bits(codes)[bad_elem].eq(0x7F).all(), (
            backend,
            seed,
        )
        assert torch.equal(bits(scales)[~bad], bits(clean_scales)[~bad]), (backend, seed)
        assert torch.equal(bits(codes)[~bad_elem], bits(clean_codes)[~bad_elem]), (backend, seed)
        assert dq[bad_elem].isnan().all() and dq[~bad_elem].isfinite().all(), backend


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("pow2", [False, True], ids=["scale", "pow2"])
def test_blockwise_round_trip_error(pow2, seed):
    """Stated bound: in e4m3's normal range (|x / scale| >= 2^-6) |dequant(quant(x)) - x| <= 2^-4 |x| (half an
    ulp of a 3-bit mantissa); everywhere |error| <= 2^-4 * amax of the tile (subnormal codes are absolute)."""
    x = data((M, K), (1, 128))
    codes, scales = Q.quant_blockwise_act(x, pow2_scales=pow2, backend="triton")
    dq = Q.dequant_blockwise(codes, scales, backend="triton")
    s = R._expand(scales[None], (1, 128), M, K)[0]
    normal = (x / s).abs() >= 2.0**-6
    err = (dq - x).abs()
    assert bool((err[normal] <= 2.0**-4 * x.abs()[normal]).all()), f"seed={seed}"
    amax = (
        torch.nn.functional.pad(x.abs(), (0, 56))
        .view(M, 2, 128)
        .amax(-1)
        .repeat_interleave(128, -1)[:, :K]
    )
    assert bool((err <= 2.0**-4 * amax).all()), f"seed={seed}"
    print(
        f"max relative error in the normal range: {float((err[normal] / x.abs()[normal]).max()):.4g}"
    )


@pytest.mark.parametrize("dim", [-1, 0])
def test_mxfp8_round_trip_error(dim, seed):
    """Unsaturated elements in e4m3's normal range: |error| <= 2^-4 |x|; saturated ones (block amax mantissa
    above 1.75): |error| < 2^-3 |x|."""
    x = torch.randn(M, K) * 10.0 ** (torch.rand(M, 1) * 8 - 4)
    codes, scales = Q.quant_mxfp8(x, dim=dim, backend="triton")
    dq = Q.dequant_mxfp8(codes, scales, dim=dim, backend="triton")
    tile = (1, 32) if dim == -1 else (32, 1)
    scaled = (x / R._expand(scales.float()[None], tile, M, K)[0]).abs()
    err = (dq - x).abs()
    normal, sat = (scaled >= 2.0**-6) & (scaled <= 448), scaled > 448
    assert bool((err[normal] <= 2.0**-4 * x.abs()[normal]).all()), f"seed={seed}"
    assert bool((err[sat] < 2.0**-3 * x.abs()[sat]).all()), f"seed={seed}"


# ---------------------------------------------------------------- expert counts


def test_act_t_with_counts():
    x = torch.randn(384, 72)
    counts = torch.tensor([128, 0, 256])
    for backend in Q.BACKENDS:
        assert_bits_equal(
            Q.quant_blockwise_act_t(x, counts_E=counts, backend=backend),
            Q.quant_blockwise_act_t(x, backend=backend),
            0,
            "counts change nothing",
        )
        with pytest.raises(
            ValueError, match=r"multiples of block=128.*experts \[0, 1\].*pad_multiple=128"
        ):
            Q.quant_blockwise_act_t(x, counts_E=torch.tensor([130, 126, 128]), backend=backend)
        with pytest.raises(ValueError, match="sum to 256, x has 384 rows"):
            Q.quant_blockwise_act_t(x, counts_E=torch.tensor([128, 128]), backend=backend)
    assert R.row_block_starts(counts).tolist() == [0, 1, 1]
    assert R.row_block_starts(torch.tensor([64, 32, 0]), block=32).tolist() == [0, 2, 3]


# ---------------------------------------------------------------- custom ops


def test_fakes_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.empty(M, K), torch.empty(3, K, M, dtype=torch.bfloat16)
        ops = torch.ops.moevlm
        cases = [
            (ops.fp8_quant_blockwise_act(x, 128, False), [(M, K), (M, 2)], [FP8, torch.float32]),
            (ops.fp8_quant_blockwise_act_t(x, 128, True), [(K, M), (K, 2)], [FP8, torch.float32]),
            (
                ops.fp8_quant_blockwise_weight(w, 128, False),
                [(3, K, M), (3, 2, 2)],
                [FP8, torch.float32],
            ),
            (ops.fp8_quant_mxfp8(x, 32, -1), [(M, K), (M, 7)], [FP8, E8M0]),
            (ops.fp8_quant_mxfp8(x, 32, 0), [(M, K), (5, K)], [FP8, E8M0]),
        ]
        c = torch.empty(M, K, dtype=FP8)
        cases += [
            (
                (ops.fp8_dequant_blockwise(c, torch.empty(M, 2), 128, "act"),),
                [(M, K)],
                [torch.float32],
            ),
            (
                (ops.fp8_dequant_mxfp8(c, torch.empty(5, K, dtype=E8M0), 32, 0),),
                [(M, K)],
                [torch.float32],
            ),
        ]
        for outs, shapes, dtypes in cases:
            assert [tuple(o.shape) for o in outs] == shapes and [o.dtype for o in outs] == dtypes


def test_opcheck_the_custom_ops():
    x = torch.randn(40, 72) * 3
    w = torch.randn(2, 40, 36)
    ops = torch.ops.moevlm
    torch.library.opcheck(ops.fp8_quant_blockwise_act.default, (x, 32, False))
    torch.library.opcheck(ops.fp8_quant_blockwise_act_t.default, (x, 32, True))
    torch.library.opcheck(ops.fp8_quant_blockwise_weight.default, (w, 32, False))
    torch.library.opcheck(ops.fp8_quant_mxfp8.default, (x, 32, 0))
    # The dequantize ops take fp8 inputs, which opcheck's test_schema cannot compare for mutation on CPU
    # (allclose has no fp8 kernel): the other three checks, and a bitwise no-mutation check by hand.
    not_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for (codes, scales), op, args in [
        (Q.quant_blockwise_act(x, 32), ops.fp8_dequant_blockwise.default, (32, "act")),
        (Q.quant_mxfp8(x), ops.fp8_dequant_mxfp8.default, (32, -1)),
    ]:
        before = bits(codes).clone(), bits(scales).clone()
        torch.library.opcheck(op, (codes, scales, *args), test_utils=not_schema)
        assert torch.equal(bits(codes), before[0]) and torch.equal(bits(scales), before[1])


# ---------------------------------------------------------------- errors


def test_bad_inputs_and_backends_are_named(monkeypatch):
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="choose one of"):
        Q.quant_blockwise_act(x, backend="cuda")
    with pytest.raises(TypeError, match="got torch.int64"):
        Q.quant_blockwise_act(x.long())
    with pytest.raises(ValueError, match="power-of-two block"):
        Q.quant_blockwise_act(x, block=96, backend="triton")
    with pytest.raises(ValueError, match="dim=-1 or dim=0"):
        Q.quant_mxfp8(torch.randn(2, 3, 4), dim=1)
    codes, scales = Q.quant_blockwise_act(x)
    with pytest.raises(ValueError, match=r"want fp32 scales \(4, 1\)"):
        Q.dequant_blockwise(codes, scales[:, :0])
    with pytest.raises(ValueError, match="layout"):
        Q.dequant_blockwise(codes, scales, layout="rows")
    monkeypatch.setattr(common, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        Q.quant_mxfp8(x, backend="triton")
    monkeypatch.setattr(common, "triton", None)
    with pytest.raises(ImportError, match="pip install triton"):
        Q.quant_blockwise_weight(x, backend="triton")


def test_imports_without_triton():
    """The references need no triton; backend='triton' then names the package."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from moevlm.kernels import fp8_quant as Q\n"
        "c, s = Q.quant_mxfp8(torch.ones(2, 32))\n"
        "assert Q.dequant_mxfp8(c, s).eq(1).all()\n"
        "try:\n"
        "    Q.quant_blockwise_act(torch.ones(2, 32), backend='triton')\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "needs the `triton` package (pip install triton)" in out.stdout, out.stdout


@pytest.mark.slow
def test_kernels_compile_for_hopper_with_ieee_division():
    """The interpreter never compiles: compile every kernel variant for sm_90 (ptxas, no GPU) and check the PTX
    divides with IEEE `div.rn.f32` (never the approximate `div.full`), flushes no subnormals and fuses no FMA,
    which is what keeps GPU results bit-equal to torch's."""
    stdout = run_compile_script(__file__)
    assert stdout.count("ok") == 7, stdout


def _compile_sm90():
    quant = [
        (1, 128, 32, 128, False, False, "*i16"),
        (128, 128, 128, 128, False, True, "*fp32"),
        (128, 1, 128, 32, False, False, "*fp16"),
        (1, 32, 128, 32, True, False, "*i16"),
        (32, 1, 32, 128, True, False, "*fp32"),
    ]  # *i16: bf16 read as its bits
    cases = [
        (
            QT._quant_kernel,
            [x, "*u8", "*u8" if mx else "*fp32"],
            12,
            dict(
                TILE_R=tr, TILE_C=tc, BLOCK_R=br, BLOCK_C=bc, MX=mx, POW2=p2, BF16_BITS=x == "*i16"
            ),
        )
        for tr, tc, br, bc, mx, p2, x in quant
    ]
    cases += [
        (
            QT._dequant_kernel,
            ["*u8", "*u8" if mx else "*fp32", "*fp32"],
            9,
            dict(TILE_R=1, TILE_C=128, BLOCK_R=32, BLOCK_C=128, MX=mx),
        )
        for mx in (False, True)
    ]
    for kernel, ptrs, n_ints, consts in cases:
        fn = kernel
        sig = dict(zip(fn.arg_names, ptrs + ["i32"] * n_ints))
        # as the launcher picks
        warps = 8 if consts["BLOCK_R"] * consts["BLOCK_C"] > QT._TILE_ELEMS else 4
        ptx = compile_sm90(fn, sig, consts, warps).asm["ptx"]
        bad = [s for s in ("div.full", "div.approx", ".ftz", "fma.", ".local") if s in ptx]
        wants_div = kernel is QT._quant_kernel and not consts["MX"]
        print(
            fn.__name__,
            consts,
            "ok" if not bad and ("div.rn.f32" in ptx) == wants_div else f"BAD {bad}",
        )


if __name__ == "__main__" and sys.argv[1:] == ["--compile-sm90"]:
    _compile_sm90()
