"""MoE kernels on one GPU: our Triton grouped GEMM and permute/unpermute beside
torch's and a per-expert loop.

Legend: T tokens, K top-k, E experts, H hidden, F expert hidden, M = T*K rows.

    python bench/kernels.py                       # a GPU: the full table
    python bench/kernels.py --shapes 30b --tokens 4096 16384
    TRITON_INTERPRET=1 python bench/kernels.py --smoke   # CPU: tiny shapes, checks the script runs

Grouped GEMM, for the two GEMMs of an expert MLP (gate_up: (M, H) x (E, H, 2F);
down: (M, F) x (E, F, H)), balanced routing (M/E rows per expert) and skewed
routing (expert e's share ~ 1/(e+1), some experts empty):
- ours: `moevlm.kernels.grouped_mm(..., "triton")`
- baseline: `torch._grouped_mm` (`grouped_mm(..., "torch")`), and a per-expert
  loop of matmuls (`"loop"`)
- forward, and forward+backward (dgrad + wgrad: 3x the forward FLOPs), as
  TFLOP/s = 2*M*K*N (x3) / median time, and the ratios ours/torch.

Permute / unpermute (top-k expansion into expert order, and the weighted sum
back): GB/s of the bytes each must move (read T*H, write M*H; and the
reverse), beside a device copy of the same number of bytes (`clone` of an
(M, H) tensor: read + write).

Outputs are checked against the loop / torch reference before timing.  Times
are CUDA-event medians of --iters runs after a warm-up; the device name and
torch/triton versions are printed with the table.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from moevlm.kernels import GROUPED_GEMMS, grouped_mm

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
    for _ in range(3):
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
    w = torch.randn(E, K, N, device=device, dtype=dtype) / K ** 0.5
    dy = torch.randn(M, N, device=device, dtype=dtype)
    ref = grouped_mm(x.float(), w.float(), counts, "loop")  # fp32 per-expert matmuls (_grouped_mm wants bf16 on CUDA)
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
        rows[b] = (flops / timed(fwd, iters, device) / 1e12, 3 * flops / timed(fwd_bwd, iters, device) / 1e12, err)
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
    torch.testing.assert_close(res["triton"][1].float(), res["torch"][1].float(), rtol=2e-2, atol=2e-2)
    xm = res["torch"][0]
    nbytes = (T * H + T * K * H) * x.element_size()  # each direction reads one side and writes the other
    copy_src = torch.empty(T * K, H, device=device, dtype=dtype)
    copy_s = timed(lambda: copy_src.clone(), iters, device)
    out = {"copy": 2 * copy_src.numel() * x.element_size() / copy_s / 1e9}  # bandwidth: read + write
    for backend in ("torch", "triton"):
        out[f"permute {backend}"] = nbytes / timed(lambda b=backend: P.permute(x, plan, backend=b), iters, device) / 1e9
        out[f"unpermute {backend}"] = nbytes / timed(lambda b=backend: P.unpermute(xm, plan, w, backend=b), iters,
                                                      device) / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["30b", "235b"], choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384, 32768])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (CPU: TRITON_INTERPRET=1)")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    shapes = dict(SHAPES)
    if a.smoke:
        shapes, a.tokens, a.iters, dtype = {"smoke": dict(E=4, K=2, H=64, F=32)}, [64], 2, torch.float32
        a.shapes = ["smoke"]
    elif device.type != "cuda":
        raise SystemExit("bench/kernels.py measures GPU kernels: run it on a CUDA device (or --smoke on CPU)")
    backends = [b for b in ("triton", "torch", "loop") if b in GROUPED_GEMMS]
    import triton

    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (interpreter smoke run)"
    print(f"device: {name}; torch {torch.__version__}, triton {triton.__version__}; {a.dtype if not a.smoke else 'fp32'}; "
          f"median of {a.iters}")
    print("\n| shape | tokens | GEMM | routing | " + " | ".join(f"{b} fwd TF/s | {b} f+b TF/s" for b in backends)
          + " | fwd ours/torch | f+b ours/torch |")
    print("|" + "---|" * (4 + 2 * len(backends) + 2))
    for s in a.shapes:
        E, K, H, F = (shapes[s][k] for k in ("E", "K", "H", "F"))
        for T in a.tokens:
            for gemm, (k_in, n_out) in (("gate_up", (H, 2 * F)), ("down", (F, H))):
                for kind in ("balanced", "skewed"):
                    r = bench_gemm(T * K, k_in, n_out, E, kind, dtype, device, a.iters, backends)
                    cells = " | ".join(f"{r[b][0]:.1f} | {r[b][1]:.1f}" for b in backends)
                    ratio = (f"{r['triton'][0] / r['torch'][0]:.2f}x | {r['triton'][1] / r['torch'][1]:.2f}x"
                             if "triton" in r and "torch" in r else "- | -")
                    print(f"| {s} | {T} | {gemm} | {kind} | {cells} | {ratio} |", flush=True)
    print("\n| shape | tokens | copy GB/s | permute torch | permute triton (% copy) | unpermute torch | unpermute triton (% copy) |")
    print("|---|---|---|---|---|---|---|")
    for s in a.shapes:
        E, K, H = (shapes[s][k] for k in ("E", "K", "H"))
        for T in a.tokens:
            g = bench_permute(T, K, H, E, dtype, device, a.iters)
            print(f"| {s} | {T} | {g['copy']:.0f} | {g['permute torch']:.0f} | {g['permute triton']:.0f} "
                  f"({100 * g['permute triton'] / g['copy']:.0f}%) | {g['unpermute torch']:.0f} | "
                  f"{g['unpermute triton']:.0f} ({100 * g['unpermute triton'] / g['copy']:.0f}%) |", flush=True)


if __name__ == "__main__":
    main()
