"""Video through the model against transformers (fp32, CPU, tiny random configs): the M-RoPE positions
equal get_rope_index's with one video, two videos, and videos mixed with images; the logits equal
Qwen3VLMoeForConditionalGeneration's and Qwen3_5MoeForConditionalGeneration's with one video, with
videos and images in one document, and in a packed row of documents (cu_seqlens) each compared with
transformers on that document alone.

Inputs are laid out as Qwen3VLProcessor writes a video: per temporal patch a timestamp (text),
<|vision_start|>, h*w/4 <|video_pad|>, <|vision_end|>."""

from __future__ import annotations

import pytest
import torch
from hf_ref import hf_model, qwen35_model, rel_err

from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model.rope import mrope_position_ids

pytest.importorskip("transformers.models.qwen3_5_moe")
TOL = 1e-5
ONE_VIDEO = [("video", (3, 4, 4))]
MIXED = [("image", (1, 4, 6)), ("video", (2, 4, 6)), ("video", (1, 6, 4)), ("image", (1, 4, 4))]
TWO_VIDEOS = [("video", (2, 4, 4)), ("video", (2, 6, 4))]


def sample(cfg: VLMConfig, items, text_len: int = 5, seed: int = 0):
    """(input_ids (1, S), mm_token_type_ids, pixel_values, image_grid_thw, pixel_values_videos,
    video_grid_thw) of one document: text, then each image or video, then text."""
    g = torch.Generator().manual_seed(seed)
    merge = cfg.vision.spatial_merge_size

    def text(n):
        return torch.randint(0, 1000, (n,), generator=g)

    def span(token, n):
        return [
            torch.tensor([cfg.vision_start_token_id]),
            torch.full((n,), token),
            torch.tensor([cfg.vision_end_token_id]),
        ]

    ids = [text(text_len)]
    grids = {"image": [], "video": []}
    for kind, (t, h, w) in items:
        grids[kind].append((t, h, w))
        if kind == "image":
            ids += span(cfg.image_token_id, h * w // merge**2)
        else:
            for _ in range(t):  # the timestamp text, then the temporal patch
                ids += [text(3), *span(cfg.video_token_id, h * w // merge**2)]
        ids.append(text(text_len))
    input_ids = torch.cat(ids)[None]
    types = (input_ids == cfg.image_token_id).int() + 2 * (input_ids == cfg.video_token_id).int()
    out = [input_ids, types]
    for kind in ("image", "video"):
        grid = torch.tensor(grids[kind]) if grids[kind] else None
        n = int(grid.prod(-1).sum()) if grid is not None else 0
        out += [torch.randn(n, cfg.vision.patch_dim, generator=g) if n else None, grid]
    return tuple(out)


def hf_logits(ref, doc):
    ids, types, px, grid, pxv, vgrid = doc
    kw = dict(pixel_values=px, image_grid_thw=grid, pixel_values_videos=pxv, video_grid_thw=vgrid)
    with torch.no_grad():
        return ref(input_ids=ids, mm_token_type_ids=types, **kw).logits


def our_logits(ours, doc, **kw):
    ids, _, px, grid, pxv, vgrid = doc
    with torch.no_grad():
        return ours(ids, px, grid, pixel_values_videos=pxv, video_grid_thw=vgrid, **kw).logits


def _qwen3vl():
    return VLMConfig.preset("tiny").replace(attn_backend="sdpa")


def _qwen35():
    return VLMConfig.preset("qwen3_5_tiny").replace(attn_backend="sdpa")


FAMILIES = {"qwen3_vl_moe": (_qwen3vl, hf_model), "qwen3_5_moe": (_qwen35, qwen35_model)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{family: (config, transformers model, ours loaded from its saved folder)}."""
    out = {}
    for name, (make, build) in FAMILIES.items():
        cfg, folder = make(), tmp_path_factory.mktemp(name)
        ref = build(cfg)
        ref.save_pretrained(folder)
        out[name] = (cfg, ref, Qwen3VLMoe.from_pretrained(folder, attn_backend="sdpa").eval())
    return out


@pytest.mark.parametrize("items", [ONE_VIDEO, TWO_VIDEOS, MIXED], ids=["one", "two", "mixed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_position_ids_equal_get_rope_index(models, family, items):
    cfg, ref, _ = models[family]
    docs = [sample(cfg, items, seed=s) for s in (0, 1)]
    ids = torch.cat([d[0] for d in docs])
    types = torch.cat([d[1] for d in docs])
    cat = lambda i: None if docs[0][i] is None else torch.cat([d[i] for d in docs])  # noqa: E731
    grid, vgrid = cat(3), cat(5)
    theirs, _ = ref.model.get_rope_index(
        ids, mm_token_type_ids=types, image_grid_thw=grid, video_grid_thw=vgrid
    )
    merge = cfg.vision.spatial_merge_size
    ours = mrope_position_ids(ids, grid, cfg.image_token_id, merge, None, vgrid, cfg.video_token_id)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("items", [ONE_VIDEO, MIXED], ids=["one_video", "videos_and_images"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(models, family, items):
    cfg, ref, ours = models[family]
    doc = sample(cfg, items)
    assert rel_err(our_logits(ours, doc), hf_logits(ref, doc)) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_row_with_videos_equals_transformers_on_each_document(models, family):
    """One row: a video document, a text document, videos and images mixed; the pixel tensors of
    the row with trailing padding patches and an unused grid row, as a packed batch carries them."""
    cfg, ref, ours = models[family]
    docs = [sample(cfg, items, seed=i) for i, items in enumerate((TWO_VIDEOS, [], MIXED))]
    merge = cfg.vision.spatial_merge_size
    ids = torch.cat([d[0] for d in docs], dim=1)
    bounds = torch.tensor([0, *(d[0].shape[1] for d in docs)]).cumsum(0).int()
    pad = torch.zeros(merge**2, cfg.vision.patch_dim)
    unused = torch.zeros(1, 3, dtype=torch.long)

    def packed(i):
        return torch.cat(
            [*(d[i] for d in docs if d[i] is not None), pad if i in (2, 4) else unused]
        )

    px, grid, pxv, vgrid = packed(2), packed(3), packed(4), packed(5)
    pos = mrope_position_ids(
        ids, grid, cfg.image_token_id, merge, bounds, vgrid, cfg.video_token_id
    )
    row = (ids, None, px, grid, pxv, vgrid)
    with torch.no_grad():
        alone = torch.cat([hf_logits(ref, d) for d in docs], dim=1)
    assert rel_err(our_logits(ours, row, cu_seqlens=bounds), alone) < TOL
    assert rel_err(our_logits(ours, row, cu_seqlens=bounds, position_ids=pos), alone) < TOL


def test_video_inputs_are_checked(models):
    cfg, _, ours = models["qwen3_vl_moe"]
    ids, _, _, _, pxv, vgrid = sample(cfg, ONE_VIDEO)
    with pytest.raises(ValueError, match="video_grid_thw is missing"):
        ours(ids, pixel_values_videos=pxv)
    with pytest.raises(ValueError, match="video tokens .* but no pixel_values_videos"):
        ours(ids)
    with pytest.raises(ValueError, match="pixel_values_videos has .* but video_grid_thw describes"):
        ours(ids, pixel_values_videos=pxv[:-4], video_grid_thw=vgrid)


def test_vision_flops_count_video_frames():
    from moevlm.model.flops import count_flops

    cfg = _qwen3vl()
    frame = count_flops(cfg, [], [(1, 4, 6)]).vision
    assert frame > 0 and count_flops(cfg, [], [(3, 4, 6)]).vision == pytest.approx(3 * frame)


def test_micro_batch_carries_videos_to_the_model(models):
    from moevlm.data.batch import MicroBatch
    from moevlm.model.flops import count_flops

    cfg, _, ours = models["qwen3_vl_moe"]
    ids, _, px, grid, pxv, vgrid = sample(cfg, MIXED)
    S = ids.shape[1]
    mb = MicroBatch(
        input_ids=ids,
        labels=ids.clone(),
        position_ids=mrope_position_ids(
            ids, grid, cfg.image_token_id, 2, None, vgrid, cfg.video_token_id
        ),
        cu_seqlens=torch.tensor([0, S], dtype=torch.int32),
        token_mask=torch.ones_like(ids, dtype=torch.bool),
        pixel_values=px,
        image_grid_thw=grid,
        loss_tokens=S - 1,
        useful_tokens=S,
        flops=0.0,
        n_image=int(grid.prod(-1).sum()) // 4,
        images=len(grid),
    )
    assert "pixel_values_videos" not in mb.model_inputs()
    padded = torch.cat([vgrid, torch.zeros(1, 3, dtype=torch.long)])
    mbv = mb.with_videos(pxv, padded, cfg, cp=2)
    assert (mbv.videos, mbv.n_video) == (2, int(vgrid.prod(-1).sum()) // 4)
    assert mbv.flops == pytest.approx(count_flops(cfg, [], vgrid.tolist()).vision)
    both = count_flops(cfg, [], grid.tolist() + vgrid.tolist()).vision
    assert sum(mbv.vision_flops_cp) == pytest.approx(both) and len(mbv.vision_flops_cp) == 2
    assert mbv.without_images().pixel_values_videos is None
    with torch.no_grad():
        via_batch = ours(**mbv.model_inputs()).logits
        direct = ours(ids, px, grid, pixel_values_videos=pxv, video_grid_thw=vgrid).logits
    torch.testing.assert_close(via_batch, direct, rtol=0, atol=0)


def test_loss_and_gradients_with_videos_and_images_equal_transformers(tmp_path):
    from hf_ref import hf_grads_as_ours, pair

    cfg = _qwen3vl()
    ref, ours = pair(cfg, tmp_path)
    ids, types, px, grid, pxv, vgrid = sample(cfg, MIXED)
    labels = ids.clone()
    labels[:, :3] = -100
    r = ref(
        input_ids=ids,
        mm_token_type_ids=types,
        pixel_values=px,
        image_grid_thw=grid,
        pixel_values_videos=pxv,
        video_grid_thw=vgrid,
        labels=labels,
        output_router_logits=True,
    )
    o = ours(ids, px, grid, labels=labels, pixel_values_videos=pxv, video_grid_thw=vgrid)
    assert rel_err(o.loss.detach(), r.loss.detach()) < TOL
    r.loss.backward()
    o.loss.backward()
    theirs = hf_grads_as_ours(ref, cfg)
    mine = {n: p.grad for n, p in ours.named_parameters()}
    worst = max((rel_err(mine[n], theirs[n]), n) for n in theirs if mine[n] is not None)
    assert worst[0] < TOL, worst
    assert all(mine[n] is not None for n in theirs if "deepstack" in n or "patch_embed" in n)
