"""MoE kernels on one GPU: our Triton grouped GEMM, permute/unpermute and FP8 blockwise grouped GEMM
beside torch's (`torch._grouped_mm`, `torch._scaled_grouped_mm`) and a per-expert loop, as ratios.

Legend: T tokens, K top-k, E experts, H hidden, F expert hidden, M = T*K rows.

    python bench/kernels.py                       # a GPU: the full table
    python bench/kernels.py --shapes 30b --tokens 4096 16384
    TRITON_INTERPRET=1 python bench/kernels.py --smoke   # CPU: tiny shapes, checks the script runs
    python bench/kernels.py --no-fp8              # the bf16 tables only

Outputs are checked against a reference before timing; times are CUDA-event medians.  What each
column measures: docs/architecture.md, "Kernels: why they are built this way".
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics

import torch
from moevlm.kernels import GROUPED_GEMMS, grouped_mm, grouped_mm_loop
from moevlm.kernels import fp8_gemm as fg
from moevlm.kernels import fp8_gemm_torch as fgt
from moevlm.kernels import fp8_quant as fq
from moevlm.kernels.fp8_gemm_ref import BLOCK

SHAPES = {"30b": dict(E=128, K=8, H=2048, F=768), "235b": dict(E=128, K=8, H=4096, F=1536)}


def routing_counts(M: int, E: int, kind: str, device) -> torch.Tensor:
    if kind == "balanced":
        share = torch.full((E,), 1.0)
    else:  # skewed: ~1/(e+1), every 8th expert empty
        share = 1.0 / torch.arange(1, E + 1, dtype=torch.float64)
        share[7::8] = 0
    counts = (share / share.sum() * M).floor().long()
    counts[int(share.argmax())] += M - int(counts.sum())
    return counts.to(device)


def timed(fn, iters: int, device) -> float:
    """Median seconds of `fn()`."""
    for _ in range(
        0 if device.type == "cpu" else 3
    ):  # the CPU runs only the interpreter smoke check
        fn()
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            import time

            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def bench_gemm(M, K, N, E, kind, dtype, device, iters, backends):
    counts = routing_counts(M, E, kind, device)
    x = torch.randn(M, K, device=device, dtype=dtype)
    w = torch.randn(E, K, N, device=device, dtype=dtype) / K**0.5
    dy = torch.randn(M, N, device=device, dtype=dtype)
    # fp32 per-expert matmuls (_grouped_mm wants bf16 on CUDA)
    ref = grouped_mm(x.float(), w.float(), counts, "loop")
    rows = {}
    for b in backends:
        got = grouped_mm(x, w, counts, b).float()
        err = float((got - ref).norm() / ref.norm())
        assert err < 2e-2, f"{b}: relative error {err:.2e} against the fp32 reference"
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

        def fwd(b=b):
            grouped_mm(x, w, counts, b)

        def fwd_bwd(b=b, xg=xg, wg=wg):
            grouped_mm(xg, wg, counts, b).backward(dy)
            xg.grad = wg.grad = None

        flops = 2.0 * M * K * N
        rows[b] = (
            flops / timed(fwd, iters, device) / 1e12,
            3 * flops / timed(fwd_bwd, iters, device) / 1e12,
            err,
        )
    return rows


def bench_permute(T, K, H, E, dtype, device, iters):
    from moevlm.kernels import permute as P

    idx = torch.rand(T, E, device=device).topk(K, dim=-1).indices  # K distinct experts per token
    w = torch.softmax(torch.randn(T, K, device=device), -1)
    x = torch.randn(T, H, device=device, dtype=dtype)
    plan = P.permute_plan(idx, E)
    res = {}
    for backend in ("torch", "triton"):
        xm = P.permute(x, plan, backend=backend)
        y = P.unpermute(xm, plan, w, backend=backend)
        res[backend] = (xm, y)
    torch.testing.assert_close(res["triton"][0], res["torch"][0])
    torch.testing.assert_close(
        res["triton"][1].float(), res["torch"][1].float(), rtol=2e-2, atol=2e-2
    )
    xm = res["torch"][0]
    # each direction reads one side and writes the other
    nbytes = (T * H + T * K * H) * x.element_size()
    copy_src = torch.empty(T * K, H, device=device, dtype=dtype)
    copy_s = timed(lambda: copy_src.clone(), iters, device)
    # bandwidth: read + write
    out = {"copy": 2 * copy_src.numel() * x.element_size() / copy_s / 1e9}
    for backend in ("torch", "triton"):
        out[f"permute {backend}"] = (
            nbytes / timed(lambda b=backend: P.permute(x, plan, backend=b), iters, device) / 1e9
        )
        out[f"unpermute {backend}"] = (
            nbytes
            / timed(lambda b=backend: P.unpermute(xm, plan, w, backend=b), iters, device)
            / 1e9
        )
    return out


# ---------------------------------------------------------------- FP8 grouped GEMM


def _quantizers(recipe: str):
    """(act, act_t, weights) of a recipe, Triton quantizers: act(x_MK) 1xB along K; act_t(x_MK) -> x^T 1xB along
    M; weights(w_EKN) -> (the mm operand, the dgrad operand) per fp8_gemm_ref.operand_blocks (once per optimizer step)."""
    if recipe == "blockwise":

        def weights(w):
            q = fq.quant_blockwise_weight(w, backend="triton")
            return q, q  # the square block serves w and w^T

        return (
            functools.partial(fq.quant_blockwise_act, backend="triton"),
            functools.partial(fq.quant_blockwise_act_t, backend="triton"),
            weights,
        )

    def act_t(x):
        return fq.quant_mxfp8(x.t(), backend="triton")

    def weights(w):  # mm: 32x1 along K (quantize w^T along its last dim); dgrad: 1x32 along N
        q, s = fq.quant_mxfp8(w.transpose(1, 2), backend="triton")
        return (q.transpose(1, 2), s.transpose(1, 2)), fq.quant_mxfp8(w, backend="triton")

    return functools.partial(fq.quant_mxfp8, backend="triton"), act_t, weights


def fp8_step(x, dy, wts, counts, recipe, backend):
    """One micro-batch's expert GEMM in FP8: out (dy None), or (out, dx, dw fp32).  `wts` = weights(w)."""
    act, act_t, _ = _quantizers(recipe)
    (wq, ws), (wq_t, ws_t) = wts
    out = fg.fp8_grouped_mm(*act(x), wq, ws, counts, recipe=recipe, backend=backend)
    if dy is None:
        return out
    dx = fg.fp8_grouped_dgrad(*act(dy), wq_t, ws_t, counts, recipe=recipe, backend=backend)
    return (
        out,
        dx,
        fg.fp8_grouped_wgrad(*act_t(x), *act_t(dy), counts, recipe=recipe, backend=backend),
    )


