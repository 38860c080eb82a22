"""A plan counts video: the budget micro-batch fills `pack.max_video_patches` with one video of two
temporal patches where `pack.max_videos` > 0 (none otherwise), and the planned step's peak and FLOPs
grow with it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from moevlm.config import compose_job, validate
from moevlm.plan import dry_run as dry_run_module
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


def test_the_budget_row_is_made_once_per_budget_and_equals_a_fresh_one():
    """A fit's dry runs of one job at several depths share one budget row (its pixels are made once):
    the micro-batch of a deeper model holds the same tensors, its FLOPs its own; another pack budget
    makes another row; a row made again from nothing equals the shared one."""
    job = _job("data.pack.max_videos=2")
    model = validate(job, 1, environment=False).model
    shallow = budget_micro_batch(job, model, rows=1)
    text = dataclasses.replace(model.text, num_layers=model.text.num_layers + 2)
    deep = budget_micro_batch(job, dataclasses.replace(model, text=text), rows=1)
    for name in ("pixel_values", "pixel_values_videos", "input_ids", "position_ids"):
        assert getattr(deep, name).data_ptr() == getattr(shallow, name).data_ptr(), name
    assert deep.flops > shallow.flops
    other = budget_micro_batch(
        _job("data.pack.max_videos=2", "data.pack.max_patches=128"), model, rows=1
    )
    assert other.pixel_values.shape[0] == 128 != shallow.pixel_values.shape[0]
    dry_run_module._LAST_ROW.clear()
    fresh = budget_micro_batch(job, model, rows=1)
    assert fresh.pixel_values.data_ptr() != shallow.pixel_values.data_ptr()
    for name, value in shallow.model_inputs().items():
        assert (value is None and getattr(fresh, name) is None) or torch.equal(
            getattr(fresh, name), value
        ), name
