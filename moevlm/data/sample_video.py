"""Short real-encoder video clips for the sample set and the tests: a slow pan or zoom over the packaged
photographs, encoded with PyAV (libx264 in mp4, libvpx-vp9 in webm), deterministic, well under 1 s.

    paths = make_sample_clips(sample_photo_paths(), out_dir)   # [pan-astronaut.mp4, ...]
    data = encode_clip(frames_THWC, "mp4", fps=12)              # any uint8 RGB frames -> bytes

Legend: T frames, H, W frame height/width, C channels (3).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

# container -> (muxer, encoder, encoder options): fast settings, one thread (the same bytes every run)
ENCODERS = {
    "mp4": ("mp4", "libx264", {"preset": "ultrafast", "threads": "1"}),
    "mkv": ("matroska", "libx264", {"preset": "ultrafast", "threads": "1"}),
    "webm": ("webm", "libvpx-vp9", {"deadline": "realtime", "cpu-used": "8", "threads": "1"}),
}


@dataclass(frozen=True)
class ClipSpec:
    name: str  # file stem
    photo: int  # index into the photos given
    container: str  # a key of ENCODERS
    seconds: float
    fps: int
    size: tuple[int, int]  # (width, height), each even and at most 160
    motion: str  # "pan" (left to right) or "zoom" (in)


SAMPLE_CLIPS = (
    ClipSpec("pan-astronaut", 0, "mp4", 2.0, 12, (160, 120), "pan"),
    ClipSpec("zoom-chelsea", 1, "mp4", 1.5, 12, (128, 128), "zoom"),
    ClipSpec("pan-coffee", 2, "webm", 2.0, 10, (160, 96), "pan"),
    ClipSpec("zoom-rocket", 3, "mp4", 3.0, 8, (96, 160), "zoom"),
)


def make_sample_clips(photos, out_dir: Path, specs=SAMPLE_CLIPS) -> list[Path]:
    """Writes one clip per spec into `out_dir` (made if missing) and returns their paths.  `photos`:
    paths (or objects with a .path, as moevlm.data.sample.Photo), indexed by each spec's `photo`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for spec in specs:
        photo = photos[spec.photo % len(photos)]
        frames_THWC = camera_move(Path(getattr(photo, "path", photo)), spec)
        path = out_dir / f"{spec.name}.{spec.container}"
        path.write_bytes(encode_clip(frames_THWC, spec.container, spec.fps))
        paths.append(path)
    return paths


def camera_move(photo: Path, spec: ClipSpec) -> np.ndarray:
    """(T, H, W, 3) uint8: a window moving across (pan) or into (zoom) the photograph."""
    width, height = spec.size
    with Image.open(photo) as im:
        image = im.convert("RGB")
    image.thumbnail((4 * width, 4 * height))  # the work stays small whatever the photo's size
    n = max(2, round(spec.seconds * spec.fps))
    W, H = image.size
    scale = min(W / width, H / height)  # the largest window of the clip's aspect that fits
    frames = []
    for i in range(n):
        s = i / (n - 1)
        if spec.motion == "pan":
            w, h = 0.7 * scale * width, 0.7 * scale * height
            x0, y0 = s * (W - w), (H - h) / 2
        else:
            w, h = (1.0 - 0.4 * s) * scale * width, (1.0 - 0.4 * s) * scale * height
            x0, y0 = (W - w) / 2, (H - h) / 2
        box = (x0, y0, x0 + w, y0 + h)
        frames.append(np.asarray(image.resize((width, height), Image.Resampling.BILINEAR, box)))
    return np.stack(frames)


def encode_clip(
    frames_THWC: np.ndarray, container: str = "mp4", fps: int = 12, gop: int | None = None
) -> bytes:
    """uint8 RGB frames -> the bytes of an mp4 (H.264), mkv (H.264) or webm (VP9) file, one key frame
    every `gop` frames (default: one a second); muxed bit-exact, so the same frames give the same bytes."""
    import av  # (PyAV's import stays out of the sample set's records)

    muxer, codec, options = ENCODERS[container]
    T, H, W, _ = frames_THWC.shape
    buf = io.BytesIO()
    with av.open(buf, "w", format=muxer, options={"fflags": "+bitexact"}) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        stream.options = {**options, "g": str(gop or fps)}
        for t in range(T):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames_THWC[t]), format="rgb24")
            frame.pts = t
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()
