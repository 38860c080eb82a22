"""Qwen3-VL video preprocessing on decoded frames: which frames to sample, their timestamps, and
frames -> smart resize -> rescale + normalize -> patches, equal value for value to transformers'
Qwen3VLVideoProcessor (its torch path; resize = torchvision's CPU uint8 bicubic, antialiased).

Legend: F frames, H, W frame height/width, C channels (3), T temporal patch (frames per patch), P patch
side, M merge side, Hb/Wb merge blocks down/across, N patches (t*h*w), Q pixels of a patch (P*P).

    idx_F = sample_frame_indices(total_frames, video_fps, VideoConfig())   # which frames to decode
    pixels_ND, (t, h, w) = preprocess_video(frames_FHWC_uint8, cfg)      # the decoded frames at idx_F
    seconds_t = frame_timestamps(idx_F, video_fps, cfg.temporal_patch_size)  # one per temporal patch
    # pixels_ND: (t*h*w, C*T*P*P) float32, frame-pair by frame-pair, rows in merge-block order;
    # each temporal patch is h*w / M**2 video tokens (ChatEncoder.encode_chat's video_grids)
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from moevlm.data.config import VideoConfig
from moevlm.data.image import MAX_ASPECT_RATIO, fit_area

# the frame rate transformers assumes when a video's is unknown
DEFAULT_VIDEO_FPS = 24.0


def sample_frame_indices(
    total_frames: int, video_fps: float | None, cfg: VideoConfig
) -> np.ndarray:
    """Indices of the frames to use: cfg.fps per second of video, at least cfg.min_frames and at most
    cfg.max_frames (and never more than the video has), spread evenly over the whole video."""
    if total_frames < 1:
        raise ValueError(f"a video needs at least one frame, got total_frames={total_frames}")
    fps = DEFAULT_VIDEO_FPS if video_fps is None else video_fps
    n = int(total_frames / fps * cfg.fps)
    n = min(max(n, cfg.min_frames), cfg.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, n).round().astype(int)


def frame_timestamps(indices, video_fps: float | None, temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each temporal patch: the mean time of its first and last frame (an odd last patch
    repeats the last frame), as Qwen3VLProcessor writes them into the prompt."""
    fps = DEFAULT_VIDEO_FPS if video_fps is None else video_fps
    idx = [int(i) for i in indices]
    idx += idx[-1:] * (-len(idx) % temporal_patch_size)
    seconds = [i / fps for i in idx]
    T = temporal_patch_size
    return [(seconds[i] + seconds[i + T - 1]) / 2 for i in range(0, len(seconds), T)]


def video_smart_resize(frames: int, height: int, width: int, cfg: VideoConfig) -> tuple[int, int]:
    """The (height, width) every frame is resized to: sides multiples of patch * merge; the pixels of
    all frames within [min_pixels, max_pixels] (with cap_pixels_per_frame, max_pixels is first cut to
    frames * min(max_video_tokens merged patches, max_pixels / frames), never below 1.05 min_pixels a
    frame); frames narrower than patch * merge are first scaled up to it."""
    T, factor = cfg.temporal_patch_size, cfg.patch_size * cfg.merge_size
    if frames < T:
        raise ValueError(
            f"a video needs at least temporal_patch_size={T} frames, got {frames}; treat a single "
            "frame as an image"
        )
    if min(height, width) <= 0:
        raise ValueError(f"frames have height={height}, width={width}; both must be positive")
    max_pixels = cfg.max_pixels
    if cfg.cap_pixels_per_frame:
        frame_cap = cfg.max_video_tokens * factor * factor
        per_frame = max(min(frame_cap, cfg.max_pixels // frames), int(cfg.min_pixels * 1.05))
        max_pixels = per_frame * frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"frames of height={height}, width={width} have an aspect ratio above the "
            f"{MAX_ASPECT_RATIO} Qwen3-VL accepts; crop or pad them first"
        )
    return fit_area(height, width, factor, cfg.min_pixels, max_pixels, frames, T)


def preprocess_video(
    frames_FHWC: np.ndarray, cfg: VideoConfig
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Decoded frames (F, H, W, 3) uint8 -> (pixel_values_videos (t*h*w, C*T*P*P) float32,
    grid (t, h, w)), t = ceil(F / T): the frames already sampled (sample_frame_indices)."""
    if not (
        isinstance(frames_FHWC, np.ndarray)
        and frames_FHWC.dtype == np.uint8
        and frames_FHWC.ndim == 4
        and frames_FHWC.shape[-1] == 3
    ):
        got = getattr(frames_FHWC, "dtype", type(frames_FHWC).__name__)
        raise TypeError(
            f"preprocess_video takes a uint8 numpy array (frames, height, width, 3), got {got} "
            f"{getattr(frames_FHWC, 'shape', '')}"
        )
    n, H, W, _ = frames_FHWC.shape
    h, w = video_smart_resize(n, H, W, cfg)
    x_FCHW = torch.from_numpy(frames_FHWC).permute(0, 3, 1, 2)
    if (h, w) != (H, W):
        x_FCHW = F.interpolate(
            x_FCHW.contiguous(), size=(h, w), mode="bicubic", antialias=True, align_corners=False
        )
    return video_to_patches(normalize_frames(x_FCHW, cfg.mean, cfg.std), cfg)


def normalize_frames(x_FCHW: torch.Tensor, mean, std) -> torch.Tensor:
    """uint8 -> float32 (x - 255 mean) / (255 std) per channel: the reference's fused rescale and
    normalize, whose rounding differs from the image path's (x / 255 - mean) / std in the last bit."""
    inv_rescale = 1.0 / (1 / 255)  # the reference's 1.0 / rescale_factor, float rounding and all
    mean_C11 = (torch.tensor(mean) * inv_rescale).view(-1, 1, 1)
    std_C11 = (torch.tensor(std) * inv_rescale).view(-1, 1, 1)
    return x_FCHW.to(torch.float32).sub_(mean_C11).div_(std_C11)


def video_to_patches(
    x_FCHW: torch.Tensor, cfg: VideoConfig
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(F, C, H, W) with sides multiples of P*M -> ((t*h*w, C*T*P*P), (t, h, w)): frames grouped T at a
    time (an odd count's last frame repeated), then merge-block order within each group."""
    P, M, T = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if pad := -x_FCHW.shape[0] % T:
        x_FCHW = torch.cat((x_FCHW, x_FCHW[-1:].expand(pad, -1, -1, -1)))
    n, C, H, W = x_FCHW.shape
    t, Hb, Wb = n // T, H // (P * M), W // (P * M)
    x = x_FCHW.reshape(t, T, C, Hb, M, P, Wb, M, P)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, Hb, Wb, M, M, C, T, P, P)
    return x.reshape(t * Hb * Wb * M * M, C * T * P * P), (t, H // P, W // P)
