"""Data pipeline throughput on CPU, one core, against named baselines run in
the same process.

    python bench/data_pipeline.py [--section image] [--rounds 7] [--threads 1]

Sections (each a function `bench_<name>(args)`; main() runs the ones asked for):
- loader: the whole loader (shard read, decode, tokenize, pack, hand-over) on
  the embedded sample set with 1, 2 and all cores' worth of worker processes:
  samples/s, images/s, useful tokens/s and patches/s, budget fill.
- image: encoded bytes -> (pixel_values, grid).  Ours is
  moevlm.data.image.decode_image (jpeg_draft off: bit-identical to the
  reference; on: same grid, close pixels).  The baseline is transformers'
  Qwen2VLImageProcessorPil configured as Qwen3-VL ships it (patch 16, temporal
  2, merge 2, mean = std = 0.5), on the same bytes decoded as its load_image
  does (PIL.Image.open + ImageOps.exif_transpose).  Photos: the sample
  set's (moevlm.data.sample.packaged_photos: real photographs scikit-image,
  scikit-learn and, when installed, matplotlib ship), once as stored (mostly PNG) and once re-encoded as JPEG
  quality 90, the usual training format, where draft mode can act.

Design choices:
- Outputs are compared before anything is timed (draft off must equal the
  reference to the bit, draft on must give the same grids), so a speedup of a
  different function cannot be reported.
- A "pil-only" side does just the PIL work a bit-identical path cannot skip
  (full decode, EXIF transpose, bicubic resize), so each row shows how close
  ours is to that ceiling.
- Passes over the whole photo set are interleaved (ref, ours, ours+draft, ref,
  ...) after a warm-up and the median pass is reported, so drift in machine
  load hits every side alike.  torch and PIL run on one thread: the figures are
  per core; a loader multiplies them by its workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import statistics
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from moevlm.data.config import ImageConfig
from moevlm.data.image import decode_image, smart_resize, to_rgb_or_grey
from moevlm.data.sample import packaged_photos

# (name, min_pixels, max_pixels)
SETTINGS = (
    ("qwen3-vl", 256 * 256, 4096 * 4096),
    ("train-1024", 256 * 256, 1024 * 1024),
    ("train-512", 256 * 256, 512 * 512),
    ("train-256", 128 * 128, 256 * 256),
)


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0]} ({len(names)} logical CPUs)" if names else "unknown CPU"


def photo_sets(paths: list[Path]) -> dict[str, list[bytes]]:
    """{"stored": file bytes as shipped, "jpeg-q90": the same pixels re-encoded as JPEG}."""
    stored = [p.read_bytes() for p in paths]
    jpeg = []
    for data in stored:
        buf = io.BytesIO()
        to_rgb_or_grey(ImageOps.exif_transpose(Image.open(io.BytesIO(data)))).save(
            buf, "JPEG", quality=90
        )
        jpeg.append(buf.getvalue())
    return {"stored": stored, "jpeg-q90": jpeg}


def reference_processor(min_pixels: int, max_pixels: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )


def image_sides(min_pixels: int, max_pixels: int) -> dict:
    """name -> (bytes -> (pixels (N, D) array-like, grid list)) for the reference and ours."""
    ref = reference_processor(min_pixels, max_pixels)

    def reference(data: bytes):
        out = ref(
            images=[ImageOps.exif_transpose(Image.open(io.BytesIO(data)))], return_tensors="np"
        )
        return out["pixel_values"], out["image_grid_thw"][0].tolist()

    def ours(cfg: ImageConfig):
        def run(data: bytes):
            pixels, grid = decode_image(data, cfg)
            return pixels, list(grid)

        return run

    cfg = ImageConfig(min_pixels=min_pixels, max_pixels=max_pixels)

    def pil_only(
        data: bytes,
    ):  # what a bit-identical path cannot skip: full decode, EXIF, bicubic resize
        image = to_rgb_or_grey(ImageOps.exif_transpose(Image.open(io.BytesIO(data))))
        height, width = smart_resize(
            image.height, image.width, cfg.patch_size * cfg.merge_size, min_pixels, max_pixels
        )
        return image.resize((width, height), Image.Resampling.BICUBIC)

    return {
        "reference": reference,
        "ours": ours(dataclasses.replace(cfg, jpeg_draft=False)),
        "ours+draft": ours(dataclasses.replace(cfg, jpeg_draft=True)),
        "pil-only": pil_only,
    }


def check_image_outputs(sides: dict, blobs: list[bytes]) -> tuple[int, list[float]]:
    """(patches per pass, mean |ours+draft - reference| of each image); exits if ours differs."""
    patches, diffs = 0, []
    for data in blobs:
        want, grid = sides["reference"](data)
        exact, grid_exact = sides["ours"](data)
        draft, grid_draft = sides["ours+draft"](data)
        if grid_exact != grid or grid_draft != grid or not np.array_equal(exact.numpy(), want):
            raise SystemExit(
                f"ours differs from the reference (grid {grid} / {grid_exact} / {grid_draft}); "
                "not timing different functions"
            )
        patches += want.shape[0]
        diffs.append(float(np.abs(draft.numpy() - want).mean()))
    return patches, diffs


def time_interleaved(
    fns: dict, blobs: list[bytes], rounds: int, warmup: int = 1
) -> dict[str, float]:
    """Median seconds of one pass over `blobs`, per callable, passes round-robin."""
    for _ in range(warmup):
        for fn in fns.values():
            for data in blobs:
                fn(data)
    secs = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for data in blobs:
                fn(data)
            secs[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in secs.items()}


def bench_image(args) -> None:
    photos = packaged_photos()
    sets = photo_sets([p.path for p in photos])
    print(
        "\n== image: bytes -> (pixel_values, grid), photos (the sample set's): "
        + ", ".join(f"{src} {n}" for src, n in Counter(p.source for p in photos).items())
    )
    print(
        f"{'setting':<10} {'photos':<8} {'side':<10} {'img/s':>7} {'patches/s':>9} {'x ref':>6}  "
        f"{'drafted':>7} {'|d| mean':>8} {'|d| worst':>9}"
    )
    for name, min_pixels, max_pixels in SETTINGS:
        sides = image_sides(min_pixels, max_pixels)
        for set_name, blobs in sets.items():
            patches, diffs = check_image_outputs(sides, blobs)
            secs = time_interleaved(sides, blobs, args.rounds)
            for side, s in secs.items():
                draft = (
                    f"{sum(d > 0 for d in diffs):3d}/{len(diffs):<3d} {np.mean(diffs):8.4f} {max(diffs):9.4f}"
                    if side == "ours+draft"
                    else ""
                )
                print(
                    f"{name:<10} {set_name:<8} {side:<10} {len(blobs) / s:7.1f} {patches / s:9.0f} "
                    f"{secs['reference'] / s:5.2f}x  {draft}"
                )
    print(
        "settings: qwen3-vl = min 256*256, max 4096*4096 pixels (the hub config); train-N = max N*N.\n"
        "pil-only: PIL decode + EXIF + bicubic resize alone, no patches: the ceiling of a bit-identical path.\n"
        "drafted: images whose pixels draft mode changed; |d|: per-image mean |ours+draft - reference| in\n"
        "normalized units (one 8-bit level = 2/255 = 0.0078), mean over images and worst image."
    )


# ---------------------------------------------------------------- loader
def loader_config(shards: str, workers: int) -> "DataConfig":
    """Training-like settings: Qwen3-VL's min pixels, 1024*1024 max, 8k-token rows."""
    from moevlm.data.config import DataConfig, PackConfig

    return DataConfig(
        shards=shards,
        image=ImageConfig(),
        num_workers=workers,
        shuffle_buffer=64,
        pack=PackConfig(
            seq_len=8192, max_patches=8192, max_samples=64, max_images=32, oversize="truncate"
        ),
    )