def _take_expert(wts, e: int):
    """The operands of expert e, three times: the emulated slice has two neighbours' partial blocks around it."""
    return tuple((q[[e] * 3], s[[e] * 3]) for q, s in wts)


def check_fp8(x, dy, wts, counts, recipe, got, experts) -> float:
    """Worst relative Frobenius error of got = (out, dx, dw) against the emulation, over `experts`.  Expert e is
    emulated on rows [lo, hi): its rows widened to whole B-row scale blocks (so x^T and dy^T quantize into the
    same tiles as the full problem's), split as three experts (before, e, after)."""
    B, M = BLOCK[recipe], x.shape[0]
    starts = (counts.cumsum(0) - counts).tolist()
    sq = torch.zeros(3, 2, dtype=torch.float64)  # per output: sum |got - want|^2, sum |want|^2
    for e in experts:
        s, c = starts[e], int(counts[e])
        lo, hi = s // B * B, min(-(-(s + c) // B) * B, M)
        sub = torch.tensor([s - lo, c, hi - s - c], device=counts.device)
        want = fp8_step(x[lo:hi], dy[lo:hi], _take_expert(wts, e), sub, recipe, "emulate")
        for i, (g, w) in enumerate(
            zip(
                (got[0][s : s + c], got[1][s : s + c], got[2][e]),
                (want[0][s - lo : s - lo + c], want[1][s - lo : s - lo + c], want[2][1]),
            )
        ):
            sq[i] += torch.stack(
                [(g.double() - w.double()).square().sum(), w.double().square().sum()]
            ).cpu()
        if c == 0:
            assert float(got[2][e].abs().max()) == 0, f"dw of empty expert {e} is not zero"
    errs = (sq[:, 0] / sq[:, 1].clamp_min(1e-300)).sqrt().tolist()
    assert max(errs) <= 1e-2, f"fp8 {recipe}: relative error vs emulation (out, dx, dw) {errs}"
    return max(errs)


