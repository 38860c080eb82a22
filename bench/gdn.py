"""Gated DeltaNet: time of our layer (moevlm.model.gated_deltanet) beside transformers' Qwen3.5-MoE
layer on the same weights and input, same process; CPU and fp32 unless asked otherwise.

    python bench/gdn.py                  # Qwen3.5-35B-A3B's GDN widths, one row of 1024 tokens
    python bench/gdn.py --seq 2048 --batch 2 --docs 4 --repeat 5
    python bench/gdn.py --smoke          # tiny sizes, three repeats: that it runs
    python bench/gdn.py --device cuda --dtype bf16 --seq 8192   # adds ours through fla if it imports

forward           median (min) of `--repeat` forward calls (no autograd graph kept)
forward+backward  median (min) of `--repeat` forward + backward of a random projection of the output
                  (the paths take turns each repeat, so a shared machine's load falls on all alike)
ratio             transformers' min / this path's min (on a shared machine the min is the run the
                  load disturbed least)
ours, N docs      ours on the same row split into N equal documents (state and conv reset; the
                  reference has no document reset on its torch path, so it has no column)
vs transformers   max |ours - transformers| / max |transformers| of the forward output (one
                  document a row only)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import transformers
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

from moevlm.model.gated_deltanet import FLA_DTYPES, GatedDeltaNet, fla_missing, qkv_order

BY_KEY_HEAD = ("in_proj_qkv.weight", "conv1d.weight")  # ours: rows grouped by key head

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def modules(a):
    cfg = transformers.Qwen3_5MoeTextConfig(
        hidden_size=a.hidden,
        linear_num_key_heads=a.key_heads,
        linear_num_value_heads=a.value_heads,
        linear_key_head_dim=a.head_dim,
        linear_value_head_dim=a.head_dim,
        linear_conv_kernel_dim=a.conv,
    )
    ref = Qwen3_5MoeGatedDeltaNet(cfg, 0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.02 * torch.randn_like(p))
    ref.to(a.device, DTYPES[a.dtype])
    ours = {}
    for backend in ("torch", "fla") if fla_runs(a) else ("torch",):
        ours[backend] = GatedDeltaNet(
            a.hidden, a.key_heads, a.value_heads, a.head_dim, a.head_dim, a.conv, cfg.rms_norm_eps,
            a.chunk, backend=backend,
        ).to(a.device, DTYPES[a.dtype])  # fmt: skip
        rows = qkv_order(a.key_heads, a.value_heads, a.head_dim, a.head_dim).to(a.device)
        ours[backend].load_state_dict(  # our in_proj_qkv rows / conv channels: grouped by key head
            {k: v[rows] if k in BY_KEY_HEAD else v for k, v in ref.state_dict().items()}
        )
    return ref, ours


def fla_runs(a) -> bool:
    return a.device == "cuda" and DTYPES[a.dtype] in FLA_DTYPES and fla_missing() is None


def timed(fns: dict, repeat: int) -> dict:
    """{name: (median, min) seconds}: the calls take turns, so a load spike on a shared machine
    falls on all of them alike."""
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_fns(module, x, dy, **kw):
    def forward():
        with torch.no_grad():
            module(x, **kw)

    def forward_backward():
        module(x.requires_grad_(), **kw).backward(dy)
        x.grad = None
        module.zero_grad(set_to_none=True)

    return forward, forward_backward


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--key-heads", type=int, default=16)
    p.add_argument("--value-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--conv", type=int, default=4)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, three repeats")
    a = p.parse_args()
    if a.smoke:
        a.batch, a.seq, a.hidden, a.key_heads, a.value_heads, a.head_dim = 2, 100, 32, 2, 4, 8
        a.docs, a.repeat = 3, 3
    torch.manual_seed(0)
    ref, ours = modules(a)
    x, dy = (
        torch.randn(a.batch, a.seq, a.hidden, device=a.device, dtype=DTYPES[a.dtype]) for _ in "xy"
    )
    cuts = torch.linspace(0, a.batch * a.seq, a.batch * a.docs + 1, device=a.device).round().int()
    print(
        f"GDN B={a.batch} S={a.seq} D={a.hidden} heads {a.key_heads}/{a.value_heads}x{a.head_dim} "
        f"conv {a.conv} chunk {a.chunk}; {a.dtype} on {a.device}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}; fla: {fla_missing() or 'imports'}"
    )
    rows = {"transformers": (ref, {})}
    for backend, module in ours.items():
        rows[f"ours ({backend})"] = (module, {})
        rows[f"ours ({backend}), {a.docs} docs a row"] = (module, {"cu_seqlens": cuts})
    with torch.no_grad():
        y_ref = ref(x).float()
        err = {name: rel(m(x, **kw).float(), y_ref) for name, (m, kw) in rows.items() if not kw}
    rows = {name: step_fns(m, x, dy, **kw) for name, (m, kw) in rows.items()}
    fwd = timed({name: fns[0] for name, fns in rows.items()}, a.repeat)
    fb = timed({name: fns[1] for name, fns in rows.items()}, a.repeat)
    print(f"median (min) seconds of {a.repeat}; ratio = transformers' min / this one's min")
    print(
        f"{'':30s} {'forward':>17s} {'fwd+bwd':>17s} {'ratio fwd':>10s} {'ratio f+b':>10s}"
        f" {'vs transformers':>16s}"
    )
    base_f, base_fb = fwd["transformers"][1], fb["transformers"][1]
    for name in rows:
        (f, f_min), (b, b_min) = fwd[name], fb[name]
        e = f"{err[name]:16.1e}" if name in err else f"{'':16s}"
        print(
            f"{name:30s} {f:8.4f} ({f_min:6.4f}) {b:8.4f} ({b_min:6.4f}) "
            f"{base_f / f_min:10.2f} {base_fb / b_min:10.2f} {e}"
        )


if __name__ == "__main__":
    main()
