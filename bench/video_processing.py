"""Video samples per second per worker: our decode (seeking) + preprocess beside transformers' on the
same files, one core, in the same process.

    python bench/video_processing.py [--rounds 5] [--quick]

Ours: moevlm.data.video_decode.decode_frames (seeks to the key frame before each sampled frame) with
moevlm.data.video's sampler, then preprocess_video.  Theirs: transformers' read_video_pyav (decodes
from the start up to the last sampled frame; its loop over our probed frame count for mkv/webm, whose
headers hold none) with Qwen3VLVideoProcessor's sample_frames, then the processor's _preprocess on the
same decoded frames.  The processor needs torchvision, absent here: it is compiled from transformers'
source over a stand-in base (tests/data/test_video_processing.py's reference_class; only torchvision's
uint8 bicubic resize is replaced by the kernel it calls on CPU).  Clips are encoded here with PyAV from
a packaged photograph (a pan).  Frames and outputs are compared before anything is timed; passes are
interleaved and the median reported.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "data"))

from moevlm.data.config import VideoConfig  # noqa: E402
from moevlm.data.sample import sample_photo_paths  # noqa: E402
from moevlm.data.sample_video import ClipSpec, camera_move, encode_clip  # noqa: E402
from moevlm.data.video import preprocess_video, sample_frame_indices  # noqa: E402
from moevlm.data.video_decode import VideoDecodeConfig, decode_frames, probe_video  # noqa: E402

# (container, seconds, (width, height), fps)
CLIPS = [
    ("mp4", 10.0, (640, 360), 30),
    ("webm", 10.0, (640, 360), 30),
    ("mp4", 5.0, (1280, 720), 30),
    ("mkv", 30.0, (320, 240), 24),
]
QUICK = [("mp4", 4.0, (640, 360), 30), ("webm", 4.0, (320, 240), 24)]


def make_clip(container: str, seconds: float, size: tuple[int, int], fps: int) -> bytes:
    spec = ClipSpec("bench", 0, container, seconds, fps, size, "pan")
    return encode_clip(camera_move(sample_photo_paths()[0], spec), container, fps)


def ours(data: bytes, cfg: VideoConfig, dcfg: VideoDecodeConfig):
    """(frames, decode s, preprocess s, (pixel_values_videos, grid))."""
    t0 = time.perf_counter()
    frames, _ = decode_frames(data, lambda i: sample_frame_indices(i.frames, i.fps, cfg), dcfg)
    t1 = time.perf_counter()
    out = preprocess_video(frames, cfg)
    return frames, t1 - t0, time.perf_counter() - t1, out


def theirs(data: bytes, container: str, cfg: VideoConfig, proc, frames_for_pre):
    """(frames, decode s, preprocess s, (pixel_values_videos, grid)); the preprocess on
    `frames_for_pre` (the frames ours decoded: the same input)."""
    from test_video_processing import reference_process
    from transformers.video_utils import read_video_pyav

    def sample(metadata, **_):
        return proc.sample_frames(metadata, fps=cfg.fps)

    t0 = time.perf_counter()
    if container == "mp4":
        frames, _ = read_video_pyav(io.BytesIO(data), sample_indices_fn=sample)
    else:
        frames = _read_video_pyav_loop(data, sample)
    t1 = time.perf_counter()
    out = reference_process(frames_for_pre, cfg)
    return frames, t1 - t0, time.perf_counter() - t1, out


def _read_video_pyav_loop(data: bytes, sample) -> np.ndarray:
    """read_video_pyav's loop, the frame count from our probe (a matroska header has none)."""
    import types

    import av

    info = probe_video(data, VideoDecodeConfig())
    indices = sample(types.SimpleNamespace(total_num_frames=info.frames, fps=info.fps))
    frames = []
    with av.open(io.BytesIO(data)) as container:
        container.seek(0)
        for i, frame in enumerate(container.decode(video=0)):
            if i > indices[-1]:
                break
            if i in indices:
                frames.append(frame)
        return np.stack([x.to_ndarray(format="rgb24") for x in frames])


def check_same(name: str, a, b) -> float:
    """The frames equal; the outputs' grids equal, pixel values' max abs difference returned."""
    (fa, _, _, (pa, ga)), (fb, _, _, (pb, gb)) = a, b
    assert np.array_equal(fa, fb), f"{name}: decoded frames differ"
    assert list(ga) == gb.reshape(-1).tolist(), (name, ga, gb)
    return float((pa - pb).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="two short clips, 2 rounds (a smoke run)")
    args = ap.parse_args()
    rounds = 2 if args.quick else args.rounds
    torch.set_num_threads(1)
    from test_video_processing import reference_class

    cfg, dcfg = VideoConfig(), VideoDecodeConfig(threads=1)
    cls, _ = reference_class()
    proc = cls(min_frames=cfg.min_frames, max_frames=cfg.max_frames)
    clips = [(c, make_clip(*c)) for c in (QUICK if args.quick else CLIPS)]
    print(
        "transformers' Qwen3VLVideoProcessor compiled from its source over a torchvision-free stand-in "
        "(torchvision absent here); torch 1 thread, our decoder 1 thread, read_video_pyav FFmpeg's default"
    )
    times = {i: {"od": [], "op": [], "td": [], "tp": []} for i in range(len(clips))}
    for r in range(rounds + 1):  # round 0 warms up
        for i, (c, data) in enumerate(clips):
            a = ours(data, cfg, dcfg)
            b = theirs(data, c[0], cfg, proc, a[0])
            if r == 0:
                diff = check_same(f"{c}", a, b)
                assert diff <= 1e-5, (c, diff)
                continue
            for k, v in zip(("od", "op", "td", "tp"), (a[1], a[2], b[1], b[2])):
                times[i][k].append(v)
    head = (
        f"{'clip':<26}{'frames':>7} {'grid':>13} | {'ours dec':>9}{'pre':>8}{'vid/s':>7}{'dec %':>7} | "
        f"{'theirs dec':>10}{'pre':>8}{'vid/s':>7} | {'x e2e':>6}{'x dec':>6}{'x pre':>6}"
    )
    print(head)
    for i, (c, data) in enumerate(clips):
        m = {k: statistics.median(v) for k, v in times[i].items()}
        frames, _, _, (_, grid) = ours(data, cfg, dcfg)
        o, t = m["od"] + m["op"], m["td"] + m["tp"]
        name = f"{c[0]} {c[1]:g}s {c[2][0]}x{c[2][1]} {c[3]}fps"
        print(
            f"{name:<26}{len(frames):>7} {str(tuple(grid)):>13} | {1e3 * m['od']:>7.0f}ms"
            f"{1e3 * m['op']:>6.0f}ms{1 / o:>7.1f}{100 * m['od'] / o:>6.0f}% | {1e3 * m['td']:>8.0f}ms"
            f"{1e3 * m['tp']:>6.0f}ms{1 / t:>7.1f} | {t / o:>6.2f}{m['td'] / m['od']:>6.2f}"
            f"{m['tp'] / m['op']:>6.2f}"
        )
    print("x: theirs' time / ours (above 1: ours faster); vid/s: videos a second on one worker")


if __name__ == "__main__":
    main()
