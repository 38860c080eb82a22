"""Vision work balance over data-parallel ranks, before and after the vision-FLOPs packing budget.

    python bench/vision_balance.py                     # the embedded sample set, 4 dp ranks
    python bench/vision_balance.py --max-pixels 1048576 --seq-len 8192 --max-patches 4096 --steps 12
    python bench/vision_balance.py --images-only --min-pixels 65536 --max-pixels 1048576 \
        --seq-len 4096 --max-patches 8192 --lookahead 16 --steps 32 --budgets auto frac:0.4

Each of `--dp` ranks reads its own rows in this process (moevlm.data.vision_balance.measure: one loader
per rank, no worker processes, the rows the loader gives that rank), `--rows` rows per rank per step
(grad_accum x micro_batch_size) in micro-batches of `--micro-batch-size` rows.  A rank's figure per
micro-batch is the training vision FLOPs of its rows (the model's formula: attention's quadratic term
per image); the table prints, with data.pack.max_vision_flops off and at each budget asked for:
  max/mean     sum over micro-batches of the slowest rank's figure / sum of the mean rank's (what the
               trainer logs as vision_flops_max_over_mean); 1.00 = perfect balance
  worst        the largest single-micro-batch max/mean
  token fill   useful tokens / (rows x seq_len);  patch fill: useful patches / (rows x max_patches)
  over         rows holding one sample over the budget (it went alone)
FLOPs are those of the Qwen3-VL-30B-A3B vision tower (`--model`): counts from the grids, so the figures are
the same on any machine.  Images are the sample set's real photos, resized between --min-pixels and
--max-pixels (smart resize): bounds that keep their resolutions different.  --images-only reads only the
sample set's records with photos (image-text data: every row's vision work comes from its photos'
resolutions), built into a temporary folder.  A budget `frac:F` is the number F of the way from the
lightest full row's vision work (max_patches patches of images too small for attention's square to
count) to the heaviest (max_patches patches in images of --max-pixels); `auto` is frac:0.5.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from moevlm.data.build_shards import build_sample
from moevlm.data.config import DataConfig, ImageConfig, PackConfig
from moevlm.data.packing import VisionFlops
from moevlm.data.vision_balance import measure
from moevlm.model.config import VLMConfig


def model_for(name: str) -> VLMConfig:
    """The tiny preset's text side (the sample set's tokenizer ids) with `name`'s vision tower: the
    FLOPs depend on the vision config only."""
    model = VLMConfig.preset("tiny")
    model.vision = VLMConfig.preset(name).vision
    return model


def resolve_budget(budget: str, args, model) -> str:
    """`frac:F` as FLOPs (VisionFlops.auto's endpoints); any other value as data.pack.max_vision_flops."""
    if not budget.startswith("frac:"):
        return budget
    vision = VisionFlops.for_images(
        model, ImageConfig(min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    )
    # per patch, what attention's square adds in a full row of the largest images (auto: half of it)
    attention = vision.attention_per_patch(vision.max_image_patches)
    return str(args.max_patches * (vision.per_patch() + float(budget[5:]) * attention))


def data_config(args, budget: str) -> DataConfig:
    return DataConfig(
        shards=args.shards,
        image=ImageConfig(min_pixels=args.min_pixels, max_pixels=args.max_pixels),
        pack=PackConfig(
            seq_len=args.seq_len,
            max_patches=args.max_patches,
            max_samples=args.max_samples,
            max_images=args.max_images,
            lookahead=args.lookahead,
            max_vision_flops=budget,
        ),
        num_workers=0,
        mock=args.mock,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shards", default="sample")
    ap.add_argument(
        "--images-only",
        action="store_true",
        help="the sample set's records with photos only (built in a temporary folder; not with --shards)",
    )
    ap.add_argument("--model", default="qwen3_vl_30b_a3b")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=4, help="rows per rank per step")
    ap.add_argument("--micro-batch-size", type=int, default=1, help="rows per micro-batch")
    ap.add_argument("--min-pixels", type=int, default=64 * 64)
    ap.add_argument("--max-pixels", type=int, default=512 * 512)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--max-patches", type=int, default=4096)
    ap.add_argument("--max-samples", type=int, default=64)
    ap.add_argument("--max-images", type=int, default=32)
    ap.add_argument("--lookahead", type=int, default=32)
    ap.add_argument(
        "--budgets", nargs="+", default=["auto"], help="max_vision_flops values to compare"
    )
    ap.add_argument(
        "--mock", default="none", help="data.mock (random_pixels: the same grids, no decode)"
    )
    args = ap.parse_args(argv)
    if args.images_only:
        with tempfile.TemporaryDirectory() as tmp:
            build_sample(Path(tmp) / "shards", progress=False, images_only=True)
            args.shards = str(Path(tmp) / "shards")
            run(args)
    else:
        run(args)


def run(args) -> None:
    model = model_for(args.model)
    print(
        f"{args.dp} dp ranks x {args.steps} steps x {args.rows} rows (micro-batches of "
        f"{args.micro_batch_size}); seq_len {args.seq_len}, max_patches "
        f"{args.max_patches}, lookahead {args.lookahead}, images {args.min_pixels}..{args.max_pixels} px, "
        f"{args.model} vision FLOPs{', image-text records only' if args.images_only else ''}"
    )
    head = f"{'max_vision_flops':>18} | {'max/mean':>8} | {'worst':>10} | {'token fill':>10} | {'patch fill':>10} | {'over':>4} | {'s':>5}"
    print(head)
    print("-" * len(head))
    before = None
    for budget in ["off", *args.budgets]:
        t0 = time.perf_counter()
        m = measure(
            data_config(args, resolve_budget(budget, args, model)),
            model,
            dp=args.dp,
            steps=args.steps,
            rows_per_step=args.rows,
            micro_batch_size=args.micro_batch_size,
        )
        before = before or m
        print(
            f"{budget:>18} | {m['max_over_mean']:8.3f} | {m['worst_micro']:10.3f} | {m['token_fill']:10.3f} | "
            f"{m['patch_fill']:10.3f} | {m['over_budget_rows']:4d} | {time.perf_counter() - t0:5.0f}"
        )
        if m is not before:
            print(
                f"{'':>18}   ratio {m['max_over_mean'] / before['max_over_mean']:.3f}; fill change tokens "
                f"{100 * (m['token_fill'] - before['token_fill']):+.1f} pp, patches "
                f"{100 * (m['patch_fill'] - before['patch_fill']):+.1f} pp"
            )


if __name__ == "__main__":
    main()
