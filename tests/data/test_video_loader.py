"""The loader trains on video: a mixed image + video WebDataset is decoded in the workers, packed
with the video pixels and grids typed beside the images', counted per micro-batch; a video over a
row's budget is sampled down (counted), a bad one skipped by reason, and a resume continues exactly."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from data_helpers import good, small_data_config, write_tar

from moevlm.data.batch import MicroBatch
from moevlm.data.config import PackConfig, VideoConfig
from moevlm.data.encode import SampleEncoder
from moevlm.data.errors import SkipSample
from moevlm.data.loader import build_loader
from moevlm.data.reader import Pos
from moevlm.data.sample import sample_photo_paths, sample_tokenizer
from moevlm.data.sample_video import encode_clip, make_sample_clips
from moevlm.data.text import ChatEncoder
from moevlm.model import Qwen3VLMoe, VLMConfig

TINY = VLMConfig.preset("tiny")
SMALL_VIDEO = VideoConfig(min_pixels=32 * 32, max_pixels=4 * 64 * 64, fps=2.0)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    out = tmp_path_factory.mktemp("clips")
    clips = [p.read_bytes() for p in make_sample_clips(sample_photo_paths(), out)]
    photo = sample_photo_paths()[0].read_bytes()
    return clips, photo


def video_sample(key, videos, photo=None, ext="mp4"):
    names = [f"vid{i}.{ext}" for i in range(len(videos))]
    tags = " and ".join(["<video>"] * len(videos))
    rec = {
        "id": key,
        "images": ["img0.jpg"] if photo else [],
        "videos": names,
        "messages": [
            {"role": "user", "content": ("<image>\n" if photo else "") + tags + "\nWhat moves?"},
            {"role": "assistant", "content": f"The camera, in {key}."},
        ],
    }
    raw = {"__key__": key, "json": json.dumps(rec).encode(), **dict(zip(names, videos))}
    return raw | ({"img0.jpg": photo} if photo else {})


def video_config(shards, **kw):
    cfg = small_data_config(shards, **kw)
    cfg.video = SMALL_VIDEO
    cfg.pack = dataclasses.replace(cfg.pack, max_videos=2, max_video_patches=128)
    return cfg


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, media):
    """Two shards: image chats, videos alone, a video with an image, two videos (mp4 + webm), and the
    bad ones: a truncated mp4, a one-frame video, bytes that are no video."""
    clips, photo = media
    one_frame = encode_clip(np.zeros((1, 64, 64, 3), np.uint8), "mp4", fps=4)
    d = tmp_path_factory.mktemp("mixed")
    samples = [good(f"img{i}", photo, "jpg") for i in range(6)]
    samples += [video_sample(f"vid{i}", [clips[i % 4]]) for i in range(4)]
    samples += [video_sample("both", [clips[0]], photo), video_sample("two", [clips[1], clips[3]])]
    bad = [
        video_sample("cut", [clips[0][: len(clips[0]) // 2]]),
        video_sample("short", [one_frame]),
        video_sample("junk", [b"\x00" * 64]),
    ]
    samples += bad
    write_tar(d / "shard-000000.tar", samples[0::2])
    write_tar(d / "shard-000001.tar", samples[1::2])
    (d / "tokenizer.json").write_text(sample_tokenizer().to_str())
    return d, {s["__key__"] for s in samples} - {"cut", "short", "junk"}


def test_workers_decode_pack_and_count_videos(mixed):
    folder, good_ids = mixed
    loader = build_loader(video_config(folder, epochs=1, streams=2), TINY)
    seen, videos, video_tokens = [], 0, 0
    for row in loader:
        seen += row.sample_ids
        mb = MicroBatch.from_rows([row], TINY)
        assert mb.videos == row.num_videos == int((row.video_grid_thw.prod(-1) > 0).sum())
        assert mb.n_video == int((row.input_ids == TINY.video_token_id).sum())
        assert mb.pixel_values_videos.shape == (128, 1536) and mb.video_grid_thw.shape == (2, 3)
        videos, video_tokens = videos + mb.videos, video_tokens + mb.n_video
    stats = loader.stats()
    assert sorted(seen) == sorted(good_ids)  # nothing lost, nothing twice
    assert videos == 7 and video_tokens > 0
    skipped = stats["skipped"]
    assert skipped["video_too_short"] == 1 and skipped["not_a_video"] == 1
    assert skipped.get("video_truncated", 0) + skipped.get("bad_video", 0) == 1, skipped


def test_the_model_trains_on_a_video_micro_batch(mixed):
    folder, _ = mixed
    cfg = video_config(folder, num_workers=0, streams=1, shuffle_buffer=0)
    rows = iter(build_loader(cfg, TINY))
    mb = next(r for r in (MicroBatch.from_rows([next(rows)], TINY) for _ in range(20)) if r.videos)
    torch.manual_seed(0)
    out = Qwen3VLMoe(TINY)(**mb.model_inputs())
    assert torch.isfinite(out.loss) and out.num_loss_tokens == mb.loss_tokens


def encoder(pack, fit="frames"):
    video = dataclasses.replace(SMALL_VIDEO, max_pixels=16 * 64 * 64, fit=fit)
    return SampleEncoder(
        ChatEncoder(sample_tokenizer()), small_data_config("x").image, pack, video=video
    )


@pytest.mark.parametrize("fit", ["frames", "resolution"])
def test_a_video_over_the_budget_is_sampled_down_and_counted(media, fit):
    clips, photo = media
    raw = video_sample("long", [clips[0], clips[2]], photo)
    roomy = encoder(PackConfig(seq_len=1024, max_patches=64, max_videos=2, max_video_patches=1024))
    full = roomy(raw, Pos(0, 0, 0))
    assert full.fallbacks == [] and full.video_patches > 48
    tight = encoder(
        PackConfig(seq_len=1024, max_patches=64, max_videos=2, max_video_patches=48), fit
    )
    s = tight(raw, Pos(0, 0, 0))
    assert 0 < s.video_patches <= 48 and len(s.video_grids) == 2
    first = {"frames": "video_fewer_frames", "resolution": "video_lower_resolution"}[fit]
    assert s.fallbacks[0] == first
    if fit == "frames":  # fewer frames at the first video's size, as far as that goes
        assert s.video_grids[0][0] < full.video_grids[0][0]
    assert int((s.input_ids_L == TINY.video_token_id).sum()) == s.video_patches // 4
    with pytest.raises(SkipSample, match="too_long"):
        encoder(
            PackConfig(seq_len=1024, max_patches=64, max_videos=2, max_video_patches=48), "skip"
        )(raw, Pos(0, 0, 0))


def test_videos_off_is_a_counted_skip(media):
    clips, _ = media
    with pytest.raises(SkipSample) as e:
        encoder(PackConfig(seq_len=512, max_patches=64))(
            video_sample("v", [clips[0]]), Pos(0, 0, 0)
        )
    assert e.value.reason == "videos_off"


def test_resume_with_videos_continues_exactly(mixed):
    folder, _ = mixed
    cfg = video_config(folder, streams=2, num_workers=1, shuffle_buffer=4)
    first = build_loader(cfg, TINY)
    [next(first) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    expected = [next(first) for _ in range(6)]
    resumed = build_loader(cfg, TINY)
    resumed.load_state_dict(state)
    for a, b in zip([next(resumed) for _ in range(6)], expected):
        assert a.sample_ids == b.sample_ids
        assert torch.equal(a.pixel_values_videos, b.pixel_values_videos)
        assert torch.equal(a.video_grid_thw, b.video_grid_thw)


@pytest.mark.slow
def test_training_on_a_mixed_webdataset_with_defaults_reports_videos(mixed, tmp_path):
    """`python train.py data.shards=DIR` on image + video shards: every step's record (metrics.jsonl) and
    console line count the videos and video tokens trained on; the end-of-run line names the videos."""
    import contextlib
    import io

    from moevlm.config import compose_job
    from moevlm.train.trainer import Trainer

    folder, _ = mixed
    job = compose_job(
        [f"data.shards={folder}", "train.steps=4", f"train.run_dir={tmp_path}", "train.log_every=1"]
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        assert Trainer(job).run() == 0
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("videos" in r and "video_tokens" in r for r in recs)
    assert sum(r["videos"] for r in recs) > 0 and sum(r["video_tokens"] for r in recs) > 0
    assert all((r["videos"] > 0) == (r["video_tokens"] > 0) for r in recs)
    text = out.getvalue()
    assert " vid " in text and "videos" in text, text[-2000:]
