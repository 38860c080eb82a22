"""The loader with video in the mix vs images only, same process: samples/s and the trainer's data wait.

    python bench/video_loader.py [--seconds 10] [--workers 1] [--step-ms 0,50]

Two WebDatasets written once into a temporary folder from the sample set's photographs and clips
(moevlm.data.sample_video): `images` (image chats only) and `mixed` (the same image chats, plus as
many video chats: one clip, a clip beside a photo, two clips; mp4/H.264 and webm/VP9).  Each is read
by the real loader (workers decode, preprocess, tokenize, pack) with the sample preset's budgets
(conf/data/sample.yaml); after the first row (worker start-up excluded) rows are taken for
--seconds, the consumer spending --step-ms per row as a training step would: step 0 gives the
loader's own rate, a step > 0 the data wait a trainer of that step time would see (the loader's
wait_s over the wall time).  The two sets alternate (images, mixed, images, mixed) so drift in
machine load hits both.  No assertion: a table to read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import webdataset as wds

from moevlm.data.config import DataConfig, ImageConfig, PackConfig, VideoConfig
from moevlm.data.encode import SampleEncoder
from moevlm.data.loader import build_loader
from moevlm.data.reader import Pos
from moevlm.data.sample import packaged_photos, sample_photo_paths, sample_tokenizer
from moevlm.data.sample_video import make_sample_clips
from moevlm.data.text import ChatEncoder, load_tokenizer
from moevlm.model import VLMConfig


def chat(key: str, members: dict[str, bytes], question: str) -> dict:
    images = [m for m in members if m.startswith("img")]
    videos = [m for m in members if m.startswith("vid")]
    tags = "".join("<image>\n" for _ in images) + "".join("<video>\n" for _ in videos)
    rec = {
        "id": key,
        "images": images,
        "videos": videos,
        "messages": [
            {"role": "user", "content": tags + question},
            {"role": "assistant", "content": f"An answer about {key}, a few words long."},
        ],
    }
    return {"__key__": key, "json": json.dumps(rec).encode(), **members}


def write_sets(root: Path, repeat: int) -> dict[str, Path]:
    photos = [p.path.read_bytes() for p in packaged_photos()]
    clips = make_sample_clips(sample_photo_paths(), root / "clips")
    clip = [(p.suffix[1:], p.read_bytes()) for p in clips]
    image_chats = [
        chat(f"img{r}-{i}", {f"img0{Path(p.path).suffix}": b}, "What is this?")
        for r in range(repeat)
        for i, (p, b) in enumerate(zip(packaged_photos(), photos))
    ]
    video_chats = []
    for r in range(repeat):
        for i, (ext, b) in enumerate(clip):
            other_ext, other = clip[(i + 1) % len(clip)]
            photo = packaged_photos()[i]
            video_chats += [
                chat(f"vid{r}-{i}", {f"vid0.{ext}": b}, "What does the camera do?"),
                chat(
                    f"vimg{r}-{i}",
                    {f"img0{photo.path.suffix}": photos[i], f"vid0.{ext}": b},
                    "Is it this photo?",
                ),
                chat(f"two{r}-{i}", {f"vid0.{ext}": b, f"vid1.{other_ext}": other}, "Differences?"),
            ]
    sets = {"images": image_chats, "mixed": interleave(image_chats, video_chats)}
    tok = sample_tokenizer().to_str()
    out = {}
    for name, samples in sets.items():
        folder = root / name
        folder.mkdir()
        for s in range(4):
            with wds.TarWriter(str(folder / f"shard-{s:06d}.tar"), encoder=False) as w:
                for sample in samples[s::4]:
                    w.write(sample)
        (folder / "tokenizer.json").write_text(tok)
        out[name] = folder
    return out


def interleave(a: list, b: list) -> list:
    slots = sorted(
        [((j + 0.5) / len(a), 0, j) for j in range(len(a))]
        + [((j + 0.5) / len(b), 1, j) for j in range(len(b))]
    )
    return [(a, b)[k][j] for _, k, j in slots]


def config(folder: Path, workers: int) -> DataConfig:
    """The sample preset's data settings (conf/data/sample.yaml) on `folder`."""
    return DataConfig(
        shards=str(folder),
        image=ImageConfig(min_pixels=4096, max_pixels=16384),
        video=VideoConfig(max_frames=8, min_pixels=4096, max_pixels=32768),
        pack=PackConfig(
            seq_len=1024,
            max_patches=256,
            max_samples=16,
            max_images=8,
            max_videos=4,
            max_video_patches=256,
            oversize="truncate",
        ),
        num_workers=workers,
        shuffle_buffer=32,
        streams=4,
    )


