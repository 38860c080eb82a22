"""MicroBatch: packed rows of the sample set -> the typed micro-batch the trainer and pipeline take."""

import pytest
import torch
from data_helpers import small_data_config

from moevlm.data.batch import MicroBatch, row_flops
from moevlm.data.loader import build_loader
from moevlm.data.packing import stack_rows
from moevlm.model import Qwen3VLMoe, VLMConfig, count_flops
from moevlm.model.objective import objective


@pytest.fixture(scope="module")
def rows(sample_shards):
    """Two packed rows that both hold images."""
    loader = build_loader(small_data_config(sample_shards, num_workers=0), VLMConfig.preset("tiny"))
    rows = [r for _, r in zip(range(12), loader) if r["num_images"] > 0]
    assert len(rows) >= 2
    return rows[:2]


def test_micro_batch_stacks_rows_and_counts_useful_work(rows):
    cfg = VLMConfig.preset("tiny")
    mb = MicroBatch.from_rows(rows, cfg)
    st = stack_rows(rows)
    for k in MicroBatch.MODEL_INPUTS[:-1]:
        assert torch.equal(getattr(mb, k), st[k]), k
    S = st["input_ids"].shape[1]
    assert mb.token_mask.tolist() == [[s < r["useful_tokens"] for s in range(S)] for r in rows]
    assert (mb.loss_tokens, mb.useful_tokens) == (st["loss_tokens"], st["useful_tokens"])
    assert mb.n_image == st["useful_patches"] // cfg.vision.spatial_merge_size**2 > 0
    cu = rows[0]["cu_seqlens"][: rows[0]["num_samples"] + 1].tolist()
    docs = [b - a for a, b in zip(cu, cu[1:])]
    want = count_flops(cfg, docs, rows[0]["image_grid_thw"][: rows[0]["num_images"]]).total
    assert row_flops(rows[0], cfg) == want and mb.flops == pytest.approx(
        sum(row_flops(r, cfg) for r in rows)
    )
    # (small_data_config turns video on: its rows carry the video fields, zero grids without videos)
    assert list(mb.model_inputs()) == list(MicroBatch.MODEL_INPUTS + MicroBatch.VIDEO_INPUTS)
    assert (
        mb.without_images().pixel_values is None and mb.without_images().input_ids is mb.input_ids
    )


def test_model_takes_the_micro_batch_and_the_objective_is_its_loss(rows):
    """The model's forward takes `model_inputs()` as they are; the objective of the whole step's one
    micro-batch (its own loss tokens, aux averaged over 1 micro-batch) is the model's own loss."""
    cfg = VLMConfig.preset("tiny")
    torch.manual_seed(0)
    model = Qwen3VLMoe(cfg)
    mb = MicroBatch.from_rows(rows, cfg).to(torch.device("cpu"))
    out = model(**mb.model_inputs())
    loss = objective(
        out.lm_loss * out.num_loss_tokens,
        out.num_loss_tokens,
        out.aux_loss,
        cfg.moe.router_aux_loss_coef,
        1,
    )
    torch.testing.assert_close(loss, out.loss, rtol=1e-6, atol=0)


def test_vision_flops_per_context_parallel_rank_are_the_shares_of_whole_images(rows):
    """`vision_flops_cp`: each cp rank's share of the micro-batch's images, as the model hands them out
    (image_shares.balance_images), counted by the FLOP formula; the shares add up to the whole."""
    from moevlm.model.image_shares import balance_images

    cfg = VLMConfig.preset("tiny")
    grids = [g for r in rows for g in r["image_grid_thw"][: r["num_images"]].tolist()]
    assert len(grids) >= 2
    whole = MicroBatch.from_rows(rows, cfg).vision_flops_cp
    assert whole == (count_flops(cfg, [], grids).vision,)
    for cp in (2, 3):
        per_rank = MicroBatch.from_rows(rows, cfg, cp=cp).vision_flops_cp
        shares = balance_images([t * h * w for t, h, w in grids], cp)
        assert per_rank == tuple(
            count_flops(cfg, [], [grids[i] for i in share]).vision for share in shares
        )
        assert sum(per_rank) == pytest.approx(whole[0], rel=1e-12)
    # frozen tower: forward only
    frozen = MicroBatch.from_rows(rows, cfg, freeze_vision=True).vision_flops_cp[0]
    assert frozen == count_flops(cfg, [], grids, freeze_vision=True).vision < whole[0]
