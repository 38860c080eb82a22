"""A plan counts video: the budget micro-batch fills `pack.max_video_patches` with one video of two
temporal patches where `pack.max_videos` > 0 (none otherwise), and the planned step's peak and FLOPs
grow with it."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from moevlm.config import compose_job, validate
from moevlm.plan.dry_run import budget_micro_batch, dry_run


def _job(*overrides):
    return OmegaConf.to_object(compose_job(["train.global_batch_size=2", *overrides]))


@pytest.mark.slow  # two dry runs
def test_the_budget_micro_batch_and_the_plan_carry_a_video():
    with_video, without = _job("data.pack.max_videos=2"), _job("data.pack.max_videos=0")
    model = validate(with_video, 1, environment=False).model
    mb = budget_micro_batch(with_video, model, rows=1)
    (t, h, w), unused = mb.video_grid_thw.tolist()
    Nv, m = with_video.data.pack.max_video_patches, model.vision.spatial_merge_size
    assert t == 2 and h == w and h % m == 0 and unused == [0, 0, 0]
    assert t * h * w <= Nv < t * (h + m) * (w + m)  # the largest such video in the budget
    assert mb.n_video == t * h * w // m**2 == int((mb.input_ids == model.video_token_id).sum())
    assert mb.pixel_values_videos.shape == (Nv, model.vision.patch_dim)
    plain = budget_micro_batch(without, model, rows=1)
    assert plain.pixel_values_videos is None and plain.flops < mb.flops
    planned = {k: dry_run(job, bf16=False) for k, job in (("video", with_video), ("none", without))}
    assert planned["video"].peak_bytes > planned["none"].peak_bytes
