"""moevlm.data.image against transformers' PIL Qwen2-VL image processor set up as
Qwen3-VL ships it, on real photographs that packages ship (scikit-image,
scikit-learn, ...); plus hand-worked smart_resize sizes and the patch order
checked without the reference.

From bytes (decode_image, the data worker's path): bit-identical to the
reference (Image.open + exif_transpose + processor) with jpeg_draft off; every
bad input raises SkipSample with its reason; every PIL mode, built from real
photo content; EXIF orientations 2-8; JPEG draft requests and closeness.

Legend: N patches, D patch dim (C*T*P*P), C channels, T frames, P patch side."""

from __future__ import annotations

import io
import struct
import warnings
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile, ImageOps, JpegImagePlugin

from moevlm.data import image as img
from moevlm.data.config import ImageConfig
from moevlm.data.errors import SkipSample
from moevlm.data.image import decode_image, preprocess_image, smart_resize
from moevlm.data.sample import packaged_photos, sample_photo_paths

# Qwen/Qwen3-VL-*/preprocessor_config.json on the hub.
QWEN3_VL_HUB = dict(
    size={"shortest_edge": 65536, "longest_edge": 16777216},
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)
SMALL = dict(min_pixels=32 * 32 * 4, max_pixels=192 * 192)  # keeps every case a few ms


def skimage_file(name: str) -> Path:
    path = sample_photo_paths()[0].parent / name
    if not path.is_file():
        pytest.skip(f"{name} is not in this scikit-image wheel")
    return path


def reference(min_pixels: int, max_pixels: int):
    qwen2_vl = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    kw = {k: v for k, v in QWEN3_VL_HUB.items() if k != "size"}
    return qwen2_vl.Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, **kw)


def test_defaults_are_qwen3_vl_hub_config():
    assert (img.MIN_PIXELS, img.MAX_PIXELS) == (
        QWEN3_VL_HUB["size"]["shortest_edge"],
        QWEN3_VL_HUB["size"]["longest_edge"],
    )
    assert (img.PATCH_SIZE, img.TEMPORAL_PATCH_SIZE, img.MERGE_SIZE) == (16, 2, 2)
    assert (
        list(img.IMAGE_MEAN) == QWEN3_VL_HUB["image_mean"]
        and list(img.IMAGE_STD) == QWEN3_VL_HUB["image_std"]
    )


def test_sample_photos_exist_and_open():
    paths = sample_photo_paths()
    assert len(paths) >= 4
    for p in paths:
        with Image.open(p) as im:
            assert min(im.size) >= 256


# name, pixel budget, what the case exercises
CASES = [
    ("astronaut.png", SMALL, "square RGB, downscaled"),
    ("chelsea.png", SMALL, "landscape 451x300 RGB, downscaled"),
    ("rocket.jpg", SMALL, "JPEG 640x427, downscaled"),
    ("hubble_deep_field.jpg", SMALL, "1000x872, downscaled"),
    ("camera.png", SMALL, "grayscale (L) -> RGB"),
    ("horse.png", SMALL, "RGBA: alpha composited on white"),
    (
        "microaneurysms.png",
        dict(min_pixels=img.MIN_PIXELS, max_pixels=img.MAX_PIXELS),
        "102x102 L, upscaled",
    ),
    (
        "chelsea.png",
        dict(min_pixels=img.MIN_PIXELS, max_pixels=img.MAX_PIXELS),
        "Qwen3-VL defaults, 288x448",
    ),
    (
        "astronaut.png",
        dict(min_pixels=img.MIN_PIXELS, max_pixels=img.MAX_PIXELS),
        "Qwen3-VL defaults, no resize",
    ),
]


