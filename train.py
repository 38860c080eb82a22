"""Embedded default run until the trainer exists (the trainer issue replaces
this file): the tiny Qwen3-VL-MoE trained with AdamW on the embedded sample
set (real photographs and prose that installed packages ship), read through
the real loader (shards, 2 worker processes, packing to fixed budgets).
Exits non-zero if the loss did not fall.

    python train.py [--steps 20] [--data DIR]   # DIR: shards + tokenizer.json; default: built fresh
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from moevlm.data.build_shards import build_sample
from moevlm.data.config import DataConfig, ImageConfig, PackConfig
from moevlm.data.loader import build_loader
from moevlm.model import Qwen3VLMoe, VLMConfig


def data_config(shards: str) -> DataConfig:
    return DataConfig(shards=shards, image=ImageConfig(min_pixels=64 * 64, max_pixels=128 * 128),
                      pack=PackConfig(seq_len=1024, max_patches=256, max_samples=16, max_images=8,
                                      oversize="truncate"),
                      num_workers=2, shuffle_buffer=32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--data", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        shards = args.data or tmp
        if not args.data:
            s = build_sample(tmp, progress=False)
            print(f"sample set: {s['samples']} samples {s['kinds']}, {s['images']} images, "
                  f"{s['bytes'] / 1e6:.1f} MB in {len(s['shards'])} shards")
        cfg = VLMConfig.preset("tiny")
        loader = build_loader(data_config(shards), cfg)
        model = Qwen3VLMoe(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        losses = [train_step(model, opt, batch, step) for step, batch in zip(range(1, args.steps + 1), loader)]
        print(f"data: {loader.stats()}")
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    if not last < first:
        print(f"FAIL: loss did not fall (first 3 steps {first:.4f}, last 3 {last:.4f})", file=sys.stderr)
        return 1
    print(f"ok: mean loss of the first 3 steps {first:.4f} -> last 3 {last:.4f}")
    return 0


def train_step(model, opt, batch, step: int) -> float:
    t0 = time.perf_counter()
    out = model(batch["input_ids"], batch["pixel_values"], batch["image_grid_thw"], batch["position_ids"],
                batch["cu_seqlens"], batch["labels"])
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step:3d}  loss {out.loss.item():.4f}  aux {out.aux_loss.item():.4f}  "
          f"docs {batch['num_samples']:2d}  images {batch['num_images']}  "
          f"tokens {batch['useful_tokens']}/{batch['useful_tokens'] + batch['padded_tokens']}  "
          f"{time.perf_counter() - t0:.3f}s")
    return out.loss.item()


if __name__ == "__main__":
    sys.exit(main())
