"""Qwen3-VL image preprocessing: encoded bytes -> decode -> smart resize -> rescale + normalize ->
patchify, equal value for value to transformers' Qwen2VLImageProcessorPil set up as Qwen3-VL ships it.

Legend: H, W image height/width in pixels, C channels (3), T temporal patch (frames per patch), P patch
side, M merge side, Hb/Wb merge blocks down/across (H / (P*M), W / (P*M)), N patches (Hb*M * Wb*M),
Q pixels of a patch (P*P).

    pixels_ND, (t, h, w) = decode_image(jpeg_bytes, ImageConfig())   # in a data worker
    pixels_ND, (t, h, w) = preprocess_image(PIL.Image.open(path))    # a PIL image at hand
    pixels_ND, (t, h, w) = random_image(jpeg_bytes, cfg, seed)        # data.mock=random_pixels
    # pixels_ND: (h*w, C*T*P*P) float32, rows in merge-block order; t*h*w / M**2 image tokens
"""

from __future__ import annotations

import contextlib
import io
import math
import warnings

import numpy as np
import torch
from PIL import Image, ImageFile, JpegImagePlugin

from moevlm.data.config import ImageConfig
from moevlm.data.errors import SkipSample

# Qwen3-VL's preprocessor_config.json (Qwen/Qwen3-VL-* on the hub).
PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE_SIZE = 16, 2, 2
MIN_PIXELS, MAX_PIXELS = 256 * 256, 4096 * 4096
IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)
MAX_ASPECT_RATIO = 200

# Formats tried on untrusted bytes (the ones this Pillow build has are used).
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "PPM", "AVIF")
# JPEG draft: libjpeg decodes at the smallest scale (1/2, 1/4, 1/8) that keeps
# at least DRAFT_GAP x the target on each side; bicubic does the rest.  1 is
# the fastest; 2 (PIL's thumbnail default) cut the mean difference to the full
# decode to about a third on the packaged photos, but drafts only images at
# least 4x the target on each side, which few are.
DRAFT_GAP = 1
_ORIENTATION = 0x0112  # EXIF tag
_EXIF_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SWAPS_SIDES = (5, 6, 7, 8)
# Bytes per pixel that turning a decoded image into RGB or L adds at full size (before the resize), on
# top of its stored pixels: "wide" 16/32-bit and float grey go through numpy float64 (wide_grey_to_l),
# "alpha" is composited on white in RGBA (to_rgb), "convert" is one convert() to RGB or L.  Measured
# peaks on this code path (a 4000x4000 image): RGB 5, RGBA 20, I;16 34, I and F 44 bytes per pixel.
DECODE_EXTRA = {"wide": 32, "alpha": 16, "convert": 4}
# image_to_patches' working set (fits L2): ~12% faster than whole-image passes
CHUNK_BYTES = 1 << 20


