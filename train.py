"""Smoke run until the trainer exists (the trainer issue replaces this file):
forward/backward of the tiny Qwen3-VL-MoE on two real photos, AdamW on one
fixed batch; exits non-zero if the loss did not fall.

Legend: B batch (one row per photo), S sequence, N patches, D patch dim.

    python train.py [--steps 10]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from PIL import Image

from moevlm.data.image import preprocess_image, sample_photo_paths
from moevlm.model import Qwen3VLMoe, VLMConfig

TEXT_LEN = 24  # random text tokens before each image (and at least as many after)


def photo_batch(cfg: VLMConfig, g: torch.Generator):
    """Two photos, each row laid out as the chat template: text, <vision_start>,
    image tokens, <vision_end>, text (padded with text to a common length)."""
    pixels, grids = zip(*(preprocess_image(Image.open(p), min_pixels=64 * 64, max_pixels=128 * 128)
                          for p in sample_photo_paths()[:2]))
    n_img = [t * h * w // cfg.vision.spatial_merge_size**2 for t, h, w in grids]
    S = 2 * TEXT_LEN + 2 + max(n_img)
    rows = []
    for n in n_img:
        tail = S - TEXT_LEN - 2 - n
        rows.append(torch.cat([torch.randint(0, 1000, (TEXT_LEN,), generator=g),
                               torch.tensor([cfg.vision_start_token_id]), torch.full((n,), cfg.image_token_id),
                               torch.tensor([cfg.vision_end_token_id]), torch.randint(0, 1000, (tail,), generator=g)]))
    input_ids_BS = torch.stack(rows)
    labels_BS = input_ids_BS.masked_fill(input_ids_BS == cfg.image_token_id, -100)
    return input_ids_BS, torch.cat(pixels), torch.tensor(grids), labels_BS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = VLMConfig.preset("tiny")
    model = Qwen3VLMoe(cfg)
    input_ids_BS, pixels_ND, grid_I3, labels_BS = photo_batch(cfg, torch.Generator().manual_seed(0))
    print(f"batch: input_ids {tuple(input_ids_BS.shape)}, pixel_values {tuple(pixels_ND.shape)}, "
          f"grids {grid_I3.tolist()}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        out = model(input_ids_BS, pixels_ND, grid_I3, labels=labels_BS)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        print(f"step {step:3d}  loss {losses[-1]:.4f}  aux {out.aux_loss.item():.4f}  "
              f"{time.perf_counter() - t0:.3f}s")
    if not losses[-1] < losses[0]:
        print(f"FAIL: loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})", file=sys.stderr)
        return 1
    print(f"ok: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