def _check_experts(counts, smoke: bool) -> list[int]:
    """Every expert under --smoke; else the first and last with rows, the middle one and the first empty one."""
    c = counts.tolist()
    if smoke:
        return list(range(len(c)))
    full = [e for e, n in enumerate(c) if n]
    return sorted({full[0], full[-1], len(c) // 2, *[e for e, n in enumerate(c) if not n][:1]})


def round_counts(counts, block: int = 128):
    """Each expert's rows rounded up to a multiple of `block` (the padding permute_plan(pad_multiple) makes)."""
    return (counts + block - 1) // block * block


def bench_fp8(M, K, N, E, kind, device, iters, smoke):
    """fp8 ours (blockwise, Triton): TF/s fwd and f+b, quantizer time shares, weight quantization ms and the
    check's error."""
    counts = routing_counts(M, E, kind, device)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device=device, dtype=torch.bfloat16) / K**0.5
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    act, act_t, weights = _quantizers("blockwise")
    wts = weights(w)
    err = check_fp8(
        x,
        dy,
        wts,
        counts,
        "blockwise",
        fp8_step(x, dy, wts, counts, "blockwise", "triton"),
        _check_experts(counts, smoke),
    )
    t = {
        "fwd": timed(lambda: fp8_step(x, None, wts, counts, "blockwise", "triton"), iters, device),
        "f+b": timed(lambda: fp8_step(x, dy, wts, counts, "blockwise", "triton"), iters, device),
        "q fwd": timed(lambda: act(x), iters, device),
        "q bwd": timed(lambda: (act(dy), act_t(x), act_t(dy)), iters, device),
        "w": timed(lambda: weights(w), iters, device),
    }
    flops = 2.0 * M * K * N
    return dict(
        fwd=flops / t["fwd"] / 1e12,
        fb=3 * flops / t["f+b"] / 1e12,
        q_fwd=t["q fwd"] / t["fwd"],
        q_fb=(t["q fwd"] + t["q bwd"]) / t["f+b"],
        w_ms=t["w"] * 1e3,
        w_share=t["w"] / t["f+b"],
        err=err,
    )


def bench_mx_torch(M, K, N, E, kind, device, iters, backend="torch"):
    """torch._scaled_grouped_mm MXFP8 on counts rounded up to 128: (TF/s fwd, f+b over the unpadded FLOPs, check
    error).  backend="emulate" (--smoke without the torch path): the operands' wiring checked, nothing timed."""
    counts = round_counts(routing_counts(M, E, kind, device))
    Mp = int(counts.sum())
    x = torch.randn(Mp, K, device=device, dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device=device, dtype=torch.bfloat16) / K**0.5
    dy = torch.randn(Mp, N, device=device, dtype=torch.bfloat16)
    wts = _quantizers("mxfp8")[2](w)
    got = fp8_step(x, dy, wts, counts, "mxfp8", backend)
    # against the unquantized GEMMs: the recipe's error (~4e-2), not a layout mix-up (O(1))
    if backend == "emulate":
        xd, wd, dyd = x.double(), w.double(), dy.double()
        want = (
            grouped_mm_loop(xd, wd, counts),
            grouped_mm_loop(dyd, wd.transpose(1, 2), counts),
            torch.stack(
                [a.T @ b for a, b in zip(xd.split(counts.tolist()), dyd.split(counts.tolist()))]
            ),
        )
        errs = [float((g.double() - r).norm() / r.norm()) for g, r in zip(got, want)]
        assert max(errs) < 0.08, f"mxfp8 emulation vs unquantized (out, dx, dw): {errs}"
        return None, None, max(errs)
    err = check_fp8(x, dy, wts, counts, "mxfp8", got, _check_experts(counts, False))
    flops = 2.0 * M * K * N
    fwd = timed(lambda: fp8_step(x, None, wts, counts, "mxfp8", backend), iters, device)
    fb = timed(lambda: fp8_step(x, dy, wts, counts, "mxfp8", backend), iters, device)
    return flops / fwd / 1e12, 3 * flops / fb / 1e12, err


def fp8_support(device, smoke: bool) -> tuple[bool, str]:
    """Whether our Triton FP8 GEMM runs here, and why not."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        return cap >= (8, 9), f"sm_{cap[0]}{cap[1]} has no FP8 tensor cores (sm89+ needed)"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False, "on the CPU the Triton kernels run only under TRITON_INTERPRET=1"
    return smoke, "the CPU runs only --smoke"


def mx_torch_support(device) -> tuple[bool, str]:
    """The probe's verdict on the torch MXFP8 path here (torch._scaled_grouped_mm for mm and dgrad, the per-expert
    torch._scaled_mm loop for wgrad), and its reason (first sentence)."""
    probe = fgt._probe(fgt._device_key(device))
    ok, why = probe["scaled_grouped_mm_mxfp8"]
    if ok and not probe["scaled_mm_mxfp8"][0]:
        ok, why = False, f"torch._scaled_mm MXFP8 (wgrad): {probe['scaled_mm_mxfp8'][1]}"
    return ok, why.split(". ")[0]


def _tf(v: float) -> str:
    return f"{v:.1f}" if v >= 1 else f"{v:.2g}"


def _ratio(v: float) -> str:
    return f"{v:.2f}x" if v >= 0.1 else f"{v:.2g}x"


def _fp8_cells(f: dict, r: dict) -> list[str]:
    """bench_fp8's figures beside the bf16 rows r (ours = "triton", torch._grouped_mm = "torch")."""
    base = ("triton", "torch")
    return [
        _tf(f["fwd"]),
        _tf(f["fb"]),
        *(_tf(r[b][i]) for b in base for i in (0, 1)),
        *(_ratio(f[k] / r[b][i]) for b in base for k, i in (("fwd", 0), ("fb", 1))),
        f"{100 * f['q_fwd']:.0f}%",
        f"{100 * f['q_fb']:.0f}%",
        f"{f['w_ms']:.3g} ({100 * f['w_share']:.0f}%)",
        f"{f['err']:.1e}",
    ]


