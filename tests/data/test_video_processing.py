"""moevlm.data.video against transformers' Qwen3VLVideoProcessor and Qwen3VLProcessor on the same decoded
frames (frames cut from a packaged photograph, panning).

The video processor needs torchvision, which this machine lacks, so the reference class is compiled from
transformers' own source file with a stand-in base class: its sample_frames, resize (the video smart
resize and the per-frame cap), _preprocess and patchify run verbatim, with the base's fused
rescale-and-normalize (TorchvisionBackend's, also verbatim); only torchvision's resize is replaced by the
kernel it calls on CPU for uint8 bicubic (torch.nn.functional.interpolate, antialias=True).

Legend: F frames, H, W frame height/width, N patches, D patch dim (C*T*P*P)."""

from __future__ import annotations

import re
import types
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from moevlm.data.config import VideoConfig
from moevlm.data.image import smart_resize
from moevlm.data.sample import sample_photo_paths
from moevlm.data.video import (
    frame_timestamps,
    preprocess_video,
    sample_frame_indices,
    video_smart_resize,
)

transformers = pytest.importorskip("transformers")


@lru_cache(maxsize=1)
def reference_class():
    """transformers' Qwen3VLVideoProcessor, compiled from its source over a torchvision-free base."""
    from transformers import (
        image_processing_utils,
        image_utils,
        processing_utils,
        utils,
        video_utils,
    )
    from transformers.image_processing_backends import TorchvisionBackend

    class Base:
        _fuse_mean_std_and_rescale_factor = TorchvisionBackend._fuse_mean_std_and_rescale_factor
        rescale_and_normalize = TorchvisionBackend.rescale_and_normalize

        def __init__(self, **kwargs):
            for k, v in kwargs.items():
                setattr(self, k, v)

        def resize(self, image, size, resample, **kwargs):
            if getattr(self, "record_only", False):  # the size asked for, no pixels
                self.asked = (size.height, size.width)
                return image
            # torchvision.transforms.v2.functional.resize on a CPU uint8 tensor, bicubic: the native
            # uint8 kernel of interpolate (its _do_native_uint8_resize_on_cpu)
            if (size.height, size.width) == tuple(image.shape[-2:]):
                return image
            x = image.reshape(-1, *image.shape[-3:])
            y = F.interpolate(x, size=(size.height, size.width), mode="bicubic", antialias=True)
            return y.reshape(*image.shape[:-2], size.height, size.width)

        def normalize(self, image, mean, std, inplace=False):  # torchvision's normalize
            image = image if inplace else image.clone()
            mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
            std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
            return image.sub_(mean).div_(std)

    path = Path(transformers.__file__).parent / "models/qwen3_vl/video_processing_qwen3_vl.py"
    src = re.sub(r"^from \.\.\..*$", "", path.read_text(), flags=re.M)
    ns = dict(
        math=__import__("math"),
        np=np,
        torch=torch,
        BatchFeature=image_processing_utils.BatchFeature,
        IMAGENET_STANDARD_MEAN=image_utils.IMAGENET_STANDARD_MEAN,
        IMAGENET_STANDARD_STD=image_utils.IMAGENET_STANDARD_STD,
        PILImageResampling=image_utils.PILImageResampling,
        SizeDict=image_utils.SizeDict,
        Unpack=processing_utils.Unpack,
        VideosKwargs=processing_utils.VideosKwargs,
        TensorType=utils.TensorType,
        auto_docstring=lambda c: c,
        is_torchvision_available=lambda: False,
        logging=utils.logging,
        BaseVideoProcessor=Base,
        VideoMetadata=video_utils.VideoMetadata,
        group_videos_by_shape=video_utils.group_videos_by_shape,
        reorder_videos=video_utils.reorder_videos,
        __name__="qwen3_vl_video_reference",
    )
    exec(compile(src, str(path), "exec"), ns)
    return ns["Qwen3VLVideoProcessor"], image_utils.SizeDict


