"""A sample's videos for the encoder: probe each, plan its frames and size within the row's budgets
(sampling a long video down, never dropping it), then decode the planned frames and preprocess them.

Legend: N patches, D patch dim (3*T*P*P), T temporal patch, P patch side, M merge side.

    plans = [probe_plan(data, name, cfg) for name, data in ...]   # header only
    while over budget: plans = [p.shrunk(ratio, cfg) for p in plans]  # fewer frames / lower resolution
    pixels_ND, grid, span = plans[0].load(data, cfg, seed=None)       # the decode: the planned frames

Sampling down follows data.video.fit: `frames` (fewer frames first, down to T, then lower resolution,
down to one merge block a side), `resolution` (the other order) or `skip` (none: pack.oversize rules).
Each video sampled down names its choice (video_fewer_frames, video_lower_resolution: counted).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from moevlm.data.config import VideoConfig
from moevlm.data.errors import SkipSample
from moevlm.data.text import VideoSpan
from moevlm.data.video import frame_timestamps, sample_frame_indices, video_smart_resize


@dataclass(frozen=True)
class VideoPlan:
    """What one video will train as: the header's facts, the frames to decode and the resize bounds."""

    name: str
    frames: int  # the header's frame count
    fps: float
    height: int
    width: int
    indices: tuple[int, ...]  # frames to decode
    max_frame_pixels: int | None = None  # a lowered resolution: pixels a frame at most
    choices: tuple[str, ...] = ()  # video_fewer_frames / video_lower_resolution

    def cfg(self, video: VideoConfig) -> VideoConfig:
        """The preprocessing config of this plan: data.video, bounds lowered to max_frame_pixels."""
        if self.max_frame_pixels is None:
            return video
        n, factor = len(self.indices), video.patch_size * video.merge_size
        total = self.max_frame_pixels * n
        return dataclasses.replace(
            video,
            max_pixels=min(video.max_pixels, total),
            min_pixels=min(video.min_pixels, factor * factor),
            max_video_tokens=max(1, self.max_frame_pixels // factor**2),
        )

    def grid(self, video: VideoConfig) -> tuple[int, int, int]:
        """(t, h, w) in patches, as preprocess_video will give it."""
        n, P, T = len(self.indices), video.patch_size, video.temporal_patch_size
        h, w = video_smart_resize(n, self.height, self.width, self.cfg(video))
        return math.ceil(n / T), h // P, w // P

    def span(self, video: VideoConfig) -> VideoSpan:
        t, h, w = self.grid(video)
        seconds = frame_timestamps(self.indices, self.fps, video.temporal_patch_size)
        return VideoSpan(tuple(seconds), h * w // video.merge_size**2)

    def shrunk(self, ratio: float, video: VideoConfig) -> VideoPlan:
        """A plan of about `ratio` (< 1) of this one's patches, by data.video.fit's order; itself when
        it cannot shrink further (T frames of one merge block a side)."""
        for how in ("frames", "resolution") if video.fit == "frames" else ("resolution", "frames"):
            smaller = (
                self._fewer_frames(ratio, video) if how == "frames" else self._lower(ratio, video)
            )
            if smaller is not None:
                return smaller
        return self

    def _fewer_frames(self, ratio: float, video: VideoConfig) -> VideoPlan | None:
        T, n = video.temporal_patch_size, len(self.indices)
        keep = max(T, math.floor(n * ratio / T) * T)
        if keep >= n:
            return None
        narrow = dataclasses.replace(video, min_frames=min(video.min_frames, keep), max_frames=keep)
        idx = tuple(int(i) for i in sample_frame_indices(self.frames, self.fps, narrow))
        return self._with(indices=idx, choice="video_fewer_frames")

    def _lower(self, ratio: float, video: VideoConfig) -> VideoPlan | None:
        t, h, w = self.grid(video)
        factor = video.patch_size * video.merge_size
        if h * w <= video.merge_size**2:
            return None
        now = h * w * video.patch_size**2
        target = max(factor * factor, int(now * ratio))
        return self._with(max_frame_pixels=target, choice="video_lower_resolution")

    def _with(self, choice: str, **kw) -> VideoPlan:
        choices = self.choices + (() if choice in self.choices else (choice,))
        return dataclasses.replace(self, choices=choices, **kw)

    def load(self, data: bytes, video: VideoConfig, seed: int | None = None):
        """(pixel_values (N, D) float32, grid (t, h, w), span): the planned frames decoded (or, with a
        seed, data.mock=random_pixels: seeded random frames of the header's size) and preprocessed."""
        from moevlm.data.video import preprocess_video

        if seed is None:
            from moevlm.data.video_decode import decode_frames

            frames, _ = decode_frames(data, list(self.indices), video.decode)
        else:
            rng = np.random.default_rng(seed)
            shape = (len(self.indices), self.height, self.width, 3)
            frames = rng.integers(0, 256, shape, dtype=np.uint8)
        pixels, grid = preprocess_video(frames, self.cfg(video))
        return pixels, tuple(grid), self.span(video)


def probe_plan(data, name: str, video: VideoConfig) -> VideoPlan:
    """The plan of a video member from its header alone: data.video's frame sampling, full size;
    SkipSample for a bad video (its reason) or one shorter than a temporal patch (video_too_short)."""
    from moevlm.data.video_decode import probe_video

    info = probe_video(bytes(data), video.decode)
    idx = sample_frame_indices(info.frames, info.fps, video)
    if len(idx) < video.temporal_patch_size:
        raise SkipSample(
            "video_too_short",
            f"{name}: {info.frames} frame(s); a video needs temporal_patch_size="
            f"{video.temporal_patch_size} (make a one-frame video an image)",
        )
    return VideoPlan(
        name, info.frames, info.fps, info.height, info.width, tuple(int(i) for i in idx)
    )


def video_patches(plans: list[VideoPlan], video: VideoConfig) -> int:
    return sum(math.prod(p.grid(video)) for p in plans)


def cat_pixels(parts: list[torch.Tensor]) -> torch.Tensor | None:
    return torch.cat(parts) if parts else None