def print_fp8_table(a, shapes, device, base):
    """The FP8 table; `base[(shape, tokens, gemm, kind)]` = bench_gemm's rows in bf16 (timed here when absent)."""
    mx_ok, why = mx_torch_support(device)
    if mx_ok:
        print(
            f"\ntorch._scaled_grouped_mm MXFP8: present ({why}); its rows per expert are rounded up to multiples "
            "of 128 (padding, as permute_plan(pad_multiple=128)); its TF/s count the unpadded FLOPs"
        )
    else:
        print(
            f"\ntorch._scaled_grouped_mm MXFP8: absent on {device} (probe: {why}); no torch mxfp8 columns"
        )
    mx_cols = " | torch mxfp8 fwd | torch mxfp8 f+b | mxfp8 err" if mx_ok else ""
    print(
        "\n| shape | tokens | GEMM | routing | fp8 ours fwd TF/s | fp8 ours f+b TF/s | bf16 ours fwd | bf16 ours f+b "
        "| torch bf16 fwd | torch bf16 f+b | fwd fp8/bf16 ours | f+b fp8/bf16 ours | fwd fp8/torch | "
        "f+b fp8/torch | quant % fwd | quant % f+b | w quant ms (% f+b) | err vs emulate"
        + mx_cols
        + " |"
    )
    print("|" + "---|" * (18 + 3 * mx_ok))
    for s in a.shapes:
        E, K, H, F = (shapes[s][k] for k in ("E", "K", "H", "F"))
        for T in a.tokens:
            for gemm, (k_in, n_out) in (("gate_up", (H, 2 * F)), ("down", (F, H))):
                for kind in ("balanced", "skewed"):
                    r = base.get((s, T, gemm, kind)) or bench_gemm(
                        T * K,
                        k_in,
                        n_out,
                        E,
                        kind,
                        torch.bfloat16,
                        device,
                        a.iters,
                        ("triton", "torch"),
                    )
                    cells = _fp8_cells(
                        bench_fp8(T * K, k_in, n_out, E, kind, device, a.iters, a.smoke), r
                    )
                    if mx_ok:
                        mf, mb, me = bench_mx_torch(T * K, k_in, n_out, E, kind, device, a.iters)
                        cells += [_tf(mf), _tf(mb), f"{me:.1e}"]
                    print(
                        f"| {s} | {T} | {gemm} | {kind} | " + " | ".join(cells) + " |", flush=True
                    )
    # the mxfp8 operands' wiring, through the emulation, so the smoke run covers it
    if not mx_ok and a.smoke:
        s = a.shapes[0]
        E, K, H = (shapes[s][k] for k in ("E", "K", "H"))
        err = bench_mx_torch(
            a.tokens[0] * K, H, H, E, "skewed", device, a.iters, backend="emulate"
        )[2]
        print(
            f"\nsmoke: the torch mxfp8 column's operands through backend='emulate' (not timed): relative error "
            f"vs unquantized {err:.1e} (< 0.08)"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["30b", "235b"], choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384, 32768])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shapes on any device (CPU: TRITON_INTERPRET=1)"
    )
    ap.add_argument(
        "--fp8",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the FP8 grouped GEMM table (default: on where our FP8 kernel runs: CUDA sm89+, or --smoke "
        "under TRITON_INTERPRET=1)",
    )
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    shapes = dict(SHAPES)
    if a.smoke:
        shapes, a.tokens, a.iters, dtype = (
            {"smoke": dict(E=4, K=2, H=64, F=32)},
            [64],
            1,
            torch.float32,
        )
        a.shapes = ["smoke"]
    elif device.type != "cuda":
        raise SystemExit(
            "bench/kernels.py measures GPU kernels: run it on a CUDA device (or --smoke on CPU)"
        )
    backends = [b for b in ("triton", "torch", "loop") if b in GROUPED_GEMMS]
    fp8_ok, fp8_why = fp8_support(device, a.smoke)
    if a.fp8 and not fp8_ok:
        raise SystemExit(f"--fp8: our FP8 grouped GEMM cannot run here: {fp8_why} (use --no-fp8)")
    a.fp8 = fp8_ok if a.fp8 is None else a.fp8
    base = {}  # bf16 grouped GEMM rows, the FP8 table's baselines
    import triton

    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (interpreter smoke run)"
    print(
        f"device: {name}; torch {torch.__version__}, triton {triton.__version__}; {a.dtype if not a.smoke else 'fp32'}; "
        f"median of {a.iters}"
    )
    print(
        "\n| shape | tokens | GEMM | routing | "
        + " | ".join(f"{b} fwd TF/s | {b} f+b TF/s" for b in backends)
        + " | fwd ours/torch | f+b ours/torch |"
    )
    print("|" + "---|" * (4 + 2 * len(backends) + 2))
    for s in a.shapes:
        E, K, H, F = (shapes[s][k] for k in ("E", "K", "H", "F"))
        for T in a.tokens:
            for gemm, (k_in, n_out) in (("gate_up", (H, 2 * F)), ("down", (F, H))):
                for kind in ("balanced", "skewed"):
                    r = bench_gemm(T * K, k_in, n_out, E, kind, dtype, device, a.iters, backends)
                    if dtype == torch.bfloat16 and "triton" in r and "torch" in r:
                        base[s, T, gemm, kind] = r
                    cells = " | ".join(f"{r[b][0]:.1f} | {r[b][1]:.1f}" for b in backends)
                    ratio = (
                        f"{r['triton'][0] / r['torch'][0]:.2f}x | {r['triton'][1] / r['torch'][1]:.2f}x"
                        if "triton" in r and "torch" in r
                        else "- | -"
                    )
                    print(f"| {s} | {T} | {gemm} | {kind} | {cells} | {ratio} |", flush=True)
    if a.fp8:
        print_fp8_table(a, shapes, device, base)
    else:
        print(f"\nFP8 grouped GEMM: skipped ({'--no-fp8' if fp8_ok else fp8_why})")
    print(
        "\n| shape | tokens | copy GB/s | permute torch | permute triton (% copy) | unpermute torch | unpermute triton (% copy) |"
    )
    print("|---|---|---|---|---|---|---|")
    for s in a.shapes:
        E, K, H = (shapes[s][k] for k in ("E", "K", "H"))
        for T in a.tokens:
            g = bench_permute(T, K, H, E, dtype, device, a.iters)
            print(
                f"| {s} | {T} | {g['copy']:.0f} | {g['permute torch']:.0f} | {g['permute triton']:.0f} "
                f"({100 * g['permute triton'] / g['copy']:.0f}%) | {g['unpermute torch']:.0f} | "
                f"{g['unpermute triton']:.0f} ({100 * g['unpermute triton'] / g['copy']:.0f}%) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
