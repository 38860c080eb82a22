"""FP8 numerics on the CPU: what blockwise and MXFP8 quantization lose, and what our Triton FP8 GEMM
adds to it, as Markdown tables (1: quantization error per format and input; 2: GEMM error, the
emulation against the unquantized fp64 GEMM and our kernel against the emulation).

Legend: M rows, K in-features, N out-features, E experts; codes e4m3, blockwise scales fp32 per
1x128 / 128x128 tile, MXFP8 scales e8m0 per 1x32 block.

    TRITON_INTERPRET=1 python bench/fp8_numerics.py    # CPU: torch references and the Triton kernels
    python bench/fp8_numerics.py --no-triton           # the torch references only

Fixed seeds (--seed); about a minute on 2 CPU cores.  The columns: docs/architecture.md, "Kernels:
why they are built this way".
"""

from __future__ import annotations

import argparse
import os
import platform

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before moevlm.kernels.fp8_* is imported

from moevlm.kernels import fp8_quant as fq  # noqa: E402

FORMATS = ("blockwise", "blockwise pow2", "mxfp8")
COUNTS = [300, 0, 77, 640, 5]
K, N = 512, 384
OPS = ("mm", "dgrad", "wgrad")


OUTLIERS = "act, 4 outlier channels x100"


def with_outliers(x: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x with 4 random columns scaled by 100, and the mask of the other columns."""
    cols = torch.randperm(x.shape[1], generator=g)[:4]
    out, rest = x.clone(), torch.ones(x.shape[1], dtype=torch.bool)
    out[:, cols] *= 100
    rest[cols] = False
    return out, rest


def inputs(seed: int, device) -> tuple[dict[str, tuple[str, torch.Tensor]], torch.Tensor]:
    """name -> (kind "act" (x_MK) or "weight" (w_KN), tensor); and the outlier case's non-outlier columns."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 1024, generator=g)
    outliers, rest = with_outliers(x, g)
    cases = {
        "gaussian act": ("act", x),
        OUTLIERS: ("act", outliers),
        "weight, std 0.02": ("weight", torch.randn(1024, 768, generator=g) * 0.02),
        "bf16 gaussian act": ("act", torch.randn(512, 1024, generator=g).bfloat16()),
    }
    return {k: (kind, t.to(device)) for k, (kind, t) in cases.items()}, rest.to(device)


# ---------------------------------------------------------------- 1. quantization


def quantize(fmt: str, kind: str, x: torch.Tensor, backend: str, transposed: bool = False):
    """(codes, scales, tile) of 2-D x in a format; `transposed`: the activation's other layout (x^T 1xB along M)."""
    if fmt == "mxfp8":
        dim = 0 if kind == "weight" or transposed else -1
        return (*fq.quant_mxfp8(x, dim=dim, backend=backend), (32, 1) if dim == 0 else (1, 32))
    pow2 = fmt == "blockwise pow2"
    if kind == "weight":
        return (*fq.quant_blockwise_weight(x, pow2_scales=pow2, backend=backend), (128, 128))
    if transposed:
        return (*fq.quant_blockwise_act_t(x, pow2_scales=pow2, backend=backend), (1, 128))
    return (*fq.quant_blockwise_act(x, pow2_scales=pow2, backend=backend), (1, 128))


def per_element(t: torch.Tensor, tile: tuple[int, int], shape) -> torch.Tensor:
    """Per-tile values (R/tr, C/tc) -> per element (R, C)."""
    return t.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[: shape[0], : shape[1]]


def tile_amax(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    (R, C), (tr, tc) = x.shape, tile
    t = x.abs().reshape(R // tr, tr, C // tc, tc)  # the shapes here are multiples of the tiles
    return per_element(t.amax(dim=(1, 3)), tile, x.shape)


def quant_stats(fmt: str, kind: str, x: torch.Tensor, rest: torch.Tensor | None = None) -> dict:
    """The table's figures; "rel_rest": the relative error over the columns `rest` only."""
    codes, scales, tile = quantize(fmt, kind, x, "torch")
    xd = x.double()
    scale = per_element(scales.double(), tile, x.shape)
    deq = codes.double() * scale
    err = (deq - xd).abs()
    big = xd.abs() > 0.01 * tile_amax(xd, tile)
    u8 = codes.view(torch.uint8)
    return {
        "rel": float(err.norm() / xd.norm()),
        "max_rel": float((err[big] / xd.abs()[big]).max()),
        "sat": float((xd.abs() / scale > 464).double().mean()),
        "sub": float((((u8 & 0x78) == 0) & ((u8 & 0x07) != 0)).double().mean()),
        "flush": float(((xd != 0) & (deq == 0)).double().mean()),
        "rel_rest": None if rest is None else float(err[:, rest].norm() / xd[:, rest].norm()),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


def triton_bit_exact(fmt: str, kind: str, x: torch.Tensor) -> str:
    layouts = (False,) if kind == "weight" else (False, True)
    for transposed in layouts:
        ref = quantize(fmt, kind, x, "torch", transposed)[:2]
        got = quantize(fmt, kind, x, "triton", transposed)[:2]
        if not all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, ref)):
            return f"NO ({'transposed' if transposed else 'row'} layout)"
    return "yes" + (" (both layouts)" if len(layouts) > 1 else "")


def print_quant_table(cases: dict, rest: torch.Tensor, triton_ok: bool) -> None:
    print("\n### 1. Quantization error: dequant(quant(x)) vs x\n")
    print(
        "| input | format | rel. err | max rel. err (\\|x\\| > 1% tile amax) | saturated | subnormal | flushed | "
        "Triton == torch |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")
    rest_err = {}
    for name, (kind, x) in cases.items():
        for fmt in FORMATS:
            s = quant_stats(fmt, kind, x, rest if name == OUTLIERS else None)
            rest_err[fmt] = s["rel_rest"] if name == OUTLIERS else rest_err.get(fmt)
            exact = triton_bit_exact(fmt, kind, x) if triton_ok else "-"
            print(
                f"| {name} | {fmt} | {s['rel']:.2e} | {s['max_rel']:.2e} | {100 * s['sat']:.3f}% | "
                f"{100 * s['sub']:.3f}% | {100 * s['flush']:.3f}% | {exact} |",
                flush=True,
            )
    print(
        f"\nWith outliers, rel. err divides by a norm the outliers dominate (and with fp32 scales each outlier, "
        f"its tile's amax, is exact); over the other {int(rest.sum())} columns alone it is "
        + ", ".join(f"{e:.2e} {fmt}" for fmt, e in rest_err.items())
        + ": a tile holding an outlier gets a 100x "
        "scale, but its other values stay normal e4m3 codes (range 448 / 2^-6), so they keep their precision."
    )


# ---------------------------------------------------------------- 2. GEMMs


def gemm_data(seed: int, device):
    """x (M, K), x with 4 outlier channels, w (E, K, N), dy (M, N)."""
    g = torch.Generator().manual_seed(seed + 1)
    M = sum(COUNTS)
    x = torch.randn(M, K, generator=g)
    outliers = with_outliers(x, g)[0]
    w = torch.randn(len(COUNTS), K, N, generator=g) * 0.02
    dy = torch.randn(M, N, generator=g)
    return (t.to(device) for t in (x, outliers, w, dy))


def operands(op: str, recipe: str, x, w, dy):
    """The op's quantized operands in fp8_gemm's layouts (its docstring's table), torch reference quantizers;
    w is (K, N) dense or (E, K, N) grouped."""
    if recipe == "blockwise":
        if op == "wgrad":
            return (*fq.quant_blockwise_act_t(x), *fq.quant_blockwise_act_t(dy))
        return (*fq.quant_blockwise_act(x if op == "mm" else dy), *fq.quant_blockwise_weight(w))
    if op == "wgrad":
        return (*fq.quant_mxfp8(x.t()), *fq.quant_mxfp8(dy.t()))
    if op == "dgrad":  # w 1x32 along N
        return (*fq.quant_mxfp8(dy), *fq.quant_mxfp8(w))
    wq, ws = fq.quant_mxfp8(w.transpose(-1, -2))  # 32x1 along K: w^T along its last dim
    return (*fq.quant_mxfp8(x), wq.transpose(-1, -2), ws.transpose(-1, -2))


def run(op: str, recipe: str, backend: str, args, counts) -> torch.Tensor:
    from moevlm.kernels import fp8_gemm as fg

    kw = dict(recipe=recipe, backend=backend, out_dtype=torch.float32)
    if counts is None:
        return {"mm": fg.fp8_linear, "dgrad": fg.fp8_linear_dgrad, "wgrad": fg.fp8_linear_wgrad}[
            op
        ](*args, **kw)
    fn = {"mm": fg.fp8_grouped_mm, "dgrad": fg.fp8_grouped_dgrad, "wgrad": fg.fp8_grouped_wgrad}[op]
    return fn(*args, torch.tensor(counts, device=args[0].device), **kw)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def gemm_row(op, recipe, layout, data, triton_ok) -> list[str]:
    from moevlm.kernels.fp8_gemm_ref import unquantized_reference

    x, outliers, w, dy = data
    counts = None if layout == "dense" else COUNTS
    w = w[3] if counts is None else w
    cells = []
    for xx in (x, outliers):
        want = run(op, recipe, "emulate", operands(op, recipe, xx, w, dy), counts)
        cells.append(f"{rel(want, unquantized_reference(op, xx, w, dy, counts)):.2e}")
    if recipe != "blockwise" or not triton_ok:
        return cells + ["-", "-"]
    args = operands(op, recipe, x, w, dy)
    got, want = run(op, recipe, "triton", args, counts), run(op, recipe, "emulate", args, counts)
    return cells + [
        f"{rel(got, want):.1e}",
        f"{float((got - want).abs().max() / want.abs().max()):.1e}",
    ]


def print_gemm_table(seed: int, device, triton_ok: bool) -> None:
    data = tuple(gemm_data(seed, device))
    print(
        f"\n### 2. GEMM error: K = {K}, N = {N}; grouped: expert rows {COUNTS}; dense: M = {sum(COUNTS)}\n"
    )
    print(
        "| op | layout | recipe | (a) emulate vs fp64, gaussian x | (a) outlier x | (b) Triton vs emulate | "
        "(b) max \\|diff\\| / max \\|emulate\\| |"
    )
    print("|---|---|---|---:|---:|---:|---:|")
    for recipe in ("blockwise", "mxfp8"):
        for layout in ("dense", "grouped"):
            for op in OPS:
                cells = gemm_row(op, recipe, layout, data, triton_ok)
                print(f"| {op} | {layout} | {recipe} | " + " | ".join(cells) + " |", flush=True)


# ---------------------------------------------------------------- main


def triton_version() -> str | None:
    try:
        import triton
    except ModuleNotFoundError:
        return None
    return triton.__version__


def triton_support(device) -> tuple[bool, bool, str]:
    """(the Triton quantizers run, the Triton FP8 GEMM runs, why not)."""
    if triton_version() is None:
        return False, False, "triton is not installed"
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        return True, cap >= (8, 9), f"sm_{cap[0]}{cap[1]} has no FP8 tensor cores (sm89+)"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False, False, "on the CPU the Triton kernels run only under TRITON_INTERPRET=1"
    return True, True, ""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of every input (default 0)")
    ap.add_argument(
        "--no-triton", action="store_true", help="skip the Triton kernels (torch references only)"
    )
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quant_ok, gemm_ok, why = (
        (False, False, "--no-triton") if a.no_triton else triton_support(device)
    )
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    )
    print(
        f"device: {name}; torch {torch.__version__}, triton {triton_version() or 'absent'}; "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}; seed {a.seed}"
    )
    if not (quant_ok and gemm_ok):
        print(f"Triton {'GEMM' if quant_ok else 'kernels'} skipped: {why}")
    print_quant_table(*inputs(a.seed, device), quant_ok)
    print_gemm_table(a.seed, device, gemm_ok)


if __name__ == "__main__":
    main()