def run_loader(shards: str, workers: int, seconds: float) -> dict:
    """Batches/s of the whole loader (read, decode, tokenize, pack, hand over) after
    its first batch (worker start-up excluded), for at least `seconds`."""
    from moevlm.data.loader import build_loader
    from moevlm.model import VLMConfig

    loader = build_loader(loader_config(shards, workers), VLMConfig.preset("tiny"))
    it = iter(loader)
    next(it)
    n = {
        "batches": 0,
        "samples": 0,
        "images": 0,
        "tokens": 0,
        "patches": 0,
        "budget_tokens": 0,
        "budget_patches": 0,
    }
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or n["batches"] < 4:
        b = next(it)
        n["batches"] += 1
        n["samples"] += b["num_samples"]
        n["images"] += b["num_images"]
        n["tokens"] += b["useful_tokens"]
        n["patches"] += b["useful_patches"]
        n["budget_tokens"] += b["useful_tokens"] + b["padded_tokens"]
        n["budget_patches"] += b["useful_patches"] + b["padded_patches"]
    dt = time.perf_counter() - t0
    loader.close()
    return {k: v / dt for k, v in n.items()} | {
        "token_fill": n["tokens"] / n["budget_tokens"],
        "patch_fill": n["patches"] / max(1, n["budget_patches"]),
    }


def bench_loader(args) -> None:
    """End-to-end loader throughput on the embedded sample set with 1, 2 and all
    cores' worth of workers.  Per core = the rate / workers (the main process only
    hands batches over)."""
    import os
    import tempfile

    from moevlm.data.build_shards import build_sample

    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        s = build_sample(Path(tmp), progress=False)
        print(
            f"\nloader: embedded sample set ({s['samples']} samples: {s['kinds']}, {s['images']} photos), "
            f"seq_len 8192, 8192 patches, min 256^2 / max 1024^2 pixels, CPU {cpu_name()}, {cores} cores"
        )
        print(
            f"{'workers':>7} {'samples/s':>10} {'images/s':>9} {'tokens/s':>9} {'patches/s':>10} "
            f"{'batches/s':>9} {'tok fill':>8} {'patch fill':>10} {'samples/s/core':>14}"
        )
        for w in sorted({1, 2, cores}):
            r = run_loader(tmp, w, args.seconds)
            print(
                f"{w:>7} {r['samples']:>10.1f} {r['images']:>9.1f} {r['tokens']:>9.0f} {r['patches']:>10.0f} "
                f"{r['batches']:>9.2f} {r['token_fill']:>8.1%} {r['patch_fill']:>10.1%} {r['samples'] / w:>14.1f}"
            )


SECTIONS = {"image": bench_image, "loader": bench_loader}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--section", choices=[*SECTIONS, "all"], default="all")
    ap.add_argument("--rounds", type=int, default=7, help="timed passes per side (median reported)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (PIL decodes on one regardless)"
    )
    ap.add_argument(
        "--seconds", type=float, default=20.0, help="loader: timed seconds per worker count"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    print(
        f"device: {cpu_name()}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"Pillow {Image.__version__}, numpy {np.__version__}, transformers {transformers.__version__}"
    )
    for name, fn in SECTIONS.items():
        if args.section in (name, "all"):
            fn(args)


if __name__ == "__main__":
    main()
