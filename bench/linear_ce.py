"""The LM head's loss: peak memory and time of the chunked linear cross-entropy (moevlm.model.linear_ce)
beside the whole-logits path it replaces (F.linear, promoted to fp32, F.cross_entropy), same process.

    python bench/linear_ce.py                                   # Qwen3-VL-30B-A3B's head, 8192 tokens
    python bench/linear_ce.py --tokens 8192 --hidden 2048 --vocab 151936 --chunk 1024 --small 1024,256,16384

memory  forward + backward of the summed loss at real size on fake tensors (no bytes allocated),
        the storages the ops make counted by moevlm.plan.fake.StorageTracker: the peak above the
        inputs (h, the weight, the targets), the gradients dh and dW included (both paths make them);
        `saved` is what the forward leaves for backward.  bf16 and fp32.
time    median of `--repeat` forward + backward steps with real fp32 tensors on this machine's CPU at
        the `--small` size (tokens, hidden, vocab), chunked over whole; the peak counted the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from moevlm.model.linear_ce import IGNORE_INDEX, linear_cross_entropy
from moevlm.plan.fake import StorageTracker

GiB = 2**30


def whole_logits(h_TD, w_VD, target_T):
    """The path the chunked loss replaces: the whole logits, promoted to fp32."""
    logits = F.linear(h_TD, w_VD)
    return F.cross_entropy(
        logits.to(torch.promote_types(logits.dtype, torch.float32)),
        target_T,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def paths(chunk: int) -> dict:
    return {
        "whole logits": whole_logits,
        f"chunks of {chunk}": lambda h, w, t: linear_cross_entropy(h, w, t, chunk),
    }


def inputs(T: int, D: int, V: int, dtype):
    h = torch.randn(T, D, dtype=dtype).requires_grad_()
    w = (torch.randn(V, D, dtype=dtype) * 0.02).requires_grad_()
    return h, w, torch.randint(0, V, (T,))


def peak(fn, T: int, D: int, V: int, dtype, fake: bool) -> tuple[int, int]:
    """(peak bytes above the inputs over forward + backward, bytes live after forward above them)."""
    with FakeTensorMode() if fake else contextlib.nullcontext():
        h, w, t = inputs(T, D, V, dtype)
        with StorageTracker() as mem:
            mem.track([h, w, t])
            base = mem.live_bytes
            loss = fn(h, w, t)
            saved = mem.live_bytes - base
            loss.backward()
        return mem.peak_bytes - base, saved


def seconds(fn, T: int, D: int, V: int, repeat: int) -> float:
    torch.manual_seed(0)
    h, w, t = inputs(T, D, V, torch.float32)
    times = []
    for _ in range(repeat + 1):  # the first is a warm-up
        h.grad = w.grad = None
        start = time.perf_counter()
        fn(h, w, t).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{name}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--small", default="1024,256,16384", help="tokens,hidden,vocab of the timing")
    p.add_argument("--small-chunk", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    T, D, V = a.tokens, a.hidden, a.vocab
    print(f"machine: {machine()}\n")
    print(f"peak memory of the loss, forward + backward, T={T} D={D} V={V} (fake tensors)\n")
    print("| dtype | path | peak GiB | saved for backward MiB | peak / whole |")
    print("|---|---|---:|---:|---:|")
    for dtype in (torch.bfloat16, torch.float32):
        rows = [(name, *peak(fn, T, D, V, dtype, fake=True)) for name, fn in paths(a.chunk).items()]
        for name, top, saved in rows:
            print(
                f"| {str(dtype)[6:]} | {name} | {top / GiB:.2f} | {saved / 2**20:.2f} | "
                f"{top / rows[0][1]:.3f} |"
            )
    t, d, v = (int(x) for x in a.small.split(","))
    print(f"\nfp32 on this CPU, T={t} D={d} V={v}, forward + backward (median of {a.repeat})\n")
    print("| path | ms | time / whole | peak MiB | peak / whole |")
    print("|---|---:|---:|---:|---:|")
    rows = []
    for name, fn in paths(a.small_chunk).items():
        top = peak(fn, t, d, v, torch.float32, fake=False)[0]
        rows.append((name, seconds(fn, t, d, v, a.repeat), top))
    for name, sec, top in rows:
        print(
            f"| {name} | {sec * 1e3:.1f} | {sec / rows[0][1]:.2f} | {top / 2**20:.1f} | "
            f"{top / rows[0][2]:.3f} |"
        )


if __name__ == "__main__":
    main()
