"""moevlm.data.image against transformers' PIL Qwen2-VL image processor set up as
Qwen3-VL ships it, on real photographs from scikit-image; plus hand-worked
smart_resize sizes and the patch order checked without the reference.

Legend: N patches, D patch dim (C*T*P*P), C channels, T frames, P patch side."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from moevlm.data import image as img
from moevlm.data.image import preprocess_image, sample_photo_paths, smart_resize

# Qwen/Qwen3-VL-*/preprocessor_config.json on the hub.
QWEN3_VL_HUB = dict(size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16, temporal_patch_size=2,
                    merge_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
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
    assert (img.MIN_PIXELS, img.MAX_PIXELS) == (QWEN3_VL_HUB["size"]["shortest_edge"],
                                                QWEN3_VL_HUB["size"]["longest_edge"])
    assert (img.PATCH_SIZE, img.TEMPORAL_PATCH_SIZE, img.MERGE_SIZE) == (16, 2, 2)
    assert list(img.IMAGE_MEAN) == QWEN3_VL_HUB["image_mean"] and list(img.IMAGE_STD) == QWEN3_VL_HUB["image_std"]


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
    ("microaneurysms.png", dict(min_pixels=img.MIN_PIXELS, max_pixels=img.MAX_PIXELS), "102x102 L, upscaled"),
    ("chelsea.png", dict(min_pixels=img.MIN_PIXELS, max_pixels=img.MAX_PIXELS), "Qwen3-VL defaults, 288x448"),
    ("astronaut.png", dict(min_pixels=img.MIN_PIXELS, max_pixels=img.MAX_PIXELS), "Qwen3-VL defaults, no resize"),
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
    order = [(2 * br + r, 2 * bc + c) for br in range(2) for bc in range(3) for r in range(2) for c in range(2)]
    for n, (pr, pc) in enumerate(order):
        assert x_NCTPP[n, 0, 0, 0, 0] == pr * P and x_NCTPP[n, 1, 0, 0, 0] == pc * P
        assert x_NCTPP[n, 0, 0, P - 1, 0] == pr * P + P - 1 and x_NCTPP[n, 1, 0, 0, P - 1] == pc * P + P - 1
    assert (x_NCTPP[:, 2] == 7).all()


@pytest.mark.parametrize("hw,kw,want", [
    ((512, 512), {}, (512, 512)),                                  # already multiples of 32, inside budget
    ((300, 451), {}, (288, 448)),                                  # 9.375 -> 9, 14.09 -> 14 (x32)
    ((80, 48), dict(min_pixels=32 * 32, max_pixels=10**9), (64, 64)),  # round(2.5)=2, round(1.5)=2: halves to even
    ((1000, 500), dict(min_pixels=0, max_pixels=256 * 256), (352, 160)),  # beta=sqrt(500000/65536): floor 11, 5
    ((100, 50), dict(min_pixels=256 * 256, max_pixels=10**9), (384, 192)),  # beta=sqrt(65536/5000): ceil 12, 6
    ((32, 6000), dict(min_pixels=0, max_pixels=32 * 32 * 16), (32, 1728)),  # short side clamped to factor
    ((10, 2000), {}, (32, 3648)),                                  # aspect 200 allowed; beta=sqrt(3.2768)
])
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
