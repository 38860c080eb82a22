"""Where a profiled step's device time went, from its torch.profiler trace (train.profile_steps=[A,B]).

    python bench/trace_top.py RUN_DIR/profile/rank0_steps20-20.json [--top 15]

Prints markdown tables: the device's busy time against the traced span (the union of kernel, copy
and memset intervals: idle is what the host left the device waiting), the busy time by kind of
kernel (matrix products, attention, Triton, elementwise, reductions, copies, communication, other),
by the step's parts (each kernel counted in the innermost `moevlm.<part>` range open on the host when
it was launched, on any thread: backward's kernels are launched by autograd's device thread while
the main thread waits in `moevlm.backward`; a kernel without its launch in the trace falls back to the
ranges on the device's timeline), and the kernels that took most.  A trace without device work (a CPU run) lists the parts' host times instead.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# (kind, substrings of the lower-cased kernel name), first match wins
KINDS = (
    ("communication", ("nccl", "deep_ep", "all_to_all", "alltoall")),
    ("copy / memset", ("memcpy", "memset")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn")),
    (
        "matrix product",
        ("gemm", "cutlass", "xmma", "nvjet", "grouped_mm", "wgmma", "matmul", "cublas"),
    ),
    ("triton", ("triton",)),
    ("reduction", ("reduce", "softmax", "norm", "sum_", "cross_entropy")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "copy_kernel", "fill", "index")),
)


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def kind_of(name: str, cat: str) -> str:
    low = name.lower()
    if cat != "kernel":
        return "copy / memset"
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def innermost(points: list[float], ranges: list[dict]) -> list[str | None]:
    """Per time point, the name of the shortest range holding it, else None."""
    ranges = sorted(ranges, key=lambda r: r["ts"])
    out: list[str | None] = [None] * len(points)
    open_, i = [], 0
    for j in sorted(range(len(points)), key=points.__getitem__):
        ts = points[j]
        while i < len(ranges) and ranges[i]["ts"] <= ts:
            open_.append(ranges[i])
            i += 1
        open_ = [r for r in open_ if r["ts"] + r["dur"] > ts]
        out[j] = min(open_, key=lambda r: r["dur"])["name"] if open_ else None
    return out


def part_ranges(xs: list[dict], cat: str) -> list[dict]:
    """The `moevlm.<part>` ranges of one category: host (`user_annotation`) or device timeline
    (`gpu_user_annotation`)."""
    return [e for e in xs if e.get("cat") == cat and e["name"].startswith("moevlm.")]


def parts_of(dev: list[dict], xs: list[dict]) -> list[str | None]:
    """Each device operation's part: the innermost host `moevlm.*` range at its launch (matched by
    the trace's correlation id), else the innermost device-timeline range at its start."""
    launched = {
        e["args"]["correlation"]: e["ts"]
        for e in xs
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    at = [launched.get(e.get("args", {}).get("correlation")) for e in dev]
    by_host = innermost(
        [t if t is not None else float("-inf") for t in at], part_ranges(xs, "user_annotation")
    )
    by_device = innermost([e["ts"] for e in dev], part_ranges(xs, "gpu_user_annotation"))
    return [h if t is not None else d for t, h, d in zip(at, by_host, by_device)]


def table(title: tuple[str, ...], rows: list[tuple]) -> list[str]:
    lines = ["| " + " | ".join(title) + " |", "|" + "---|" * len(title)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def summarize(events: list[dict], top: int = 15) -> str:
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    dev = sorted((e for e in xs if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    if not dev:
        host = defaultdict(float)
        for e in part_ranges(xs, "user_annotation"):
            host[e["name"][len("moevlm.") :]] += e["dur"]
        rows = [(n, f"{us / 1e3:.2f}") for n, us in sorted(host.items(), key=lambda x: -x[1])]
        return "\n".join(
            ["no device work in this trace (a CPU run): the parts' host times"]
            + table(("part", "host ms"), rows)
        )
    span = dev[-1]["ts"] + dev[-1]["dur"] - dev[0]["ts"]
    busy = busy_us([(e["ts"], e["ts"] + e["dur"]) for e in dev])
    total = sum(e["dur"] for e in dev)
    by_kind, by_part, by_name, calls = (
        defaultdict(float),
        defaultdict(float),
        defaultdict(float),
        defaultdict(int),
    )
    where = parts_of(dev, xs)
    for e, part in zip(dev, where):
        by_kind[kind_of(e["name"], e["cat"])] += e["dur"]
        by_part[part[len("moevlm.") :] if part else "(outside the parts)"] += e["dur"]
        by_name[e["name"]] += e["dur"]
        calls[e["name"]] += 1

    def pct(us: float) -> str:
        return f"{100 * us / total:.1f}"

    out = [
        f"device span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms ({100 * busy / span:.1f}%), "
        f"idle {(span - busy) / 1e3:.2f} ms; {len(dev)} device operations summing to {total / 1e3:.2f} ms"
    ]
    out += table(
        ("kind", "ms", "% of device time"),
        [(k, f"{us / 1e3:.2f}", pct(us)) for k, us in sorted(by_kind.items(), key=lambda x: -x[1])],
    )
    out += table(
        ("part", "device ms", "% of device time"),
        [(p, f"{us / 1e3:.2f}", pct(us)) for p, us in sorted(by_part.items(), key=lambda x: -x[1])],
    )
    ranked = sorted(by_name.items(), key=lambda x: -x[1])[:top]
    out += table(
        ("kernel", "calls", "ms", "% of device time"),
        [(n[:90].replace("|", "/"), calls[n], f"{us / 1e3:.2f}", pct(us)) for n, us in ranked],
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="a torch.profiler chrome trace (.json or .json.gz)")
    p.add_argument("--top", type=int, default=15, help="kernels listed (default 15)")
    a = p.parse_args(argv)
    if not a.trace.is_file():
        print(f"trace_top: no trace at {a.trace}", file=sys.stderr)
        return 2
    print(f"trace: {a.trace}")
    print(summarize(load(a.trace), a.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
