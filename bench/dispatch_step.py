"""One-device training step of the text model: `local` dispatcher vs the
`alltoall` dispatcher at EP=1.

Legend: B batch, S sequence, E experts, K top-k, D hidden, F expert hidden.

    python bench/dispatch_step.py                     # CPU: the tiny preset, fp32
    python bench/dispatch_step.py --preset 30b --layers 4 --seq 4096 --dtype bf16   # GPU

Variants, interleaved after a warm-up (median of --iters):
- `local`: the single-device dispatcher (the baseline: a stable sort by expert).
- `alltoall`: the EP dispatcher with an EP group of one, as `parallel.ep=1`
  runs it: no collective, no host sync (by design the same work as `local`).
- `alltoall+exchange`: the same dispatcher forced through its exchange path
  (`always_exchange=True`: count exchange, one host sync, two all-to-alls and
  the regroup, over a process group of one): what the EP machinery itself
  costs per layer, with no network in the way.

Same weights and tokens for every variant; the losses are checked equal
before timing.  Text-only input (the vision tower does not depend on the
dispatcher).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from moevlm.dispatch import AllToAllDispatcher, LocalDispatcher
from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model.moe import MoEBlock
from moevlm.train.metrics import describe_device


def config(preset: str, layers: int) -> VLMConfig:
    cfg = VLMConfig.preset("tiny" if preset == "tiny" else "qwen3_vl_30b_a3b")
    cfg = dataclasses.replace(
        cfg,
        text=dataclasses.replace(cfg.text, num_layers=layers or cfg.text.num_layers),
        attn_backend="sdpa",
    )
    cfg.moe.grouped_gemm = "torch"
    return cfg


def set_dispatchers(model, kind: str) -> None:
    for m in model.modules():
        if isinstance(m, MoEBlock):
            E, K = m.num_experts, m.router.top_k
            m.dispatcher = (
                LocalDispatcher(E, K)
                if kind == "local"
                else AllToAllDispatcher(
                    E, K, dist.group.WORLD, always_exchange=kind.endswith("exchange")
                )
            )


def step(model, ids, labels) -> float:
    out = model(ids, labels=labels)
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return float(out.loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=["tiny", "30b"], default="tiny")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the preset's)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,
    )
    cfg = config(a.preset, a.layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3VLMoe(cfg)
    model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype])
    ids = torch.randint(
        0, min(cfg.image_token_id, cfg.vision_start_token_id, 1000), (a.batch, a.seq), device=device
    )
    labels = ids.clone()
    kinds = ["local", "alltoall", "alltoall+exchange"]
    losses = {}
    for k in kinds:
        set_dispatchers(model, k)
        losses[k] = step(model, ids, labels)
    assert len({round(v, 4) for v in losses.values()}) == 1, losses
    times = {k: [] for k in kinds}
    for _ in range(a.iters):
        for k in kinds:
            set_dispatchers(model, k)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(model, ids, labels)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t0)
    base = statistics.median(times["local"])
    t = cfg.text
    print(
        f"device: {describe_device(device)}, torch {torch.__version__}; {a.preset}: {t.num_layers} layers, D={t.hidden_size}, "
        f"E={cfg.moe.num_experts}, K={cfg.moe.top_k}, F={cfg.moe.moe_intermediate_size}; B={a.batch} S={a.seq} {a.dtype}; "
        f"median of {a.iters}"
    )
    print("| dispatcher | step ms | local/this |")
    print("|---|---|---|")
    for k in kinds:
        m = statistics.median(times[k])
        print(f"| {k} | {m * 1e3:.2f} | {base / m:.3f}x |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without interpreter finalization: a gloo worker thread may still be releasing the last
    # collective's tensors, which takes the GIL, and a thread doing so while Python finalizes aborts
    # the process ("terminate called without an active exception"), seen here once in ~6 runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