def smart_resize(
    height: int,
    width: int,
    factor: int = PATCH_SIZE * MERGE_SIZE,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> tuple[int, int]:
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
        raise ValueError(
            f"image of height={height}, width={width} has aspect ratio {ratio:.1f}, above the "
            f"{MAX_ASPECT_RATIO} Qwen3-VL accepts; crop or pad it first"
        )
    h_bar, w_bar = fit_area(height, width, factor, min_pixels, max_pixels)
    if h_bar == 0 or w_bar == 0:  # only possible when min_pixels < factor**2
        raise ValueError(
            f"height={height}, width={width} rounds to {h_bar}x{w_bar} pixels; "
            f"raise min_pixels={min_pixels} to at least factor**2={factor * factor}"
        )
    return h_bar, w_bar


def fit_area(
    height: int,
    width: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    frames: int = 1,
    temporal_factor: int = 1,
) -> tuple[int, int]:
    """smart_resize's rounding, shared with the video's (moevlm.data.video.video_smart_resize): sides
    rounded to multiples of `factor`; the area of `frames` frames (their count rounded to a multiple of
    `temporal_factor`) kept within [min_pixels, max_pixels] by one common scale of both sides."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# ---------------------------------------------------------------- decoding


def decode_image(data: bytes, cfg: ImageConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Encoded image bytes -> (pixel_values (N, 3*T*P*P) float32, grid (1, h, w)).

    Raises SkipSample (empty_image, not_an_image, image_too_large,
    bad_image_size, bad_image) for anything that cannot be used; a ValueError
    only for a config that no image could satisfy."""
    image = open_image(data, cfg)
    return image_to_patches(
        image, cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size, cfg.mean, cfg.std
    )


def random_image(
    data: bytes, cfg: ImageConfig, seed: int
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """data.mock=random_pixels: the grid decode_image would give (same header checks, EXIF orientation,
    smart resize), with seeded random patches instead of the decoded pixels: each value uniform over
    what a pixel in [0, 1] normalizes to on its channel, (0 - mean) / std .. (1 - mean) / std."""
    if len(data) == 0:
        raise SkipSample("empty_image", "0 bytes")
    with _strict_pil():
        image, orientation = _guarded(_open_header, data, cfg)
    height, width = (
        (image.width, image.height) if orientation in _SWAPS_SIDES else (image.height, image.width)
    )
    h, w = smart_resize(
        height, width, cfg.patch_size * cfg.merge_size, cfg.min_pixels, cfg.max_pixels
    )
    grid = (1, h // cfg.patch_size, w // cfg.patch_size)
    g = torch.Generator().manual_seed(seed)
    x_NCQ = torch.rand(
        grid[1] * grid[2], 3, cfg.temporal_patch_size * cfg.patch_size**2, generator=g
    )
    mean, std = torch.tensor(cfg.mean).view(1, 3, 1), torch.tensor(cfg.std).view(1, 3, 1)
    return x_NCQ.sub_(mean).div_(std).flatten(1), grid  # in place: no copies of a large image


def open_image(data: bytes, cfg: ImageConfig) -> Image.Image:
    """Encoded bytes -> the upright image, mode "RGB" (or "L" for grey), at its
    smart-resize target size (each side a multiple of patch * merge)."""
    if len(data) == 0:
        raise SkipSample("empty_image", "0 bytes")
    with _strict_pil():
        image, orientation = _guarded(_open_header, data, cfg)
        height, width = (
            (image.width, image.height)
            if orientation in _SWAPS_SIDES
            else (image.height, image.width)
        )
        target_hw = smart_resize(
            height, width, cfg.patch_size * cfg.merge_size, cfg.min_pixels, cfg.max_pixels
        )
        return _guarded(_decode_at, image, orientation, target_hw, cfg.jpeg_draft)


def _guarded(fn, *args):
    """fn(*args), any exception it raises turned into a SkipSample (decoding only: config errors stay outside)."""
    try:
        return fn(*args)
    except SkipSample:
        raise
    except Image.DecompressionBombError as e:  # PIL's own limit, 2 * Image.MAX_IMAGE_PIXELS
        raise SkipSample("image_too_large", str(e)) from None
    except Exception as e:  # noqa: BLE001 - corrupt data raises anything (OSError, SyntaxError, ValueError, ...)
        raise SkipSample("bad_image", f"{type(e).__name__}: {e}") from None


@contextlib.contextmanager
def _strict_pil():
    """Truncated files raise even if the process set ImageFile.LOAD_TRUNCATED_IMAGES;
    PIL's warnings are silenced: its DecompressionBombWarning (max_image_pixels
    decides) and its notes on damaged data (which either fails, and is counted,
    or decodes), so bad data does not flood a worker's log.

    Both are process-global and restored on exit; data workers decode in one
    thread, so the change is seen by nothing else."""
    load_truncated = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"PIL\.")
            yield
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = load_truncated


_FORMATS: tuple[str, ...] | None = None


def allowed_formats() -> tuple[str, ...]:
    """The FORMATS this Pillow build can open: what untrusted bytes may be (builder and reader alike)."""
    global _FORMATS
    if _FORMATS is None:
        Image.init()
        _FORMATS = tuple(f for f in FORMATS if f in Image.OPEN)
    return _FORMATS


def decode_bytes(image: Image.Image) -> int:
    """About the most memory decoding `image` (an opened header, no pixels yet) holds: its pixels as
    PIL stores its mode (1, 2 or 4 bytes), plus what turning them into RGB or L costs at full size
    (measured on this code path, DECODE_EXTRA)."""
    mode = image.mode
    stored = 1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4
    if mode.startswith("I") or mode == "F":
        extra = DECODE_EXTRA["wide"] + stored  # a numpy copy, then float64 temporaries
    elif "A" in image.getbands() or image.info.get("transparency") is not None:
        extra = DECODE_EXTRA["alpha"]
    elif mode in ("RGB", "L"):
        extra = 0
    else:
        extra = DECODE_EXTRA["convert"]
    return image.width * image.height * (stored + extra)


def check_image_shape(
    width: int, height: int, shown: str = "", reason: str = "bad_image_size"
) -> None:
    """SkipSample(`reason`) for an image (or a video's frames) no config can train on (a zero side, an
    aspect ratio above MAX_ASPECT_RATIO): the loader's rule, which the shard builder applies too."""
    if min(width, height) <= 0 or max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise SkipSample(
            reason,
            f"{shown}{': ' if shown else ''}{width}x{height}: a zero side or an aspect ratio above "
            f"{MAX_ASPECT_RATIO}",
        )


def _open_header(data: bytes, cfg: ImageConfig) -> tuple[Image.Image, int]:
    """Parse the header (no pixels yet for JPEG): (image, EXIF orientation).  Skips an image above
    the pixel guard or whose decoding would hold more than max_decode_bytes."""
    max_image_pixels = cfg.max_image_pixels
    try:
        image = Image.open(io.BytesIO(data), formats=allowed_formats())
    except Image.UnidentifiedImageError:
        raise SkipSample(
            "not_an_image",
            f"{len(data):,} bytes starting {data[:8]!r} are not a "
            f"{'/'.join(allowed_formats())} image",
        ) from None
    width, height = image.size
    if width * height > max_image_pixels:
        raise SkipSample(
            "image_too_large",
            f"{width}x{height} = {width * height:,} pixels, above "
            f"max_image_pixels={max_image_pixels:,}",
        )
    check_image_shape(width, height)
    if (need := decode_bytes(image)) > cfg.max_decode_bytes:
        raise SkipSample(
            "decode_too_large",
            f"{width}x{height} mode {image.mode}: decoding needs about {need:,} bytes, above "
            f"max_decode_bytes={cfg.max_decode_bytes:,}",
        )
    # PNG reads pixels here: eXIf may follow IDAT
    return image, image.getexif().get(_ORIENTATION, 1)


def _decode_at(
    image: Image.Image, orientation, target_hw: tuple[int, int], draft: bool
) -> Image.Image:
    """Decode (at reduced JPEG scale if allowed), orient, convert, resize to target_hw."""
    height, width = target_hw
    if draft and isinstance(image, JpegImagePlugin.JpegImageFile):
        # draft works on the stored orientation: swap the request back when EXIF will rotate
        want = (height, width) if orientation in _SWAPS_SIDES else (width, height)
        want = (want[0] * DRAFT_GAP, want[1] * DRAFT_GAP)
        if image.width >= 2 * want[0] and image.height >= 2 * want[1]:
            image.draft(image.mode, want)
    image.load()
    if (method := _EXIF_TRANSPOSE.get(orientation)) is not None:
        image = image.transpose(method)
    image = to_rgb_or_grey(image)
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    return image


# ---------------------------------------------------------------- modes


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency (alpha band or palette/tRNS key) composited on white."""
    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def to_rgb_or_grey(image: Image.Image) -> Image.Image:
    """Mode "RGB" or "L" with the pixels to_rgb would give (grey kept one band);
    16/32-bit integer and float grey scaled to 8 bits (wide_grey_to_l)."""
    mode = image.mode
    if mode.startswith("I") or mode == "F":
        return wide_grey_to_l(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        return to_rgb(image)
    if mode in ("RGB", "L"):
        return image
    return image.convert("L" if mode == "1" else "RGB")


def wide_grey_to_l(image: Image.Image) -> Image.Image:
    """I;16* -> L as round(v * 255 / 65535).  I (int32) and F (float32): values
    within the nominal range ([0, 65535], resp. [0, 1]) are scaled from it,
    anything else is stretched from its finite min..max; NaN becomes black; a
    tRNS key is ignored.  (PIL's convert("L") clips at 255 instead, which turns
    most 16-bit images white.)"""
    x = np.asarray(image).astype(np.float64)
    lo, hi = 0.0, 65535.0
    if not image.mode.startswith("I;16"):
        finite = x[np.isfinite(x)]
        nominal = 65535.0 if image.mode == "I" else 1.0
        if finite.size and (finite.min() < 0 or finite.max() > nominal):
            lo, hi = float(finite.min()), float(finite.max())
        else:
            hi = nominal
    y = np.rint((x - lo) * (255 / max(hi - lo, 1e-30)))
    return Image.fromarray(np.clip(np.nan_to_num(y, nan=0.0), 0, 255).astype(np.uint8))


# ---------------------------------------------------------------- pixels


def image_to_patches(
    image: Image.Image,
    patch_size: int = PATCH_SIZE,
    temporal_patch_size: int = TEMPORAL_PATCH_SIZE,
    merge_size: int = MERGE_SIZE,
    mean=IMAGE_MEAN,
    std=IMAGE_STD,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """An "RGB" or "L" image whose sides are multiples of P*M -> (pixels (N, 3*T*P*P), (1, h, w)).

    Equal to patchify(normalize(RGB array)) (the reference arithmetic), faster:
    a few rows of merge blocks at a time (about CHUNK_BYTES of float32), the
    uint8 transpose and the float32 math go to a buffer that stays in cache,
    then one broadcast write puts its T copies (and a grey band's 3) in place."""
    x_HWC = np.asarray(image)
    if x_HWC.ndim == 2:
        x_HWC = x_HWC[:, :, None]  # grey: one band until the final broadcast
    H, W, Cin = x_HWC.shape
    P, M, T, C = patch_size, merge_size, temporal_patch_size, 3
    Hb, Wb, Q = H // (P * M), W // (P * M), P * P
    if Hb * P * M != H or Wb * P * M != W or Cin not in (1, C) or x_HWC.dtype != np.uint8:
        raise ValueError(
            f"image_to_patches needs uint8 RGB or L with sides multiple of {P * M}, got "
            f"{image.mode} {W}x{H}; use preprocess_image"
        )
    mean_C, std_C = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    uniform = bool((mean_C == mean_C[0]).all() and (std_C == std_C[0]).all())
    if Cin == 1 and not uniform:
        x_HWC, Cin = (
            np.repeat(x_HWC, C, axis=2),
            C,
        )  # per-channel mean/std on grey: three bands after all
    mean_C11, std_C11 = (
        (mean_C[0], std_C[0]) if uniform else (mean_C[:, None, None], std_C[:, None, None])
    )
    R = Wb * M * M  # patches in one row of merge blocks
    rows = max(1, CHUNK_BYTES // (R * Cin * Q * 4))
    x_HbMPWbMPC = x_HWC.reshape(Hb, M, P, Wb, M, P, Cin)
    buf_RC1Q = np.empty((rows * R, Cin, 1, Q), np.float32)
    out_NCTQ = np.empty((Hb * R, C, T, Q), np.float32)
    for h0 in range(0, Hb, rows):
        h1 = min(h0 + rows, Hb)
        # (rows, Wb, M, M, C, P, P)
        u8 = np.ascontiguousarray(x_HbMPWbMPC[h0:h1].transpose(0, 3, 1, 4, 6, 2, 5))
        x_RC1Q = buf_RC1Q[: (h1 - h0) * R]
        np.divide(u8.reshape(x_RC1Q.shape), np.float32(255), out=x_RC1Q, dtype=np.float32)
        x_RC1Q -= mean_C11
        x_RC1Q /= std_C11
        out_NCTQ[h0 * R : h1 * R] = x_RC1Q  # the frame repeated T times (and a grey band 3 times)
    return torch.from_numpy(out_NCTQ.reshape(Hb * R, C * T * Q)), (1, H // P, W // P)


def preprocess_image(
    image: Image.Image,
    patch_size: int = PATCH_SIZE,
    temporal_patch_size: int = TEMPORAL_PATCH_SIZE,
    merge_size: int = MERGE_SIZE,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
    mean=IMAGE_MEAN,
    std=IMAGE_STD,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A PIL image -> (pixel_values (N, 3*T*P*P) float32, grid (t=1, h, w)), h*w = N.
    No EXIF orientation is applied (decode_image does, from bytes)."""
    if not isinstance(image, Image.Image):
        raise TypeError(
            f"preprocess_image takes a PIL.Image.Image, got {type(image).__name__}; "
            "open files with PIL.Image.open(path)"
        )
    image = to_rgb_or_grey(image)
    height, width = smart_resize(
        image.height, image.width, patch_size * merge_size, min_pixels, max_pixels
    )
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    return image_to_patches(image, patch_size, temporal_patch_size, merge_size, mean, std)


def normalize(x_HWC: np.ndarray, mean, std) -> np.ndarray:
    """uint8 -> float32: x / 255, then (x - mean) / std per channel (the reference's arithmetic)."""
    x_HWC = (x_HWC.astype(np.float64) * (1 / 255)).astype(np.float32)
    return (x_HWC - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


def patchify(
    x_HWC: np.ndarray, patch_size: int, temporal_patch_size: int, merge_size: int
) -> np.ndarray:
    """(H, W, C) -> (N, C*T*P*P) in merge-block order, the frame repeated T times."""
    H, W, C = x_HWC.shape
    P, M, T = patch_size, merge_size, temporal_patch_size
    Hb, Wb = H // (P * M), W // (P * M)
    x_HbMPWbMPC = x_HWC.reshape(Hb, M, P, Wb, M, P, C)
    x_HbWbMMCPP = x_HbMPWbMPC.transpose(0, 3, 1, 4, 6, 2, 5)
    x_HbWbMMCTPP = np.broadcast_to(x_HbWbMMCPP[:, :, :, :, :, None], (Hb, Wb, M, M, C, T, P, P))
    return x_HbWbMMCTPP.reshape(Hb * Wb * M * M, C * T * P * P)