def reference_process(frames_FHWC: np.ndarray, cfg: VideoConfig):
    cls, SizeDict = reference_class()
    proc = cls(max_video_tokens=cfg.max_video_tokens)
    out = proc._preprocess(
        [torch.from_numpy(frames_FHWC).permute(0, 3, 1, 2).contiguous()],
        do_resize=True,
        size=SizeDict(shortest_edge=cfg.min_pixels, longest_edge=cfg.max_pixels),
        resample=cls.resample,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=tuple(cfg.mean),
        image_std=tuple(cfg.std),
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size,
        merge_size=cfg.merge_size,
        cap_pixels_per_frame=cfg.cap_pixels_per_frame,
    )
    return out["pixel_values_videos"], out["video_grid_thw"]


@lru_cache(maxsize=4)
def panning_frames(n: int, height: int, width: int) -> np.ndarray:
    """n frames (n, height, width, 3) uint8: a window sliding across a packaged photograph."""
    photo = np.asarray(Image.open(sample_photo_paths()[0]).convert("RGB"))
    H, W, _ = photo.shape
    step = max(1, (W - width) // max(n, 1))
    frames = [photo[: min(H, height), i * step : i * step + width] for i in range(n)]
    out = np.stack(
        [np.pad(f, ((0, height - f.shape[0]), (0, width - f.shape[1]), (0, 0))) for f in frames]
    )
    return np.ascontiguousarray(out)


def test_defaults_are_transformers_defaults():
    cls, _ = reference_class()
    cfg = VideoConfig()
    assert (cfg.fps, cfg.min_frames, cfg.max_frames) == (cls.fps, cls.min_frames, cls.max_frames)
    assert (cfg.min_pixels, cfg.max_pixels) == (cls.size["shortest_edge"], cls.size["longest_edge"])
    assert (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) == (
        cls.patch_size,
        cls.temporal_patch_size,
        cls.merge_size,
    )
    assert cfg.max_video_tokens == cls.max_video_tokens
    assert tuple(cfg.mean) == tuple(cls.image_mean) and tuple(cfg.std) == tuple(cls.image_std)


@pytest.mark.parametrize(
    "total, video_fps, kw",
    [
        (300, 30.0, {}),  # 10 s: 20 frames
        (7, 25.0, {}),  # short: min_frames
        (3, 25.0, {}),  # shorter than min_frames: every frame
        (100_000, 29.97, {}),  # long: max_frames
        (121, None, {}),  # unknown rate: 24
        (250, 23.976, dict(fps=1.0, min_frames=2, max_frames=9)),
        (61, 12.5, dict(fps=3.3)),
    ],
)
def test_sample_frames_and_timestamps_equal_reference(total, video_fps, kw):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    cls, _ = reference_class()
    cfg = VideoConfig(**kw)
    ref = cls(min_frames=cfg.min_frames, max_frames=cfg.max_frames)
    meta = types.SimpleNamespace(total_num_frames=total, fps=video_fps)
    want = ref.sample_frames(meta, fps=cfg.fps)
    got = sample_frame_indices(total, video_fps, cfg)
    np.testing.assert_array_equal(got, want)
    seconds = Qwen3VLProcessor._calculate_timestamps(None, want, meta.fps, cfg.temporal_patch_size)
    assert frame_timestamps(got, video_fps, cfg.temporal_patch_size) == seconds


@pytest.mark.parametrize("cap", [False, True])
@pytest.mark.parametrize(
    "frames, hw, pixels",
    [
        (4, (480, 640), {}),
        (5, (1080, 1920), {}),
        (7, (17, 500), {}),  # a side below patch * merge: scaled up first
        (2, (300, 301), dict(min_pixels=1 << 20)),  # upscaled to the minimum
        (64, (720, 1280), dict(max_pixels=16 << 20)),
        (3, (33, 6000), {}),
    ],
)
def test_video_smart_resize_equals_reference(frames, hw, pixels, cap):
    cls, SizeDict = reference_class()
    cfg = VideoConfig(cap_pixels_per_frame=cap, **pixels)
    ref = cls(max_video_tokens=cfg.max_video_tokens, record_only=True)
    ref.resize(
        torch.zeros(1, frames, 3, *hw, dtype=torch.uint8),
        SizeDict(shortest_edge=cfg.min_pixels, longest_edge=cfg.max_pixels),
        cls.resample,
        factor=cfg.patch_size * cfg.merge_size,
        temporal_factor=cfg.temporal_patch_size,
        cap_pixels_per_frame=cap,
    )
    assert video_smart_resize(frames, *hw, cfg) == ref.asked


def test_image_smart_resize_unchanged_by_the_shared_rounding():
    # fit_area with one frame is the image rule (hand-worked, as tests/data/test_image.py has them)
    assert smart_resize(100, 200, factor=32, min_pixels=0, max_pixels=1 << 30) == (96, 192)
    assert smart_resize(1000, 1000, factor=32, min_pixels=0, max_pixels=512 * 512) == (512, 512)


@pytest.mark.parametrize(
    "frames, hw, kw",
    [
        (4, (96, 128), {}),  # upscaled to min_pixels
        (
            5,
            (200, 330),
            dict(min_pixels=4096, max_pixels=5 * 160 * 256),
        ),  # odd: last frame repeated
        (6, (160, 224), dict(min_pixels=4096, max_pixels=1 << 22)),  # already multiples: no resize
        (3, (250, 190), dict(min_pixels=4096, cap_pixels_per_frame=False, max_pixels=1 << 20)),
    ],
)
def test_preprocess_video_equals_reference(frames, hw, kw):
    cfg = VideoConfig(**kw)
    x = panning_frames(frames, *hw)
    got, grid = preprocess_video(x, cfg)
    want, want_grid = reference_process(x, cfg)
    assert [list(grid)] == want_grid.tolist()
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_preprocess_video_per_channel_mean_std():
    cfg = VideoConfig(
        min_pixels=4096,
        mean=(0.48145466, 0.4578275, 0.40821073),
        std=(0.26862954, 0.26130258, 0.27577711),
    )
    x = panning_frames(4, 96, 128)
    torch.testing.assert_close(
        preprocess_video(x, cfg)[0], reference_process(x, cfg)[0], rtol=0, atol=0
    )


def test_patch_order_hand_worked():
    # frame f, pixel (r, c) holds f; patch 0 of temporal patch 1 holds frames 2 and 3 in its T slots
    cfg = VideoConfig(min_pixels=0, patch_size=2, merge_size=2, mean=(0, 0, 0), std=(1 / 255,) * 3)
    x = np.broadcast_to(np.arange(5, dtype=np.uint8)[:, None, None, None], (5, 8, 4, 3)).copy()
    pv, grid = preprocess_video(x, cfg)
    assert grid == (3, 4, 2)
    pv = pv.view(3, 4 * 2, 3, 2, 2 * 2)  # (t, h*w, C, T, P*P)
    assert pv[1, :, :, 0].unique().tolist() == [2.0] and pv[1, :, :, 1].unique().tolist() == [3.0]
    assert pv[2, :, :, 1].unique().tolist() == [4.0]  # the odd last frame repeated


def test_bad_inputs_raise_readable_errors():
    with pytest.raises(TypeError, match="uint8 numpy array"):
        preprocess_video(np.zeros((4, 32, 32, 3), np.float32), VideoConfig())
    with pytest.raises(ValueError, match="at least temporal_patch_size=2 frames"):
        preprocess_video(np.zeros((1, 32, 32, 3), np.uint8), VideoConfig())
    with pytest.raises(ValueError, match="aspect ratio"):
        video_smart_resize(4, 32, 32 * 300, VideoConfig())
    with pytest.raises(ValueError, match="at least one frame"):
        sample_frame_indices(0, 30.0, VideoConfig())


# ---------------------------------------------------------------------- prompt
VS, VE, VPAD, IPAD = "<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|image_pad|>"


@pytest.fixture(scope="module")
def tok():
    from moevlm.data.sample import shipped_texts
    from moevlm.data.text import TINY_SPECIAL_IDS, train_bpe

    return train_bpe(shipped_texts(200), TINY_SPECIAL_IDS)


def processor_video_text(grid, indices, video_fps) -> str:
    """Qwen3VLProcessor.replace_video_token's text for one video (the processor without its tokenizer
    and video processor: only the attributes that method reads)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    proc = types.SimpleNamespace(
        video_processor=types.SimpleNamespace(merge_size=2, temporal_patch_size=2),
        vision_start_token=VS,
        vision_end_token=VE,
        video_token=VPAD,
        _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a),
    )
    inputs = {
        "video_grid_thw": torch.tensor([grid]),
        "video_metadata": [types.SimpleNamespace(fps=video_fps, frames_indices=indices)],
    }
    return Qwen3VLProcessor.replace_video_token(proc, inputs, 0)


def video_span(grid, indices, video_fps):
    from moevlm.data.text import VideoSpan

    t, h, w = grid
    return VideoSpan(tuple(frame_timestamps(indices, video_fps)), h * w // 4)


def test_video_prompt_equals_processor_text(tok):
    from moevlm.data.text import ChatEncoder

    cfg = VideoConfig()
    i1, i2 = sample_frame_indices(100, 29.97, cfg), sample_frame_indices(300, 25.0, cfg)
    assert (len(i1), len(i2)) == (6, 24)
    i1 = i1[:5]  # an odd count: the last temporal patch repeats its frame
    v1, v2 = (i1, 29.97, (3, 4, 6)), (i2, 25.0, (12, 2, 2))
    chat = [
        {"role": "system", "content": "You watch videos."},
        {"role": "user", "content": "Watch:<video>and this <image> then<video>\nWhich is longer?"},
        {"role": "assistant", "content": "The second."},
    ]
    texts = iter([processor_video_text(g, i, f) for i, f, g in (v1, v2)])
    rendered = ""
    for m in chat:
        content = m["content"].replace("<image>", f"{VS}{IPAD * 6}{VE}")
        content = re.sub("<video>", lambda _: next(texts), content)
        rendered += f"<|im_start|>{m['role']}\n{content}<|im_end|>\n"
    assert "Watch:<0.3 seconds><|vision_start|>" in rendered
    want = tok.encode(rendered, add_special_tokens=False).ids
    spans = [video_span(g, i, f) for i, f, g in (v1, v2)]
    ids, labels = ChatEncoder(tok).encode_chat(chat, [6], spans)
    assert ids == want
    n_vpad = sum(i == tok.token_to_id(VPAD) for i in ids)
    assert n_vpad == spans[0].tokens + spans[1].tokens == 3 * 6 + 12 * 1
    trained = tok.decode([t for t in labels if t != -100], skip_special_tokens=False)
    assert trained == "The second.<|im_end|>"


def test_video_timestamps_are_never_targets(tok):
    from moevlm.data.text import ChatEncoder, VideoSpan

    enc = ChatEncoder(tok)
    chat = [
        {"role": "user", "content": "Show me."},
        {"role": "assistant", "content": "Here it is:<video> done"},
    ]
    ids, labels = enc.encode_chat(chat, videos=[VideoSpan((0.5, 1.5), 2)])
    trained = tok.decode([t for t in labels if t != -100], skip_special_tokens=False)
    assert "seconds" not in trained and trained.startswith("Here it is") and "done" in trained


def test_video_tag_count_must_match(tok):
    from moevlm.data.errors import SkipSample
    from moevlm.data.text import ChatEncoder, VideoSpan

    chat = [{"role": "user", "content": "<video>"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(SkipSample, match="1 <video> tags in the text, 0 videos"):
        ChatEncoder(tok).encode_chat(chat)
    with pytest.raises(ValueError, match="at least one temporal patch"):
        VideoSpan((), 4)