@pytest.mark.parametrize("name,budget,why", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_matches_transformers_pil_processor(name, budget, why):
    with Image.open(skimage_file(name)) as im:
        ref = reference(**budget)(images=[im], return_tensors="np")
        pixels_ND, grid = preprocess_image(im, **budget)
    assert [list(grid)] == ref["image_grid_thw"].tolist()
    assert pixels_ND.dtype == torch.float32 and pixels_ND.shape == ref["pixel_values"].shape
    # Same PIL resize and the same float arithmetic: equal to the bit, not just close.
    np.testing.assert_array_equal(pixels_ND.numpy(), ref["pixel_values"])


def test_patch_order_is_merge_block_raster_then_c_t_p_p():
    """Each pixel encodes its (row, col); check rows land where the merger expects."""
    P, M, T = 16, 2, 2
    H, W = 2 * P * M, 3 * P * M  # 2x3 merge blocks, 4x6 patches
    rows, cols = np.meshgrid(np.arange(H), np.arange(W), indexing="ij")
    x_HWC = np.stack([rows, cols, rows * 0 + 7], -1).astype(np.float32)
    x_ND = img.patchify(x_HWC, P, T, M)
    assert x_ND.shape == (H * W // (P * P), 3 * T * P * P)
    x_NCTPP = x_ND.reshape(-1, 3, T, P, P)
    np.testing.assert_array_equal(x_NCTPP[:, :, 0], x_NCTPP[:, :, 1])  # still image: frames equal
    # expected patch (row, col) for each output row: blocks in raster order, 2x2 inside
    order = [
        (2 * br + r, 2 * bc + c)
        for br in range(2)
        for bc in range(3)
        for r in range(2)
        for c in range(2)
    ]
    for n, (pr, pc) in enumerate(order):
        assert x_NCTPP[n, 0, 0, 0, 0] == pr * P and x_NCTPP[n, 1, 0, 0, 0] == pc * P
        assert (
            x_NCTPP[n, 0, 0, P - 1, 0] == pr * P + P - 1
            and x_NCTPP[n, 1, 0, 0, P - 1] == pc * P + P - 1
        )
    assert (x_NCTPP[:, 2] == 7).all()


@pytest.mark.parametrize(
    "hw,kw,want",
    [
        ((512, 512), {}, (512, 512)),  # already multiples of 32, inside budget
        ((300, 451), {}, (288, 448)),  # 9.375 -> 9, 14.09 -> 14 (x32)
        (
            (80, 48),
            dict(min_pixels=32 * 32, max_pixels=10**9),
            (64, 64),
        ),  # round(2.5)=2, round(1.5)=2: halves to even
        (
            (1000, 500),
            dict(min_pixels=0, max_pixels=256 * 256),
            (352, 160),
        ),  # beta=sqrt(500000/65536): floor 11, 5
        (
            (100, 50),
            dict(min_pixels=256 * 256, max_pixels=10**9),
            (384, 192),
        ),  # beta=sqrt(65536/5000): ceil 12, 6
        (
            (32, 6000),
            dict(min_pixels=0, max_pixels=32 * 32 * 16),
            (32, 1728),
        ),  # short side clamped to factor
        ((10, 2000), {}, (32, 3648)),  # aspect 200 allowed; beta=sqrt(3.2768)
    ],
)
def test_smart_resize_hand_worked(hw, kw, want):
    assert smart_resize(*hw, factor=32, **kw) == want


@pytest.mark.parametrize("hw", [(10, 2001), (3000, 14)])
def test_smart_resize_rejects_absurd_aspect_ratio(hw):
    with pytest.raises(ValueError, match="aspect ratio .* above the 200"):
        smart_resize(*hw)


def test_smart_resize_rejects_zero_side_and_non_pil():
    with pytest.raises(ValueError, match="raise min_pixels"):
        smart_resize(10, 100, factor=32, min_pixels=0)
    with pytest.raises(TypeError, match="PIL.Image.open"):
        preprocess_image(np.zeros((64, 64, 3), np.uint8))


# ---------------------------------------------------------------- bytes -> pixels (decode_image)

DEFAULTS = dict(min_pixels=img.MIN_PIXELS, max_pixels=img.MAX_PIXELS)


def all_packaged_photos() -> list[Path]:
    try:
        return [p.path for p in packaged_photos()]
    except FileNotFoundError:  # no scikit-image: the parametrized tests below are skipped
        return []


PHOTOS = all_packaged_photos()


def cfg(budget=SMALL, **kw) -> ImageConfig:
    return ImageConfig(**{**dict(jpeg_draft=False), **budget, **kw})


@lru_cache(maxsize=None)
def cached_reference(min_pixels: int, max_pixels: int):
    return reference(min_pixels, max_pixels)


def reference_from_bytes(data: bytes, budget=SMALL):
    """The reference as transformers' load_image feeds it: PIL.Image.open + exif_transpose."""
    with Image.open(io.BytesIO(data)) as im:
        out = cached_reference(**budget)(images=[ImageOps.exif_transpose(im)], return_tensors="np")
    return out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())


def assert_matches_reference(data: bytes, budget=SMALL):
    want, want_grid = reference_from_bytes(data, budget)
    pixels_ND, grid = decode_image(data, cfg(budget))
    assert grid == want_grid and pixels_ND.dtype == torch.float32
    np.testing.assert_array_equal(pixels_ND.numpy(), want)


def encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


@lru_cache(maxsize=None)
def photo(name: str, size: tuple[int, int] | None = None) -> Image.Image:
    with Image.open(skimage_file(name)) as im:
        im.load()
    return im.resize(size, Image.Resampling.BICUBIC) if size else im


def reasons(data: bytes, config: ImageConfig | None = None) -> str:
    with pytest.raises(SkipSample) as err:
        decode_image(data, config or cfg())
    return err.value.reason


def test_float32_rescale_equals_reference_float64_rescale_for_every_uint8():
    u = np.arange(256)
    np.testing.assert_array_equal(
        np.float32(u) / np.float32(255), (u * (1 / 255)).astype(np.float32)
    )


# 1, 2 (last one short), 3 chunks
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 2 * 8 * 3 * 256 * 4, 1])
@pytest.mark.parametrize(
    "mean,std",
    [
        (img.IMAGE_MEAN, img.IMAGE_STD),
        ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    ],
)
@pytest.mark.parametrize("name", ["chelsea.png", "camera.png"])
def test_image_to_patches_equals_reference_arithmetic(name, mean, std, chunk_bytes, monkeypatch):
    """The fast path (uint8 transpose, float32 math on compact patches a few
    block rows at a time, grey kept one band) against normalize + patchify, for
    Qwen3-VL's and CLIP's mean/std."""
    monkeypatch.setattr(img, "CHUNK_BYTES", chunk_bytes)
    im = photo(name, (64, 96))  # PIL sizes are (width, height): 3 rows of 2 merge blocks
    pixels_ND, grid = img.image_to_patches(im, 16, 2, 2, mean, std)
    want = img.patchify(img.normalize(np.asarray(im.convert("RGB")), mean, std), 16, 2, 2)
    assert grid == (1, 6, 4)
    np.testing.assert_array_equal(pixels_ND.numpy(), want)


