"""Qwen3-VL image preprocessing: smart resize, rescale + normalise, patchify.

Legend: H, W image height/width in pixels, C channels (3), T temporal patch
(frames per patch), P patch side, M merge side, Hb/Wb merge blocks down/across
(H / (P*M), W / (P*M)), N patches (Hb*M * Wb*M).

    pixels_ND, (t, h, w) = preprocess_image(PIL.Image.open(path))
    # pixels_ND: (h*w, C*T*P*P) float32; the text needs t*h*w / M**2 image tokens

Design choices:
- The output equals, value for value, what transformers' Qwen2VLImageProcessorPil
  emits when configured as Qwen3-VL ships it (tests/data/test_image.py).  The
  Qwen3-VL defaults are not in transformers' source (its class defaults are
  Qwen2-VL's: patch 14, CLIP mean/std, 56*56..28*28*1280 pixels); they come from
  the hub's preprocessor_config.json: patch 16, merge 2, temporal 2, mean = std
  = 0.5, size {shortest_edge: 256*256, longest_edge: 4096*4096}.
- Resizing is PIL bicubic on the uint8 image (as the reference), then
  x * (1/255) in float64 cast to float32, then (x - mean) / std in float32: the
  same arithmetic, so the result is bit-identical, not just close.
- Transparency is composited onto white before dropping alpha (as the reference).
- A still image is one temporal patch: its single frame is repeated T times,
  giving grid t = 1.
- Rows come out in merge-block order: for each M x M block (raster order over
  blocks), its M*M patches in raster order.  The vision merger then groups four
  consecutive rows; within a row the order is (C, T, P, P), the Conv3d kernel's.
- The image is kept channels-last (H, W, C) as PIL hands it over; the patchify
  transpose moves C into place, so no separate HWC -> CHW copy is made.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

# Qwen3-VL's preprocessor_config.json (Qwen/Qwen3-VL-* on the hub).
PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE_SIZE = 16, 2, 2
MIN_PIXELS, MAX_PIXELS = 256 * 256, 4096 * 4096
IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)
MAX_ASPECT_RATIO = 200

# Real photographs shipped inside the scikit-image wheel (skimage/data/).
_SKIMAGE_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
                   "hubble_deep_field.jpg", "camera.png")


def smart_resize(height: int, width: int, factor: int = PATCH_SIZE * MERGE_SIZE,
                 min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """The (height, width) an image is resized to: each side a multiple of
    `factor` (= patch * merge), area within [min_pixels, max_pixels] where the
    rounding allows, aspect ratio kept as closely as possible.

    Each side is first rounded to the nearest multiple (Python's round: halves
    go to even); if that area is too large both sides shrink by the same ratio
    and round down (never below `factor`), if too small they grow and round up."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image has height={height}, width={width}; both must be positive")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"image of height={height}, width={width} has aspect ratio {ratio:.1f}, above the "
                         f"{MAX_ASPECT_RATIO} Qwen3-VL accepts; crop or pad it first")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar == 0 or w_bar == 0:  # only possible when min_pixels < factor**2
        raise ValueError(f"height={height}, width={width} rounds to {h_bar}x{w_bar} pixels; "
                         f"raise min_pixels={min_pixels} to at least factor**2={factor * factor}")
    return h_bar, w_bar


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency (alpha band or palette/tRNS key) composited on white."""
    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def normalize(x_HWC: np.ndarray, mean, std) -> np.ndarray:
    """uint8 -> float32: x / 255, then (x - mean) / std per channel."""
    x_HWC = (x_HWC.astype(np.float64) * (1 / 255)).astype(np.float32)
    return (x_HWC - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


def patchify(x_HWC: np.ndarray, patch_size: int, temporal_patch_size: int, merge_size: int) -> np.ndarray:
    """(H, W, C) -> (N, C*T*P*P) in merge-block order, the frame repeated T times."""
    H, W, C = x_HWC.shape
    P, M, T = patch_size, merge_size, temporal_patch_size
    Hb, Wb = H // (P * M), W // (P * M)
    x_HbMPWbMPC = x_HWC.reshape(Hb, M, P, Wb, M, P, C)
    x_HbWbMMCPP = x_HbMPWbMPC.transpose(0, 3, 1, 4, 6, 2, 5)
    x_HbWbMMCTPP = np.broadcast_to(x_HbWbMMCPP[:, :, :, :, :, None], (Hb, Wb, M, M, C, T, P, P))
    return x_HbWbMMCTPP.reshape(Hb * Wb * M * M, C * T * P * P)


def preprocess_image(image: Image.Image, patch_size: int = PATCH_SIZE, temporal_patch_size: int = TEMPORAL_PATCH_SIZE,
                     merge_size: int = MERGE_SIZE, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS,
                     mean=IMAGE_MEAN, std=IMAGE_STD) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A PIL image -> (pixel_values (N, 3*T*P*P) float32, grid (t=1, h, w)), h*w = N."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"preprocess_image takes a PIL.Image.Image, got {type(image).__name__}; "
                        "open files with PIL.Image.open(path)")
    image = to_rgb(image)
    height, width = smart_resize(image.height, image.width, patch_size * merge_size, min_pixels, max_pixels)
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    x_HWC = normalize(np.asarray(image), mean, std)
    x_ND = patchify(x_HWC, patch_size, temporal_patch_size, merge_size)
    return torch.from_numpy(np.ascontiguousarray(x_ND)), (1, height // patch_size, width // patch_size)


def sample_photo_paths() -> list[Path]:
    """Real photographs (RGB and one grayscale) from the installed scikit-image
    package; only the ones its wheel actually ships."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("sample photos come from scikit-image; `pip install scikit-image`")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    paths = [data / name for name in _SKIMAGE_PHOTOS if (data / name).is_file()]
    if not paths:
        raise FileNotFoundError(f"none of {_SKIMAGE_PHOTOS} found in {data}; reinstall scikit-image")
    return paths
