"""Packer and collate: hand-worked first-fit, fixed shapes, and a packed
micro-batch through the tiny model equal to its samples run one by one."""

import pytest
import torch
from PIL import Image

from moevlm.data.config import PackConfig
from moevlm.data.packing import IGNORE, Sample
from moevlm.data.image import preprocess_image
from moevlm.data.sample import sample_photo_paths
from moevlm.data.packing import Packer, collate
from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model.rope import mrope_position_ids

D = 3 * 2 * 16 * 16


def fake(sid, tokens, patches=0, images=0):
    ids = torch.arange(tokens) % 1000
    pix = torch.full((patches, D), float(len(sid))) if patches else None
    grids = [(1, 2, patches // (2 * images))] * images if images else []
    return Sample(sid, (0, 0, 0), ids, ids.clone(), torch.stack([torch.arange(tokens)] * 3), pix, grids)


def test_first_fit_takes_oldest_then_later_fits_in_order():
    p = Packer(PackConfig(seq_len=10, max_patches=8, max_samples=3, max_images=2, lookahead=4))
    for s in (fake("a", 6), fake("b", 5), fake("c", 3, 8, 1), fake("d", 1)):
        p.push(s)
    assert p.full()
    assert [s.id for s in p.pop()] == ["a", "c", "d"]  # b (5) no longer fits after a (6)
    assert [s.id for s in p.held] == ["b"] and not p.full()
    p.push(fake("e", 2, 4, 1))
    p.push(fake("f", 2, 4, 1))
    p.push(fake("g", 2, 4, 1))
    # b, e, f fit the tokens; g would be a third image with 12 patches: held
    assert [s.id for s in p.pop()] == ["b", "e", "f"] and [s.id for s in p.held] == ["g"]


def test_max_samples_caps_documents():
    p = Packer(PackConfig(seq_len=100, max_samples=2, lookahead=3))
    for n in "xyz":
        p.push(fake(n, 1))
    assert [s.id for s in p.pop()] == ["x", "y"]


def test_collate_has_fixed_shapes_and_exact_boundaries():
    cfg = PackConfig(seq_len=32, max_patches=24, max_samples=4, max_images=3)
    a, b = fake("a", 10, 8, 1), fake("bb", 7)
    batches = [collate([a, b], cfg, D, pad_id=5), collate([fake("c", 3, 16, 2)], cfg, D, pad_id=5), collate([], cfg, D, 5)]
    shapes = {k: tuple(v.shape) for k, v in batches[0].items() if torch.is_tensor(v)}
    for bt in batches[1:]:
        assert {k: tuple(v.shape) for k, v in bt.items() if torch.is_tensor(v)} == shapes
    assert shapes == {"input_ids": (1, 32), "labels": (1, 32), "position_ids": (3, 1, 32), "cu_seqlens": (6,),
                      "pixel_values": (24, D), "image_grid_thw": (3, 3), "vision_cu_seqlens": (5,)}
    bt = batches[0]
    assert bt["cu_seqlens"].tolist() == [0, 10, 17, 32, 32, 32]
    assert bt["vision_cu_seqlens"].tolist() == [0, 8, 24, 24, 24]
    assert bt["image_grid_thw"].tolist() == [[1, 2, 4], [0, 0, 0], [0, 0, 0]]
    assert torch.equal(bt["input_ids"][0, :10], a.input_ids_L) and (bt["input_ids"][0, 17:] == 5).all()
    assert (bt["labels"][0, 17:] == IGNORE).all()
    assert bt["position_ids"][0, 0, 17:].tolist() == list(range(15))
    assert (bt["pixel_values"][:8] == 1).all() and (bt["pixel_values"][8:] == 0).all()
    assert (bt["useful_tokens"], bt["padded_tokens"], bt["useful_patches"], bt["padded_patches"]) == (17, 15, 8, 16)
    assert bt["loss_tokens"] == 9 + 6 and bt["sample_ids"] == ["a", "bb"]
    assert batches[1]["vision_cu_seqlens"].tolist() == [0, 8, 16, 24, 24]


def _photo_sample(cfg, sid, path, text_before, text_after, g):
    pix, grid = preprocess_image(Image.open(path), min_pixels=32 * 32, max_pixels=64 * 64)
    n = grid[0] * grid[1] * grid[2] // 4
    ids = torch.cat([torch.randint(0, 1000, (text_before,), generator=g), torch.tensor([cfg.vision_start_token_id]),
                     torch.full((n,), cfg.image_token_id), torch.tensor([cfg.vision_end_token_id]),
                     torch.randint(0, 1000, (text_after,), generator=g)])
    labels = ids.masked_fill(ids >= 1018, IGNORE)
    pos = mrope_position_ids(ids[None], torch.tensor([grid]), cfg.image_token_id, 2)[:, 0]
    return Sample(sid, (0, 0, 0), ids, labels, pos, pix, [grid])


def test_packed_batch_equals_samples_one_by_one():
    """Padding tokens and padding patches change nothing: each document's loss in
    the packed micro-batch equals the loss of that sample run alone."""
    torch.manual_seed(0)
    cfg = VLMConfig.preset("tiny")
    model = Qwen3VLMoe(cfg).eval()
    g = torch.Generator().manual_seed(0)
    photos = sample_photo_paths()
    samples = [_photo_sample(cfg, "p0", photos[0], 5, 7, g), fake("t", 9),
               _photo_sample(cfg, "p1", photos[1], 3, 4, g)]
    pack = PackConfig(seq_len=samples[0].tokens + samples[2].tokens + 9 + 6, max_patches=48 + 24, max_samples=5,
                      max_images=4)
    bt = collate(samples, pack, D, pad_id=0)
    assert bt["padded_tokens"] == 6 and bt["padded_patches"] == 48 + 24 - bt["useful_patches"] > 0
    with torch.no_grad():
        packed = model(bt["input_ids"], bt["pixel_values"], bt["image_grid_thw"], bt["position_ids"],
                       bt["cu_seqlens"], bt["labels"])
        at, total, n_total = 0, 0.0, 0
        for s in samples:
            grid = torch.tensor(s.grids).view(-1, 3) if s.grids else None
            alone = model(s.input_ids_L[None], s.pixels_ND, grid, labels=s.labels_L[None])
            torch.testing.assert_close(packed.logits[0, at:at + s.tokens], alone.logits[0], rtol=1e-4, atol=1e-4)
            total += alone.lm_loss.item() * alone.num_loss_tokens.item()
            n_total += alone.num_loss_tokens.item()
            at += s.tokens
    assert packed.num_loss_tokens.item() == n_total == bt["loss_tokens"]
    assert packed.lm_loss.item() == pytest.approx(total / n_total, rel=1e-5)


def test_model_rejects_padding_that_is_not_whole_merge_blocks():
    cfg = VLMConfig.preset("tiny")
    model = Qwen3VLMoe(cfg)
    ids = torch.cat([torch.zeros(3, dtype=torch.long), torch.full((1,), cfg.image_token_id)])[None]
    with pytest.raises(ValueError, match="trailing padding patches"):
        model(ids, torch.zeros(6, cfg.vision.patch_dim), torch.tensor([[1, 2, 2]]))


def test_small_samples_are_held_until_they_overflow_a_micro_batch():
    p = Packer(PackConfig(seq_len=10, lookahead=2))
    for i in range(5):
        p.push(fake(f"s{i}", 1))
        assert not p.full()  # 5 tokens would leave half the row as padding
    p.push(fake("big", 6))
    assert p.full()
    assert [s.id for s in p.pop()] == ["s0", "s1", "s2", "s3", "s4"] and [s.id for s in p.held] == ["big"]
