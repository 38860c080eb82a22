"""Saved activations on the device per activation-offload scope, without and with offload.

    python bench/offload_memory.py                       # tiny model, CPU, fp32
    python bench/offload_memory.py --preset qwen3_vl_30b_a3b --layers 2 --seq 4096 --device cuda --dtype bf16

One micro-batch (text with two images, bench/recompute_memory.py's) through one process; for each
(recompute, offload scope) row a fresh copy of the same weights, forward under `SavedBytes`, then
backward, with and without `apply_offload`:

    on device   the distinct storages held for backward that are still the original ones (on the
                device on a GPU; on the CPU the storages the forward made, not the offload's
                host-to-host copies): autograd's saved tensors, each recompute region's inputs, the
                collective outputs the selective cache keeps; parameters left out.  An offloaded
                tensor's storage counts only if another save (outside the scope) holds it too.
    host        the bytes of the offload's distinct host copies (a saved view's span of its storage)
    share       1 - (on device with offload) / (on device without): the part of the saved bytes
                the scope moved off the device
    step time   median of `--repeat` forward+backward steps with offload over without (on the CPU
                the copies are synchronous host copies: not a GPU's overlap)
    peak        on CUDA, torch.cuda.max_memory_allocated of a step with offload over without
"""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recompute_memory import model_and_batch, parse_args, step_seconds

from moevlm.parallel.offload import MODULES, apply_offload, check
from moevlm.parallel.recompute import SavedBytes, apply_recompute, describe

RECOMPUTES = [("none", ()), ("selective", ("core_attn",)), ("full", ())]


def rows():
    """(recompute, offload scopes): every scope alone and all together under each recompute setting,
    where the scope is not inside a recomputed region."""
    for rec in RECOMPUTES:
        ok = [m for m in MODULES if check((m,), rec) is None]
        yield from ((rec, (m,)) for m in ok)
        yield rec, tuple(ok)


def measure(base, batch, rec, offload, device) -> tuple[int, int]:
    """(bytes held on the device for backward, bytes of host copies) of one forward."""
    model = copy.deepcopy(base)
    apply_recompute(model, *rec)
    apply_offload(model, offload, device.type, rec)
    with SavedBytes(model) as meter:
        out = model(**batch)
    out.loss.backward()
    return meter.bytes, meter.offloaded_bytes


def peak(base, batch, rec, offload, device) -> int:
    model = copy.deepcopy(base)
    apply_recompute(model, *rec)
    apply_offload(model, offload, device.type, rec)
    model(**batch).loss.backward()  # warm-up: allocator, pinned host pool
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    model(**batch).loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def main() -> None:
    a = parse_args(__doc__, repeat=3)
    _, device, base, batch = model_and_batch(a)
    cuda = device.type == "cuda"
    head = "| recompute | offload | on device without MiB | on device with MiB | offloaded share | host MiB | step time with/without |"
    rule = "|---|---|---:|---:|---:|---:|---:|"
    if cuda:
        head, rule = head + " peak with/without |", rule + "---:|"
    print(head + "\n" + rule)
    without: dict = {}
    for rec, offload in rows():
        if rec not in without:
            dev, _ = measure(base, batch, rec, (), device)
            model = copy.deepcopy(base)
            apply_recompute(model, *rec)
            sec = step_seconds(model, batch, a.repeat, device)
            without[rec] = dev, sec, peak(base, batch, rec, (), device) if cuda else None
        dev0, sec0, peak0 = without[rec]
        dev, host = measure(base, batch, rec, offload, device)
        model = copy.deepcopy(base)
        apply_recompute(model, *rec)
        apply_offload(model, offload, device.type, rec)
        sec = step_seconds(model, batch, a.repeat, device)
        line = (
            f"| {describe(*rec)} | {','.join(offload)} | {dev0 / 2**20:.3f} | {dev / 2**20:.3f} | "
            f"{1 - dev / dev0:.1%} | {host / 2**20:.3f} | {sec / sec0:.2f} |"
        )
        if cuda:
            line += f" {peak(base, batch, rec, offload, device) / peak0:.2f} |"
        print(line)


if __name__ == "__main__":
    main()
