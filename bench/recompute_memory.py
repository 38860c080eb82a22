"""Saved activations and step time per recompute setting, against `none` in the same process.

    python bench/recompute_memory.py                       # tiny model, CPU, fp32
    python bench/recompute_memory.py --preset qwen3_vl_30b_a3b --layers 2 --seq 4096 --device cuda --dtype bf16

One micro-batch (text with two images) through one process; for each setting a
fresh copy of the same weights: forward under `SavedBytes` (distinct storages
kept for backward: autograd's saved tensors outside the regions, each region's
inputs, the collective outputs the selective cache keeps; parameters left out),
then backward.  Time is the median of `--repeat` forward+backward steps.
Prints a markdown table: bytes, ratio to none, step time ratio to none.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.parallel.recompute import MODULES, SavedBytes, apply_recompute, describe

SETTINGS = [
    ("none", ()),
    *(("selective", (m,)) for m in MODULES),
    ("selective", ("core_attn", "moe_act")),
    ("selective", MODULES),
    ("full", ()),
]


def make_batch(cfg: VLMConfig, seq: int, image_side: int, device) -> dict:
    """`seq` tokens with two images of image_side x image_side patches (merged 2x2)."""
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([[1, image_side, image_side]] * 2)
    per_image = image_side * image_side // 4
    pixels = torch.randn(int(grid.prod(-1).sum()), cfg.vision.patch_dim, generator=g)
    n_text = seq - 2 * (per_image + 2)
    text = torch.randint(0, min(cfg.text.vocab_size, 1000), (1, n_text), generator=g)
    image = torch.tensor(
        [[cfg.vision_start_token_id] + [cfg.image_token_id] * per_image + [cfg.vision_end_token_id]]
    )
    half = n_text // 2
    ids = torch.cat([text[:, :half], image, text[:, half:], image], 1)
    return {
        k: v.to(device)
        for k, v in dict(
            input_ids=ids, pixel_values=pixels, image_grid_thw=grid, labels=ids
        ).items()
    }


def step_seconds(model, batch, repeat: int, device) -> float:
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        model(**batch).loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def parse_args(doc: str, repeat: int) -> argparse.Namespace:
    """The model, batch and device options shared with bench/offload_memory.py."""
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers (proxy)")
    ap.add_argument("--vision-depth", type=int, default=None)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--image-side", type=int, default=8, help="patches per image side (even)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--repeat", type=int, default=repeat)
    return ap.parse_args()


def model_and_batch(a: argparse.Namespace):
    """(config, device, weights, batch) of the options `a`; prints what they are."""
    cfg = VLMConfig.preset(a.preset)
    if a.layers:
        cfg.text.num_layers = a.layers
    if a.vision_depth:
        cfg.vision.depth = a.vision_depth
        cfg.vision.deepstack_visual_indexes = tuple(
            i for i in cfg.vision.deepstack_visual_indexes if i < a.vision_depth
        )
    cfg.moe.mlp_only_layers = (0,)  # one dense layer, so `mlp` has a decoder MLP
    device = torch.device(a.device)
    torch.manual_seed(0)
    base = Qwen3VLMoe(cfg).to(
        device=device, dtype=torch.bfloat16 if a.dtype == "bf16" else torch.float32
    )
    batch = make_batch(cfg, a.seq, a.image_side, device)
    print(
        f"{a.preset} ({cfg.text.num_layers} layers, vision depth {cfg.vision.depth}), {a.seq} tokens, "
        f"2 images of {a.image_side}x{a.image_side} patches, {device.type}, {a.dtype}"
    )
    return cfg, device, base, batch


def main() -> None:
    a = parse_args(__doc__, repeat=5)
    _, device, base, batch = model_and_batch(a)
    print("| recompute | saved MiB | vs none | step time vs none |\n|---|---:|---:|---:|")
    ref = None
    for mode, modules in SETTINGS:
        model = copy.deepcopy(base)
        apply_recompute(model, mode, modules)
        with SavedBytes(model) as meter:
            out = model(**batch)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        saved = meter.bytes
        del out, meter
        sec = step_seconds(model, batch, a.repeat, device)
        ref = ref or (saved, sec)
        print(
            f"| {describe(mode, modules)} | {saved / 2**20:.2f} | {saved / ref[0]:.2f} | {sec / ref[1]:.2f} |"
        )


if __name__ == "__main__":
    main()
