"""data.mock: image_free and random_pixels go through the same loader path as real data and give
micro-batches of exactly the same shapes and dtypes; image_free has no image, random_pixels the
real grids and tokens with other (seeded, repeatable) pixels; a wrong value and a resume across
modes are refused."""

import pytest
import torch
from data_helpers import small_data_config

from moevlm.config import compose_job, validate
from moevlm.data.loader import build_loader
from moevlm.errors import ConfigError
from moevlm.model import VLMConfig

TINY = VLMConfig.preset("tiny")
ROWS = 3


def first_rows(shards, mock: str, rows: int = ROWS):
    loader = build_loader(small_data_config(shards, mock=mock, num_workers=0), TINY)
    it = iter(loader)
    return [next(it) for _ in range(rows)], loader


def layout(batch):
    return {
        k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else type(v) for k, v in batch.items()
    }


@pytest.fixture(scope="module")
def runs(sample_shards):
    return {
        mode: first_rows(sample_shards, mode)[0] for mode in ("none", "image_free", "random_pixels")
    }


@pytest.mark.parametrize("mode", ["image_free", "random_pixels"])
def test_mock_batches_have_the_real_shapes_and_dtypes(runs, mode):
    real = runs["none"]
    assert sum(b["useful_patches"] for b in real) > 0  # the real rows hold images
    for r, m in zip(real, runs[mode]):
        assert layout(m) == layout(r)


def test_image_free_has_no_image_tokens_and_no_patches(runs):
    for b in runs["image_free"]:
        assert not (b["input_ids"] == TINY.image_token_id).any()
        assert not (b["input_ids"] == TINY.vision_start_token_id).any()
        assert b["num_images"] == b["useful_patches"] == 0
        assert not b["image_grid_thw"].any() and not b["pixel_values"].any()
        assert b["useful_tokens"] > 0


def test_random_pixels_keep_grids_and_tokens_but_not_pixels(runs, sample_shards):
    for r, m in zip(runs["none"], runs["random_pixels"]):
        for k in ("input_ids", "labels", "position_ids", "cu_seqlens", "image_grid_thw"):
            assert torch.equal(r[k], m[k]), k
        assert r["sample_ids"] == m["sample_ids"] and r["useful_patches"] == m["useful_patches"]
        if not (n := m["useful_patches"]):
            continue  # a text-only row
        assert not torch.equal(r["pixel_values"][:n], m["pixel_values"][:n])
        # uniform in [-1, 1]
        assert m["pixel_values"][:n].abs().max() <= 1.0 and m["pixel_values"][:n].std() > 0.5
        assert not m["pixel_values"][n:].any()  # padding patches stay zero
    again, _ = first_rows(sample_shards, "random_pixels")
    assert all(
        torch.equal(a["pixel_values"], b["pixel_values"])
        for a, b in zip(again, runs["random_pixels"])
    )  # seeded per sample


def test_resume_across_mock_modes_is_refused(sample_shards):
    _, mock_loader = first_rows(sample_shards, "image_free", rows=1)
    _, real_loader = first_rows(sample_shards, "none", rows=1)
    with pytest.raises(
        ValueError, match="saved with data.mock=image_free but this run has data.mock=none"
    ):
        real_loader.load_state_dict(mock_loader.state_dict())
    # real states keep the header they had before data.mock
    assert "mock" not in real_loader.state_dict()
    mock_loader.load_state_dict(mock_loader.state_dict())


def test_a_wrong_mock_value_is_a_config_error():
    with pytest.raises(
        ConfigError,
        match=r"data.mock='fake' is invalid: set it to 'none', 'image_free' or "
        r"'random_pixels'",
    ):
        validate(compose_job(["data.mock=fake"]))