def measure(folder: Path, workers: int, seconds: float, step_s: float) -> dict:
    loader = build_loader(config(folder, workers), VLMConfig.preset("tiny"))
    it = iter(loader)
    next(it)  # worker start-up excluded
    wait0, t0 = loader.wait_s, time.perf_counter()
    rows = samples = videos = images = video_patches = 0
    while time.perf_counter() - t0 < seconds:
        row = next(it)
        rows, samples = rows + 1, samples + row.num_samples
        images, videos = images + row.num_images, videos + row.num_videos
        video_patches += row.video_patches
        if step_s:
            time.sleep(step_s)
    wall = time.perf_counter() - t0
    wait = loader.wait_s - wait0
    loader.close() if hasattr(loader, "close") else None
    return {
        "samples/s": samples / wall,
        "rows/s": rows / wall,
        "images/s": images / wall,
        "videos/s": videos / wall,
        "video patches/s": video_patches / wall,
        "data wait": wait / wall,
    }


def encode_cpu(folder: Path, rounds: int = 3) -> dict:
    """CPU seconds per sample of the worker's encode step alone (read once, then probe, decode,
    preprocess, tokenize: SampleEncoder) in this process on one thread: a per-core rate that machine
    load moves less than wall time does."""
    cfg = config(folder, 0)
    enc = SampleEncoder(
        ChatEncoder(load_tokenizer(str(folder / "tokenizer.json"))),
        cfg.image,
        cfg.pack,
        video=cfg.video,
    )
    raws = [
        r
        for shard in sorted(folder.glob("*.tar"))
        for r in wds.WebDataset(str(shard), shardshuffle=False)
    ]
    best = float("inf")
    for _ in range(rounds):
        t = time.process_time()
        for i, raw in enumerate(raws):
            enc(raw, Pos(0, 0, i))
        best = min(best, time.process_time() - t)
    return {"samples": len(raws), "cpu ms/sample": 1000 * best / len(raws)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--step-ms", default="0,50", help="consumer time per row, comma list")
    ap.add_argument("--repeat", type=int, default=4, help="copies of each record")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sets = write_sets(Path(tmp), args.repeat)
        torch.set_num_threads(1)
        cpu = {name: encode_cpu(sets[name]) for name in ("images", "mixed")}
        print("| set | samples | encode CPU ms/sample (one thread) | samples/s per core |")
        print("|---|---|---|---|")
        for name, c in cpu.items():
            ms = c["cpu ms/sample"]
            print(f"| {name} | {c['samples']} | {ms:.1f} | {1000 / ms:.0f} |")
        print()
        print(
            f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.workers} worker(s)"
        )
        print(
            "| set | step ms | samples/s | rows/s | images/s | videos/s | video patches/s | data wait |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for step_ms in [float(x) for x in args.step_ms.split(",")]:
            res = {}
            for name in ("images", "mixed", "images", "mixed"):
                r = measure(sets[name], args.workers, args.seconds / 2, step_ms / 1000)
                for k, v in r.items():
                    res.setdefault(name, {}).setdefault(k, []).append(v)
            for name, r in res.items():
                m = {k: sum(v) / len(v) for k, v in r.items()}
                print(
                    f"| {name} | {step_ms:g} | {m['samples/s']:.1f} | {m['rows/s']:.1f} | {m['images/s']:.1f} | "
                    f"{m['videos/s']:.1f} | {m['video patches/s']:.0f} | {100 * m['data wait']:.0f}% |"
                )


if __name__ == "__main__":
    main()
