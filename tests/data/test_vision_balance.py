"""Vision work over 4 data-parallel ranks on real photos, with and without the vision-FLOPs packing budget
(moevlm.data.vision_balance.measure: one loader per rank, in this process, each delivering the rows the
loader gives that rank).

The data are the sample set's image-text records (its captions, chats and pairs over the packaged photos,
no text-only documents: `build_sample(images_only=True)`), resized within the default bounds of
data.image (256x256 to 1024x1024 pixels), so their patch grids run from 256 to 4096 patches and
attention's square makes a patch of a large photo up to 1.5 times the work of a small one's.  One row
per rank per step (a micro-batch: FSDP and expert parallelism make the ranks wait for each other at
every one).  The loader runs with data.mock=random_pixels, which keeps every image's
real size, grid and tokens and skips only the decode (the figures depend on the grids alone).
bench/vision_balance.py (docs/benchmarks.md) is the same measurement on decoded photos, over more steps
and layouts.
"""

import pytest

from moevlm.data.build_shards import build_sample
from moevlm.data.config import DataConfig, ImageConfig, PackConfig
from moevlm.data.vision_balance import max_over_mean, measure
from moevlm.model import VLMConfig

# 4 loaders x 8 steps x 2 budgets on a freshly built set: left out of the fast tier (`-m "not slow"`)
pytestmark = pytest.mark.slow

DP, STEPS, ROWS = 4, 8, 1


def model():
    """The tiny preset's text side (the sample tokenizer's ids) with Qwen3-VL-30B-A3B's vision tower."""
    m = VLMConfig.preset("tiny")
    m.vision = VLMConfig.preset("qwen3_vl_30b_a3b").vision
    return m


def config(shards, budget: str) -> DataConfig:
    return DataConfig(
        shards=str(shards),
        image=ImageConfig(),
        pack=PackConfig(seq_len=4096, max_patches=8192, lookahead=16, max_vision_flops=budget),
        num_workers=0,
        mock="random_pixels",
    )


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    shards = tmp_path_factory.mktemp("image_text") / "shards"
    summary = build_sample(shards, progress=False, images_only=True)
    assert summary["kinds"]["text"] == 0 and summary["images"] >= 40
    m = model()
    out = {
        b: measure(config(shards, b), m, dp=DP, steps=STEPS, rows_per_step=ROWS)
        for b in ("off", "auto")
    }
    for b, r in out.items():
        print(
            f"max_vision_flops={b}: max/mean {r['max_over_mean']:.3f} (worst micro-batch "
            f"{r['worst_micro']:.3f}), "
            f"token fill {r['token_fill']:.3f}, patch fill {r['patch_fill']:.3f}, "
            f"rows over the budget alone {r['over_budget_rows']}"
        )
    return out


def test_resolutions_vary_and_the_figure_is_the_trainers_definition(measured):
    before = measured["off"]
    images = [n for _, n in before["row_forward"]]
    assert sum(images) > DP * STEPS  # the rows did carry images
    # variable resolution: the rows' mean vision work per image differs
    per_image = {round(f / n) for f, n in before["row_forward"] if n}
    assert len(per_image) > 1
    micro = before["per_micro"]
    assert len(micro) == STEPS * ROWS and all(len(s) == DP for s in micro)
    assert before["max_over_mean"] == pytest.approx(
        sum(max(s) for s in micro) / sum(sum(s) / DP for s in micro), rel=1e-12
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


def test_target_balance_under_1_1_within_5_points_of_fill(measured):
    before, after = measured["off"], measured["auto"]
    assert before["max_over_mean"] > 1.08  # the straggler is there without the rule
    assert after["max_over_mean"] < 1.1
    # the budget takes away at least a third of what the slowest rank adds
    assert after["max_over_mean"] - 1 < (before["max_over_mean"] - 1) * 2 / 3
    assert after["token_fill"] >= before["token_fill"] - 0.05
    assert after["patch_fill"] >= before["patch_fill"] - 0.05