@pytest.mark.parametrize("path", PHOTOS, ids=[p.name for p in PHOTOS])
def test_decode_matches_reference_on_packaged_photos(path):
    assert_matches_reference(path.read_bytes())


@pytest.mark.parametrize("name", ["rocket.jpg", "chelsea.png", "microaneurysms.png"])
def test_decode_matches_reference_with_qwen3_vl_defaults(name):
    assert_matches_reference(skimage_file(name).read_bytes(), DEFAULTS)


# ---------------------------------------------------------------- bad input


def png_with_size(width: int, height: int) -> bytes:
    """A real PNG (camera.png) whose IHDR claims width x height (CRC fixed)."""
    data = skimage_file("camera.png").read_bytes()
    assert data[12:16] == b"IHDR"
    ihdr = struct.pack(">II", width, height) + data[24:29]
    return data[:16] + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)) + data[33:]


def jpeg_with_size(width: int, height: int) -> bytes:
    """A real JPEG (rocket.jpg) whose SOF0 header claims width x height."""
    data = bytearray(skimage_file("rocket.jpg").read_bytes())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def png_bomb(side: int) -> bytes:
    """A valid all-black side x side greyscale PNG: ~0.5 MB for 121 Mpixel at side 11000."""
    co, row = zlib.compressobj(1), bytes(side + 1)
    idat = (
        b"".join(co.compress(row * 100) for _ in range(side // 100))
        + co.compress(row * (side % 100))
        + co.flush()
    )

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
        + chunk(b"IDAT", idat)
        + chunk(b"IEND", b"")
    )


def test_empty_random_and_non_image_bytes():
    rng = np.random.default_rng(0)
    assert reasons(b"") == "empty_image"
    assert reasons(rng.bytes(5000)) == "not_an_image"  # e.g. a member named x.jpg holding noise
    assert reasons(b"\xff\xd8\xff" + rng.bytes(5000)) == "not_an_image"  # JPEG magic, then noise
    # EPS: not tried
    assert reasons(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n") == "not_an_image"
    assert reasons("a caption, not an image".encode()) == "not_an_image"


@pytest.mark.parametrize(
    "name,fmt", [("rocket.jpg", None), ("chelsea.png", None), ("chelsea.png", "JPEG")]
)
def test_truncated_files_are_bad_images(name, fmt, monkeypatch):
    data = skimage_file(name).read_bytes() if fmt is None else encode(photo(name), fmt)
    for keep in (0.5, 0.9):
        assert reasons(data[: int(len(data) * keep)]) == "bad_image"
    # a process that set PIL's global to accept truncated files still gets the skip, and keeps its setting
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    assert reasons(data[: len(data) // 2]) == "bad_image"
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True


def test_size_above_limit_is_rejected_from_the_header():
    small = cfg(max_image_pixels=100_000)
    # 451x300 real photo
    assert reasons(encode(photo("chelsea.png"), "PNG"), small) == "image_too_large"
    assert reasons(encode(photo("chelsea.png"), "JPEG"), small) == "image_too_large"
    # above ours (1e8), below PIL's error
    assert reasons(png_with_size(12_000, 12_000)) == "image_too_large"
    # PIL's DecompressionBombError
    assert reasons(png_with_size(100_000, 100_000)) == "image_too_large"
    assert reasons(jpeg_with_size(15_000, 15_000)) == "image_too_large"
    assert decode_image(encode(photo("chelsea.png"), "PNG"), cfg(max_image_pixels=451 * 300))[
        1
    ] == (1, 8, 14)


def test_real_decompression_bomb_is_rejected_before_decoding():
    bomb = png_bomb(11_000)  # 121 Mpixel: past the default max_image_pixels and PIL's warning
    assert len(bomb) < 1_000_000
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DecompressionBombWarning leaks out either
        assert reasons(bomb, ImageConfig()) == "image_too_large"


def test_degenerate_sizes():
    assert reasons(encode(photo("chelsea.png", (600, 2)), "PNG")) == "bad_image_size"  # aspect 300
    assert reasons(encode(photo("chelsea.png", (3, 700)), "JPEG")) == "bad_image_size"
    assert reasons(png_with_size(1, 300)) == "bad_image_size"
    assert reasons(png_with_size(0, 300)) == "not_an_image"  # PIL refuses a zero side in the header
    # aspect 200 passes
    assert decode_image(encode(photo("chelsea.png", (400, 2)), "PNG"), cfg())[1][0] == 1


def test_any_other_decoding_error_becomes_bad_image_with_its_text(monkeypatch):
    def broken(image):
        raise RuntimeError("decoder exploded")

    monkeypatch.setattr(img, "to_rgb_or_grey", broken)
    with pytest.raises(SkipSample, match="bad_image: RuntimeError: decoder exploded"):
        decode_image(skimage_file("rocket.jpg").read_bytes(), cfg())


def test_config_errors_are_not_skips():
    with pytest.raises(ValueError, match="raise min_pixels"):
        decode_image(
            encode(photo("chelsea.png", (100, 10)), "PNG"),
            cfg(dict(min_pixels=0, max_pixels=10**6)),
        )


def test_pil_global_state_is_restored():
    filters = list(warnings.filters)
    decode_image(skimage_file("rocket.jpg").read_bytes(), cfg())
    with pytest.raises(SkipSample):
        decode_image(b"junk", cfg())
    assert warnings.filters == filters and ImageFile.LOAD_TRUNCATED_IMAGES is False


# ---------------------------------------------------------------- modes


def with_alpha(im: Image.Image) -> Image.Image:
    """im plus an alpha band from another real photo (camera.png), so alpha takes every value."""
    out = im.copy()
    out.putalpha(photo("camera.png", im.size))
    return out


def palette_with_transparency(im: Image.Image) -> bytes:
    p = im.convert("P")
    # the most common colour becomes transparent
    key = int(np.bincount(np.asarray(p).ravel()).argmax())
    return encode(p, "PNG", transparency=key)


MODE_CASES = {  # name -> bytes of chelsea.png (a real photo) in that mode and format
    "1-png": lambda im: encode(im.convert("1"), "PNG"),
    "L-png": lambda im: encode(im.convert("L"), "PNG"),
    "L-jpeg": lambda im: encode(im.convert("L"), "JPEG"),
    "P-png": lambda im: encode(im.convert("P"), "PNG"),
    "P-gif": lambda im: encode(im.convert("P"), "GIF"),
    "P-tRNS-png": palette_with_transparency,
    "LA-png": lambda im: encode(with_alpha(im.convert("L")), "PNG"),
    "RGBA-png": lambda im: encode(with_alpha(im), "PNG"),
    "PA-tiff": lambda im: encode(with_alpha(im.convert("P")).convert("PA"), "TIFF"),
    "CMYK-jpeg": lambda im: encode(im.convert("CMYK"), "JPEG"),
    "CMYK-tiff": lambda im: encode(im.convert("CMYK"), "TIFF"),
    "YCbCr-tiff": lambda im: encode(im.convert("YCbCr"), "TIFF"),
    "RGB-webp": lambda im: encode(im, "WEBP"),
    "RGB-bmp": lambda im: encode(im, "BMP"),
}


@pytest.mark.parametrize("case", MODE_CASES)
def test_modes_match_reference(case):
    data = MODE_CASES[case](photo("chelsea.png"))
    with Image.open(io.BytesIO(data)) as im:
        assert im.mode == case.split("-")[0]
        if "tRNS" in case:
            assert "transparency" in im.info
        if "A" in im.mode:
            assert im.getextrema()[-1][0] < 128  # the alpha band really is translucent somewhere
    assert_matches_reference(data)


def grey_u8() -> np.ndarray:
    g = np.asarray(photo("camera.png"))
    assert (g.min(), g.max()) == (0, 255)  # so a min..max stretch maps it back exactly
    return g


WIDE_CASES = {  # name -> (mode, format, camera.png's 8-bit values -> that mode's values)
    "I;16-png": ("I;16", "PNG", lambda g: Image.fromarray(g.astype(np.uint16) * 257)),
    "I;16B-tiff": (
        "I;16B",
        "TIFF",
        lambda g: Image.frombytes("I;16B", g.shape[::-1], (g.astype(">u2") * 257).tobytes()),
    ),
    "I-tiff": ("I", "TIFF", lambda g: Image.fromarray(g.astype(np.int32) * 257)),
    "I-stretched-tiff": (
        "I",
        "TIFF",
        lambda g: Image.fromarray(g.astype(np.int32) * 1000 - 50_000),
    ),
    "F-tiff": ("F", "TIFF", lambda g: Image.fromarray(g.astype(np.float32) / 255)),
    "F-stretched-tiff": ("F", "TIFF", lambda g: Image.fromarray(g.astype(np.float32) * 0.37 - 20)),
}


@pytest.mark.parametrize("case", WIDE_CASES)
def test_wide_grey_modes_scale_to_8_bit(case):
    """16/32-bit and float grey decode like the 8-bit photo they came from (PIL's
    convert would clip: the reference sees an almost white image)."""
    mode, fmt, make = WIDE_CASES[case]
    data = encode(make(grey_u8()), fmt)
    with Image.open(io.BytesIO(data)) as im:
        assert im.mode == mode
    pixels_ND, grid = decode_image(data, cfg())
    want_ND, want_grid = decode_image(encode(photo("camera.png"), "PNG"), cfg())
    assert grid == want_grid
    np.testing.assert_array_equal(pixels_ND.numpy(), want_ND.numpy())


def test_preprocess_image_handles_wide_grey_too():
    im16 = Image.fromarray(grey_u8().astype(np.uint16) * 257)
    np.testing.assert_array_equal(
        preprocess_image(im16, **SMALL)[0].numpy(),
        preprocess_image(photo("camera.png"), **SMALL)[0].numpy(),
    )


# ---------------------------------------------------------------- EXIF orientation and JPEG draft

# orientation -> how to store an upright image so that the tag turns it upright again
STORE_FOR = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_90,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}


def with_orientation(upright: Image.Image, orientation: int, fmt: str, **kw) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(upright.transpose(STORE_FOR[orientation]), fmt, exif=exif, **kw)


@pytest.mark.parametrize("orientation", sorted(STORE_FOR))
def test_exif_orientation_png_decodes_as_the_upright_photo(orientation):
    upright = photo("chelsea.png")  # 451x300: a wrong rotation changes the grid
    data = with_orientation(upright, orientation, "PNG")
    pixels_ND, grid = decode_image(data, cfg())
    want_ND, want_grid = decode_image(encode(upright, "PNG"), cfg())
    assert grid == want_grid == (1, 8, 14)
    np.testing.assert_array_equal(pixels_ND.numpy(), want_ND.numpy())
    assert_matches_reference(data)


@pytest.mark.parametrize("orientation", [6, 8])
def test_exif_orientation_jpeg_with_and_without_draft(orientation, monkeypatch):
    # stored 872x1000
    data = with_orientation(photo("hubble_deep_field.jpg"), orientation, "JPEG", quality=95)
    budget = dict(min_pixels=32 * 32, max_pixels=128 * 128)
    assert_matches_reference(data, budget)  # draft off: bit-identical, grid of the upright 1000x872
    requests = spy_on_draft(monkeypatch)
    pixels_ND, grid = decode_image(data, ImageConfig(**budget, jpeg_draft=True))
    want_ND, want_grid = reference_from_bytes(data, budget)
    assert grid == want_grid == (1, 6, 8)  # 96x128 upright
    ((stored, requested, decoded),) = (
        requests  # PIL sizes are (width, height), in the stored orientation
    )
    assert stored == (872, 1000) and requested == (96, 128) and decoded == (218, 250)  # 1/4 scale
    assert 0 < np.abs(pixels_ND.numpy() - want_ND).mean() < 0.03


def spy_on_draft(monkeypatch) -> list:
    """Record (stored size, requested size, size after draft) of every JPEG draft call."""
    calls, real = [], JpegImagePlugin.JpegImageFile.draft

    def draft(self, mode, size):
        stored = self.size
        out = real(self, mode, size)
        calls.append((stored, size, self.size))
        return out

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", draft)
    return calls


def test_draft_asks_for_at_least_the_target_on_each_side(monkeypatch):
    data = encode(photo("retina.jpg"), "JPEG", quality=90)  # 1411x1411
    requests = spy_on_draft(monkeypatch)
    _, grid = decode_image(
        data, ImageConfig(min_pixels=32 * 32, max_pixels=320 * 320, jpeg_draft=True)
    )
    assert grid == (1, 20, 20)
    assert requests == [((1411, 1411), (320, 320), (353, 353))]  # 1/4 scale: 1/8 would be below 320
    requests.clear()
    decode_image(data, ImageConfig(min_pixels=32 * 32, max_pixels=800 * 800, jpeg_draft=True))
    assert requests == []  # under 2x smaller: no draft to ask for


def test_draft_pixels_close_to_full_decode_same_grids():
    """Every packaged photo as JPEG q90, downscaled 2-8x: grids equal, pixels
    within a few grey levels on average (one level = 2/255 = 0.0078 here)."""
    budget = dict(min_pixels=32 * 32, max_pixels=128 * 128)
    per_image, drafted = [], 0
    for path in PHOTOS:
        with Image.open(path) as im:
            data = encode(img.to_rgb_or_grey(im), "JPEG", quality=90)
        exact_ND, grid = decode_image(data, cfg(budget))
        draft_ND, draft_grid = decode_image(data, cfg(budget, jpeg_draft=True))
        assert draft_grid == grid
        diff = (draft_ND - exact_ND).abs()
        drafted += bool(diff.max() > 0)
        per_image.append(diff.mean().item())
    assert drafted >= len(PHOTOS) - 1  # all but at most one really drafted
    assert max(per_image) < 0.06 and np.mean(per_image) < 0.025, per_image


def png_header(side: int, bit_depth: int, color_type: int) -> bytes:
    """A PNG of IHDR, an empty IDAT and IEND: PIL reads mode and size from it without any pixel."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    ihdr = struct.pack(">IIBBBBB", side, side, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


def test_decode_byte_guard_counts_the_mode_and_keeps_8_bit_rgb_within_the_pixel_guard():
    """The default max_decode_bytes passes an 8-bit RGB image at the pixel guard's limit and skips a
    16-bit grey one of about the same size (~3.5 GiB to decode), from the header alone."""
    default = ImageConfig()
    with warnings.catch_warnings():  # PIL's DecompressionBombWarning (the header is all there is)
        warnings.simplefilter("ignore")
        rgb = Image.open(io.BytesIO(png_header(10_000, 8, 2)))
    assert rgb.mode == "RGB" and rgb.width * rgb.height == default.max_image_pixels
    assert img.decode_bytes(rgb) <= default.max_decode_bytes
    with pytest.raises(SkipSample, match=r"9999x9999 mode I;16: decoding needs about") as err:
        img._open_header(png_header(9_999, 16, 0), default)
    assert err.value.reason == "decode_too_large"
