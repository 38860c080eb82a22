"""Loader settings and hand-written shards shared by the data tests."""

import io
import json

import webdataset as wds
from PIL import Image

from moevlm.data.config import DataConfig, ImageConfig, PackConfig, VideoConfig


def small_data_config(shards, **kw) -> DataConfig:
    """Small images, videos and budgets: the loader tests decode every photo and clip of the set."""
    pack = PackConfig(
        seq_len=512,
        max_patches=64,
        max_samples=16,
        max_images=8,
        lookahead=4,
        oversize="truncate",
        max_videos=2,
        max_video_patches=64,
    )
    cfg = DataConfig(
        shards=str(shards),
        image=ImageConfig(min_pixels=32 * 32, max_pixels=64 * 64),
        video=VideoConfig(min_pixels=32 * 32, max_pixels=4 * 64 * 64, max_frames=8),
        pack=pack,
        num_workers=2,
        shuffle_buffer=8,
        seed=1,
    )
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def good(key, photo_bytes, ext="png"):
    rec = {
        "id": key,
        "images": [f"img0.{ext}"],
        "messages": [
            {"role": "user", "content": "<image>\nWhat is in the photo?"},
            {"role": "assistant", "content": f"A photo, sample {key}."},
        ],
    }
    return {"__key__": key, "json": json.dumps(rec).encode(), f"img0.{ext}": photo_bytes}


def text(key, body):
    return {"__key__": key, "json": json.dumps({"id": key, "text": body}).encode()}


def write_tar(path, samples):
    with wds.TarWriter(str(path), encoder=False, mtime=0) as w:
        for s in samples:
            w.write(s)
