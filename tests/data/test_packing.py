"""Packer, collate and stack_rows: hand-worked first-fit, fixed shapes, and a
packed row (or a stack of rows) through the tiny model equal to its parts run
one by one."""

import dataclasses

import pytest
import torch
from data_helpers import small_data_config
from PIL import Image

from moevlm.data import packing
from moevlm.data.config import PackConfig
from moevlm.data.encode import Sample
from moevlm.data.image import preprocess_image
from moevlm.data.loader import build_loader
from moevlm.data.packing import Packer, VisionFlops, collate, stack_rows, vision_budget
from moevlm.data.sample import sample_photo_paths
from moevlm.data.text import IGNORE_INDEX as IGNORE
from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model.rope import mrope_position_ids, vision_cu_seqlens

D = 3 * 2 * 16 * 16


def fake(sid, tokens, patches=0, images=0):
    ids = torch.arange(tokens) % 1000
    pix = torch.full((patches, D), float(len(sid))) if patches else None
    grids = [(1, 2, patches // (2 * images))] * images if images else []
    return Sample(
        sid, (0, 0, 0), ids, ids.clone(), torch.stack([torch.arange(tokens)] * 3), pix, grids
    )


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
    batches = [
        collate([a, b], cfg, D, pad_id=5),
        collate([fake("c", 3, 16, 2)], cfg, D, pad_id=5),
        collate([], cfg, D, 5),
    ]
    shapes = {k: tuple(v.shape) for k, v in batches[0].items() if torch.is_tensor(v)}
    for bt in batches[1:]:
        assert {k: tuple(v.shape) for k, v in bt.items() if torch.is_tensor(v)} == shapes
    assert shapes == {
        "input_ids": (1, 32),
        "labels": (1, 32),
        "position_ids": (3, 1, 32),
        "cu_seqlens": (6,),
        "pixel_values": (24, D),
        "image_grid_thw": (3, 3),
    }
    bt = batches[0]
    assert bt["cu_seqlens"].tolist() == [0, 10, 17, 32, 32, 32]
    assert vision_cu_seqlens(bt["image_grid_thw"]).tolist() == [0, 8]  # the vision tower's segments
    assert bt["image_grid_thw"].tolist() == [[1, 2, 4], [0, 0, 0], [0, 0, 0]]
    assert (
        torch.equal(bt["input_ids"][0, :10], a.input_ids_L) and (bt["input_ids"][0, 17:] == 5).all()
    )
    assert (bt["labels"][0, 17:] == IGNORE).all()
    assert bt["position_ids"][0, 0, 17:].tolist() == list(range(15))
    assert (bt["pixel_values"][:8] == 1).all() and (bt["pixel_values"][8:] == 0).all()
    assert (
        bt["useful_tokens"],
        bt["padded_tokens"],
        bt["useful_patches"],
        bt["padded_patches"],
    ) == (17, 15, 8, 16)
    assert bt["loss_tokens"] == 9 + 6 and bt["sample_ids"] == ["a", "bb"]
    assert vision_cu_seqlens(batches[1]["image_grid_thw"]).tolist() == [0, 8, 16]


def _photo_sample(cfg, sid, path, text_before, text_after, g):
    pix, grid = preprocess_image(Image.open(path), min_pixels=32 * 32, max_pixels=64 * 64)
    n = grid[0] * grid[1] * grid[2] // 4
    ids = torch.cat(
        [
            torch.randint(0, 1000, (text_before,), generator=g),
            torch.tensor([cfg.vision_start_token_id]),
            torch.full((n,), cfg.image_token_id),
            torch.tensor([cfg.vision_end_token_id]),
            torch.randint(0, 1000, (text_after,), generator=g),
        ]
    )
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
    samples = [
        _photo_sample(cfg, "p0", photos[0], 5, 7, g),
        fake("t", 9),
        _photo_sample(cfg, "p1", photos[1], 3, 4, g),
    ]
    pack = PackConfig(
        seq_len=samples[0].tokens + samples[2].tokens + 9 + 6,
        max_patches=48 + 24,
        max_samples=5,
        max_images=4,
    )
    bt = collate(samples, pack, D, pad_id=0)
    assert bt["padded_tokens"] == 6 and bt["padded_patches"] == 48 + 24 - bt["useful_patches"] > 0
    with torch.no_grad():
        packed = model(
            bt["input_ids"],
            bt["pixel_values"],
            bt["image_grid_thw"],
            bt["position_ids"],
            bt["cu_seqlens"],
            bt["labels"],
        )
        at, total, n_total = 0, 0.0, 0
        for s in samples:
            grid = torch.tensor(s.grids).view(-1, 3) if s.grids else None
            alone = model(s.input_ids_L[None], s.pixels_ND, grid, labels=s.labels_L[None])
            torch.testing.assert_close(
                packed.logits[0, at : at + s.tokens], alone.logits[0], rtol=1e-4, atol=1e-4
            )
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
    assert [s.id for s in p.pop()] == ["s0", "s1", "s2", "s3", "s4"] and [s.id for s in p.held] == [
        "big"
    ]


def _forward(model, bt):
    return model(
        bt["input_ids"],
        bt["pixel_values"],
        bt["image_grid_thw"],
        bt["position_ids"],
        bt["cu_seqlens"],
        bt["labels"],
    )


@pytest.fixture(scope="module")
def real_rows(sample_shards):
    """Two packed rows of the sample set that both hold images and padding patches."""
    rows = [
        r
        for _, r in zip(
            range(12),
            build_loader(small_data_config(sample_shards, num_workers=0), VLMConfig.preset("tiny")),
        )
    ]
    rows = [r for r in rows if 0 < r["num_images"] and r["padded_patches"] > 0]
    assert len(rows) >= 2
    return rows[:2]


def test_stack_rows_puts_real_patches_and_grids_first(real_rows):
    a, b = real_rows
    st = stack_rows([a, b])
    S, Np, I = a["input_ids"].shape[1], a["pixel_values"].shape[0], a["image_grid_thw"].shape[0]
    assert st["input_ids"].shape == (2, S) and st["position_ids"].shape == (3, 2, S)
    assert st["cu_seqlens"].tolist() == a["cu_seqlens"].tolist() + (b["cu_seqlens"] + S).tolist()
    pa, pb = a["useful_patches"], b["useful_patches"]
    assert torch.equal(
        st["pixel_values"][: pa + pb], torch.cat([a["pixel_values"][:pa], b["pixel_values"][:pb]])
    )
    assert st["pixel_values"].shape == (2 * Np, D) and (st["pixel_values"][pa + pb :] == 0).all()
    ia, ib = a["num_images"], b["num_images"]
    assert st["image_grid_thw"].shape == (2 * I, 3) and (st["image_grid_thw"][ia + ib :] == 0).all()
    assert torch.equal(
        st["image_grid_thw"][: ia + ib],
        torch.cat([a["image_grid_thw"][:ia], b["image_grid_thw"][:ib]]),
    )
    vcu = vision_cu_seqlens(st["image_grid_thw"]).tolist()
    assert len(vcu) == ia + ib + 1 and vcu[-1] == pa + pb
    for k in (
        "useful_tokens",
        "padded_tokens",
        "loss_tokens",
        "useful_patches",
        "padded_patches",
        "num_images",
    ):
        assert st[k] == a[k] + b[k], k
    assert st["sample_ids"] == a["sample_ids"] + b["sample_ids"]
    # one row is its own micro-batch (no copy), and equal to what stacking it would build
    assert stack_rows([a]) is a
    one = packing._stacked([a])
    assert one.keys() == a.keys()
    assert all(torch.equal(v, a[k]) if torch.is_tensor(v) else v == a[k] for k, v in one.items())


def test_stacked_rows_equal_rows_one_by_one(real_rows):
    """Two real rows in one micro-batch: the same loss sum and target count as each row alone."""
    torch.manual_seed(0)
    model = Qwen3VLMoe(VLMConfig.preset("tiny")).eval()
    with torch.no_grad():
        both = _forward(model, stack_rows(real_rows))
        alone = [_forward(model, r) for r in real_rows]
    assert (
        both.num_loss_tokens.item()
        == sum(r["loss_tokens"] for r in real_rows)
        == sum(o.num_loss_tokens.item() for o in alone)
    )
    for i, o in enumerate(alone):
        torch.testing.assert_close(both.logits[i], o.logits[0], rtol=0, atol=1e-5)
    # a sum of ~4600: fp32's default relative tolerance (1.3e-6) is a few ulps
    torch.testing.assert_close(
        both.lm_loss * both.num_loss_tokens, sum(o.lm_loss * o.num_loss_tokens for o in alone)
    )


# ------------------------------------------------------------ vision balance (pack.max_vision_flops)
TINY = VLMConfig.preset("tiny")


def image_sample(sid, tokens, *grids):
    """A sample with images of the given (t, h, w) patch grids."""
    n = sum(t * h * w for t, h, w in grids)
    ids = torch.arange(tokens) % 1000
    pix = torch.zeros(n, D) if n else None
    return Sample(
        sid, (0, 0, 0), ids, ids.clone(), torch.stack([torch.arange(tokens)] * 3), pix, list(grids)
    )


def variable_samples(n, seed=0):
    """Text-only samples and samples of 1-2 images of variable sides (2..16 patches, even)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        k = int(torch.randint(0, 3, (1,), generator=g))
        grids = [
            (
                1,
                2 * int(torch.randint(1, 9, (1,), generator=g)),
                2 * int(torch.randint(1, 9, (1,), generator=g)),
            )
            for _ in range(k)
        ]
        out.append(image_sample(f"s{i}", int(torch.randint(4, 40, (1,), generator=g)), *grids))
    return out


def pack_all(packer, samples, drain=True):
    """Rows as the loader makes them: pop while full after each push, then (with `drain`) empty the
    packer; each row beside what the packer still held after it."""
    rows = []
    for s in samples:
        packer.push(s)
        while packer.full():
            rows.append((packer.pop(), [*packer.held]))
    while drain and packer.held:
        rows.append((packer.pop(), [*packer.held]))
    return rows


def test_vision_budget_values():
    vf = VisionFlops(TINY, 256)
    assert vision_budget("off", 256, vf) is None and vision_budget("0", 256, vf) is None
    # auto: halfway between a full row of images too small for attention to count and a full row of the
    # largest images (256 patches here)
    light, heavy = 512 * vf.per_patch(), 2 * vf([(1, 16, 16)])
    assert vision_budget("auto", 512, vf) == pytest.approx((light + heavy) / 2, rel=1e-12)
    assert vision_budget("2.5e6", 256, vf) == 2.5e6 and vision_budget(3e6, 256) == 3e6
    for bad in ("-1", "much", "inf"):
        with pytest.raises(ValueError, match="max_vision_flops"):
            vision_budget(bad, 256, vf)
    # the per-patch figure is the formula's linear part: a grid's FLOPs minus its attention square
    quad = TINY.vision.depth * 4 * TINY.vision.hidden_size
    assert vf([(1, 4, 4)]) == pytest.approx(16 * vf.per_patch() + quad * 16**2, rel=1e-12)
    with pytest.raises(ValueError, match="no model"):
        Packer(PackConfig(max_vision_flops="auto"))


def vision_pack() -> PackConfig:
    """Small rows with the vision budget `auto` (the budget tests' packing)."""
    return PackConfig(
        seq_len=128,
        max_patches=512,
        max_samples=16,
        max_images=8,
        lookahead=6,
        max_vision_flops="auto",
    )


def test_vision_budget_bounds_every_row_and_first_fit_fills_toward_it():
    vf = VisionFlops(TINY, 256)
    cfg = vision_pack()
    samples = variable_samples(300)
    packer = Packer(cfg, vf)
    budget = packer.budget
    assert budget == vision_budget("auto", 512, vf)
    rows = pack_all(packer, samples)
    assert sorted(s.id for row, _ in rows for s in row) == sorted(s.id for s in samples)
    for row, left in rows:
        flops = sum(vf(s.grids) for s in row)
        assert flops <= budget  # every sample of this set fits the budget alone
        # first fit: no sample left held would have fitted on top of the row, on any budget
        for s in left:
            assert (
                sum(x.tokens for x in row) + s.tokens > cfg.seq_len
                or sum(x.patches for x in row) + s.patches > cfg.max_patches
                or sum(len(x.grids) for x in row) + len(s.grids) > cfg.max_images
                or len(row) + 1 > cfg.max_samples
                or flops + vf(s.grids) > budget
            )
    assert packer.over_budget == 0
    # the budget binds: without it some rows carry more vision work than it allows
    plain = pack_all(Packer(dataclasses.replace(cfg, max_vision_flops="off"), vf), samples)
    assert max(sum(vf(s.grids) for s in row) for row, _ in plain) > budget


def test_hand_worked_vision_budget_closes_a_row():
    vf = VisionFlops(TINY, 256)
    a, b, c = (image_sample(n, 4, (1, 8, 8)) for n in "abc")  # 64 patches each
    text = image_sample("t", 4)
    # room for two of the three images' vision work, though the patches would take all three
    budget = 2 * vf(a.grids) + vf(a.grids) / 2
    p = Packer(
        PackConfig(seq_len=64, max_patches=256, lookahead=4, max_vision_flops=str(budget)), vf
    )
    for s in (a, b, c, text):
        p.push(s)
    assert p.full()  # only the vision budget overflows
    assert [s.id for s in p.pop()] == ["a", "b", "t"] and [s.id for s in p.held] == ["c"]


def test_sample_over_the_vision_budget_goes_alone_and_is_counted():
    vf = VisionFlops(TINY, 256)
    big = image_sample("big", 8, (1, 16, 16))
    small, text = image_sample("small", 4, (1, 2, 2)), image_sample("text", 4)
    budget = vf(big.grids) / 2  # the big image alone is over it; it still fits the patch budget
    p = Packer(
        PackConfig(seq_len=64, max_patches=512, lookahead=3, max_vision_flops=str(budget)), vf
    )
    for s in (big, small, text):
        p.push(s)
    assert p.full()
    assert [s.id for s in p.pop()] == ["big"]  # alone: not even the text-only sample joins it
    assert p.over_budget == 1 and [s.id for s in p.held] == ["small", "text"]
    assert [s.id for s in p.pop()] == ["small", "text"] and p.over_budget == 1


def test_vision_budget_is_deterministic_and_resumes_from_the_held_samples():
    """The same samples pack the same rows; a packer rebuilt from the held samples alone (what the
    loader's state keeps) packs what follows exactly as the uninterrupted one."""
    vf = VisionFlops(TINY, 256)
    cfg = vision_pack()
    samples = variable_samples(200, seed=3)

    def ids(rows):
        return [[s.id for s in row] for row, _ in rows]

    whole = ids(pack_all(Packer(cfg, vf), samples))
    assert whole == ids(pack_all(Packer(cfg, vf), samples))
    first = Packer(cfg, vf)
    head = ids(pack_all(first, samples[:97], drain=False))
    resumed = Packer(cfg, vf)
    for s in first.held:
        resumed.push(s)
    assert head + ids(pack_all(resumed, samples[97:])) == whole


def test_a_packed_row_reads_by_attribute_and_as_a_mapping_of_its_fields():
    """The row is a typed PackedRow; scripts that read it by name (row["input_ids"]) keep working."""
    cfg = PackConfig(seq_len=32, max_patches=16, max_samples=4, max_images=2, lookahead=1)
    row = collate([fake("a", 10, 4, 1)], cfg, D, pad_id=5)
    assert row["input_ids"] is row.input_ids and row.num_samples == row["num_samples"] == 1
    assert set(row) == set(row.keys()) >= {"input_ids", "labels", "sample_ids", "loss_tokens"}
    assert "state" not in row and "end" not in row  # no control values inside a row
    with pytest.raises(KeyError):
        row["state"]
