"""Dispatch + combine across an expert-parallel group: time and achieved bandwidth per backend.

Legend: T tokens per rank, K top-k, D hidden, E experts, P = EP size = world size.

    torchrun --nproc-per-node 8 bench/dispatch.py                     # GPUs (NCCL), Qwen3-30B-A3B shape
    torchrun --nproc-per-node 2 bench/dispatch.py --tokens 512 --hidden 256   # CPU (gloo): informational

Backends, each on the same tokens and routing (checked equal to `alltoall` dropless before timing):
- `alltoall` dropless (the baseline: counts exchange, one host sync, uneven all-to-all);
- `alltoall` with `capacity_factor` f (fixed-size buffers, no host sync; the dropped share is printed);
- `deepep` / `hybridep` where `moevlm.dispatch.availability` says they can run here (hybridep also with
  each capacity factor: its static `num_permuted_tokens`); otherwise the reason.

Routing (`--routing`, all three by default): `balanced` (uniform random top-k), `skewed` (expert e
chosen with weight ~ 1/(e+1)) and `forced`: the model's forced-balanced routing
(model.moe_router_force_balance, `moevlm.model.moe.balanced_choice`: the token at position p to
experts (p K + j) mod E), every expert the same number of rows from every rank, as published
force-balanced throughputs are measured; its rows sit beside the same backends' `balanced` and
`skewed` ones.
Per backend: median time of dispatch+combine forward, and of forward+backward (the gradient of x runs
the reverse exchanges), over --iters after a warm-up, all ranks timed together (a barrier per iteration);
useful bandwidth = the bytes the dropless exchange moves for this rank (rows sent to and received from
other ranks, x D x element size, dispatch and combine) / time, the mean over ranks: the same useful bytes
for every backend, so a capacity mode's padding rows do not count and its dropped rows still do.  The device, world size, torch version and
backend are printed with the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from moevlm.dispatch import AllToAllDispatcher, build_dispatcher
from moevlm.dispatch.availability import unavailable_reason
from moevlm.model.moe import balanced_choice


def routing(
    T: int, E: int, K: int, kind: str, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    weights = (
        torch.ones(E) if kind == "balanced" else 1.0 / torch.arange(1, E + 1, dtype=torch.float32)
    )
    idx = torch.multinomial(weights.expand(T, E), K, replacement=False, generator=gen)
    if kind == "forced":
        # a rank's tokens as the positions 0..T-1 of its sequence
        idx = balanced_choice(torch.arange(T), E, K)
    w = torch.rand(T, K, generator=gen)
    return idx, w / w.sum(-1, keepdim=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def timed(fn, device, iters: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def exchanged_bytes(idx: torch.Tensor, E: int, D: int, elem: int) -> float:
    """Bytes this rank sends to and receives from other ranks in dispatch and combine (dropless rows: one per
    (token, choice) owned elsewhere), x D x element size."""
    P, rank = dist.get_world_size(), dist.get_rank()
    to_rank = torch.bincount((idx // (E // P)).flatten(), minlength=P).double()
    sent = float(to_rank.sum() - to_rank[rank])
    to_rank[rank] = 0
    dist.all_reduce(to_rank)  # [p] = rows every other rank sends to p
    return 2 * (sent + float(to_rank[rank])) * D * elem  # dispatch, then combine the other way


def run_backend(disp, x, idx, w, experts) -> tuple[torch.Tensor, torch.Tensor]:
    rows, counts, handle = disp.dispatch(x, idx, w)
    return disp.combine(experts(rows), handle)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--capacity", type=float, nargs="*", default=[1.0, 1.25, 2.0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument(
        "--routing",
        nargs="*",
        default=["balanced", "skewed", "forced"],
        choices=["balanced", "skewed", "forced"],
    )
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    dtype = (
        torch.bfloat16 if args.dtype == "bf16" or (args.dtype == "auto" and cuda) else torch.float32
    )
    E, K, D, T = args.experts, args.topk, args.hidden, args.tokens
    if rank == 0:
        name = (
            torch.cuda.get_device_name(device)
            if cuda
            else f"CPU, {torch.get_num_threads()} threads"
        )
        print(
            f"device: {name}; world {P} (EP = {P}); {dist.get_backend()}; torch {torch.__version__}; "
            f"T={T} tokens/rank, D={D}, E={E}, top-{K}, {dtype}"
        )
        for backend in ("deepep", "hybridep"):
            why = unavailable_reason(backend)
            emulated = why is None and getattr(sys.modules.get("deep_ep"), "EMULATOR", False)
            print(
                f"{backend}: "
                + ("available" if why is None else f"not run: {why}")
                + (
                    " (deep_ep is moevlm's TEST EMULATOR: its timings say nothing about the real package)"
                    if emulated
                    else ""
                )
            )
        print(
            "\n| routing | backend | fwd ms | fwd+bwd ms | useful GB/s (fwd) | tokens with a dropped choice | "
            "dropless / this (fwd) |"
        )
        print("|---|---|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(1234 + rank)
    # a per-expert "expert": y = x * s_e
    scale = torch.randn(E // P, 1, generator=gen).to(device, dtype)

    def experts_for(disp):
        def apply(rows):
            counts = disp.last_counts
            return (
                rows * scale.repeat_interleave(counts, 0, output_size=rows.shape[0])
                if rows.numel()
                else rows
            )

        return apply

    for kind in args.routing:
        idx, w = routing(T, E, K, kind, gen)
        idx, w = idx.to(device), w.to(device)
        x = torch.randn(T, D, generator=gen).to(device, dtype)
        byts = exchanged_bytes(idx.cpu(), E, D, x.element_size())
        variants = [("alltoall", None)] + [(f"alltoall cap {f}", f) for f in args.capacity]
        variants += [
            (b, (b, None)) for b in ("deepep", "hybridep") if unavailable_reason(b) is None
        ]
        if unavailable_reason("hybridep") is None:  # its no-sync mode: a static num_permuted_tokens
            variants += [(f"hybridep cap {f}", ("hybridep", f)) for f in args.capacity]
        base, base_t = None, None
        for label, spec in variants:
            if isinstance(spec, tuple):
                factor = {} if spec[1] is None else {"capacity_factor": spec[1]}
                disp = build_dispatcher(
                    spec[0], num_experts=E, top_k=K, ep_group=dist.group.WORLD, **factor
                )
            else:
                disp = AllToAllDispatcher(E, K, dist.group.WORLD, capacity_factor=spec)
            disp.last_counts = None
            real_dispatch = disp.dispatch

            def dispatch(x_, i_, w_, real_dispatch=real_dispatch, disp=disp):
                rows, counts, handle = real_dispatch(x_, i_, w_)
                disp.last_counts = counts
                return rows, counts, handle

            disp.dispatch = dispatch
            experts = experts_for(disp)
            y = run_backend(disp, x, idx, w, experts)
            base = y if base is None else base
            dropped = (
                float((y - base).abs().amax(-1).gt(1e-4 * base.abs().amax()).float().mean())
                if spec
                else 0.0
            )
            fwd = timed(lambda: run_backend(disp, x, idx, w, experts), device, args.iters)
            xg = x.clone().requires_grad_()
            fwd_bwd = timed(
                lambda: run_backend(disp, xg, idx, w, experts).sum().backward(), device, args.iters
            )
            gbs = torch.tensor([byts / fwd / 1e9])
            dist.all_reduce(gbs)
            if rank == 0:
                ratio = f"{base_t / fwd:.2f}x" if base_t is not None else "1.00x"
                print(
                    f"| {kind} | {label} | {fwd * 1e3:.2f} | {fwd_bwd * 1e3:.2f} | {float(gbs) / P:.2f} | "
                    f"{dropped:.1%} | {ratio} |"
                )
            if label == "alltoall":
                base_t = fwd
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without interpreter finalization: a gloo worker thread may still be releasing the last
    # collective's tensors, which takes the GIL, and a thread doing so while Python finalizes aborts
    # the process ("terminate called without an active exception"), seen here once in ~6 runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
