"""Vision work over 4 data-parallel ranks on the sample set's real photos, with and without the
vision-FLOPs packing budget (moevlm.data.vision_balance.measure: one loader per rank, in this process,
each delivering the rows the loader gives that rank).

The photos are resized between 64x64 and 512x512 pixels (smart resize), so their patch grids differ
(288..1024 patches); the loader runs with data.mock=random_pixels, which keeps every image's real size,
grid and tokens and skips only the decode (the figures depend on the grids alone).  The table of
bench/vision_balance.py (docs/benchmarks.md) is the same measurement on decoded photos, over more steps.
"""

import pytest

from moevlm.data.config import DataConfig, ImageConfig, PackConfig
from moevlm.data.vision_balance import max_over_mean, measure
from moevlm.model import VLMConfig

DP, STEPS, ROWS = 4, 4, 2


def model():
    """The tiny preset's text side (the sample tokenizer's ids) with Qwen3-VL-30B-A3B's vision tower."""
    m = VLMConfig.preset("tiny")
    m.vision = VLMConfig.preset("qwen3_vl_30b_a3b").vision
    return m


def config(budget: str) -> DataConfig:
    return DataConfig(
        shards="sample",
        image=ImageConfig(min_pixels=64 * 64, max_pixels=512 * 512),
        pack=PackConfig(
            seq_len=4096,
            max_patches=2048,
            max_samples=64,
            max_images=32,
            lookahead=32,
            max_vision_flops=budget,
        ),
        num_workers=0,
        mock="random_pixels",
    )


@pytest.fixture(scope="module")
def measured(sample_shards):
    m = model()
    out = {
        b: measure(config(b), m, dp=DP, steps=STEPS, rows_per_step=ROWS) for b in ("off", "auto")
    }
    for b, r in out.items():
        print(
            f"max_vision_flops={b}: max/mean {r['max_over_mean']:.3f} (worst step {r['worst_step']:.3f}), "
            f"token fill {r['token_fill']:.3f}, patch fill {r['patch_fill']:.3f}, "
            f"rows over the budget alone {r['over_budget_rows']}"
        )
    return out


def test_resolutions_vary_and_the_figure_is_the_trainers_definition(measured):
    before = measured["off"]
    images = [n for _, n in before["row_forward"]]
    assert sum(images) > DP  # the rows did carry images
    # variable resolution: the rows' mean vision work per image differs
    per_image = {round(f / n) for f, n in before["row_forward"] if n}
    assert len(per_image) > 1
    steps = before["per_step"]
    assert len(steps) == STEPS and all(len(s) == DP for s in steps)
    assert before["max_over_mean"] == pytest.approx(
        sum(max(s) for s in steps) / sum(sum(s) / DP for s in steps), rel=1e-12
    )
    assert max_over_mean([[0.0] * DP]) is None


def test_budget_bounds_every_row_on_real_photos(measured):
    after = measured["auto"]
    budget = after["budget"]
    assert budget and measured["off"]["budget"] is None
    over = [f for f, n in after["row_forward"] if f > budget]
    # a row over the budget is one sample alone, counted by the loader
    assert len(over) <= after["over_budget_rows"]
    # without the budget, rows do go over it: the rule changed the rows
    assert max(f for f, _ in measured["off"]["row_forward"]) > budget


@pytest.mark.xfail(
    strict=True,
    reason="not reached on the sample set: most photos resize to near max_pixels, so a row holds 2-4 "
    "large images and any cap that binds drops a whole image (docs/benchmarks.md, vision balance)",
)
def test_target_balance_under_1_1_within_5_points_of_fill(measured):
    before, after = measured["off"], measured["auto"]
    assert after["max_over_mean"] < 1.1
    assert after["token_fill"] >= before["token_fill"] - 0.05
    assert after["patch_fill"] >= before["patch_fill"] - 0.05
