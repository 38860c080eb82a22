"""Video rows under every layout equal one process, and a trainer step counts their FLOPs.

fp32, the tiny model with 4 layers and deepstack on layers 0 and 1; two one-row micro-batches built by
hand (as tests/model/test_video_parity.py builds inputs): an image and two videos in two documents, and
an image beside a text-only document.  Each layout runs them as the trainer does and gives one
process's loss and every gathered gradient to 1e-5: dp2 FSDP (only rank 0 draws videos), cp2 (images
and video frames shared over the cp ranks), tp2, pp2 (split [1, 3]: stage 0 embeds the videos, the
deepstack rows padded to the image + video budgets cross; validation's forward-only path too).
`video_rows_under_layouts` runs in test_layouts.py's world-2 launch of hand-built models (no launch of
its own).  In one process: a Trainer step counts the videos' vision FLOPs (hence MFU).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moevlm.data.batch import MicroBatch
from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model.flops import count_flops
from moevlm.model.rope import mrope_position_ids
from moevlm.parallel import ParallelDims, build_model, full_grads, init_parameters_, materialize_
from moevlm.parallel.build import BuildOptions
from moevlm.parallel.pipeline_split import split_pipeline

TOL = 1e-5
S, NP, NV = 64, 32, 64  # a row's tokens, image patch budget, video patch budget
ROWS = [  # documents of each row: (kind, grid) items between text
    [[("image", (1, 4, 4)), ("video", (2, 4, 4))], [("video", (1, 4, 6))]],
    [[("image", (1, 4, 6))], []],
]
LAYOUTS = {  # name: (dims over 2 ranks, options, this rank's micro-batches: all or its own)
    "dp2 fsdp": (dict(), "fsdp", "own"),
    "cp2": (dict(cp=2), "ddp", "all"),
    "tp2": (dict(tp=2), "ddp", "all"),
    "pp2": (dict(pp=2), "ddp", "all"),
}


def video_config() -> VLMConfig:
    cfg = VLMConfig.preset("tiny")
    cfg.text.num_layers, cfg.vision.deepstack_visual_indexes = 4, (0, 1)
    cfg.moe.router_aux_loss_coef, cfg.attn_backend = 0.0, "sdpa"
    return cfg


def video_micro_batch(cfg: VLMConfig, docs, seed: int) -> MicroBatch:
    """One packed row of `docs` (padded to S tokens, NP image and NV video patches) as a MicroBatch."""
    g = torch.Generator().manual_seed(seed)
    merge2 = cfg.vision.spatial_merge_size**2

    def span(token, n):
        return [cfg.vision_start_token_id, *[token] * n, cfg.vision_end_token_id]

    ids, bounds, grids = [], [0], {"image": [], "video": []}
    for doc in docs:
        ids += torch.randint(0, 900, (5,), generator=g).tolist()
        for kind, (t, h, w) in doc:
            grids[kind].append([t, h, w])
            if kind == "image":
                ids += span(cfg.image_token_id, h * w // merge2)
            else:  # per temporal patch: its timestamp text, then its tokens
                for _ in range(t):
                    ids += torch.randint(0, 900, (3,), generator=g).tolist()
                    ids += span(cfg.video_token_id, h * w // merge2)
            ids += torch.randint(0, 900, (5,), generator=g).tolist()
        bounds.append(len(ids))
    useful = len(ids)
    input_ids = torch.tensor([ids + [0] * (S - useful)])
    labels = input_ids.clone()
    labels[:, useful:] = -100

    def pixels(kind, budget):
        grid = torch.tensor(grids[kind] + [[0, 0, 0]])  # an unused row, as a packed batch has
        n = int(grid.prod(-1).sum())
        px = torch.cat(
            [
                torch.randn(n, cfg.vision.patch_dim, generator=g),
                torch.zeros(budget - n, cfg.vision.patch_dim),
            ]
        )
        return px, grid

    px, grid = pixels("image", NP)
    cu = torch.tensor([*bounds, S], dtype=torch.int32)
    vgrid = torch.tensor(grids["video"] + [[0, 0, 0]]) if grids["video"] else None
    mb = MicroBatch(
        input_ids=input_ids,
        labels=labels,
        position_ids=mrope_position_ids(
            input_ids, grid, cfg.image_token_id, 2, cu, vgrid, cfg.video_token_id
        ),
        cu_seqlens=cu,
        token_mask=torch.arange(S)[None] < useful,
        pixel_values=px,
        image_grid_thw=grid,
        loss_tokens=useful - len(docs),
        useful_tokens=useful,
        flops=count_flops(cfg, [b - a for a, b in zip(bounds, bounds[1:])], grids["image"]).total,
        n_image=int(grid.prod(-1).sum()) // merge2,
        images=len(grids["image"]),
    )
    return mb.with_videos(*pixels("video", NV), cfg) if grids["video"] else mb


def one_process(cfg: VLMConfig, micro: list[MicroBatch]) -> tuple[float, float, dict]:
    """(loss, the step's loss tokens, every gradient) of the micro-batches in one process."""
    model = Qwen3VLMoe(cfg)
    init_parameters_(model, seed=3)
    outs = [model(**mb.model_inputs()) for mb in micro]
    tokens = float(sum(o.num_loss_tokens for o in outs))
    loss = sum(o.lm_loss * o.num_loss_tokens for o in outs) / tokens
    loss.backward()
    return float(loss.detach()), tokens, {n: p.grad for n, p in model.named_parameters()}


def under_layout(cfg, name: str, micro: list[MicroBatch], tokens: float) -> tuple[float, dict]:
    """(loss, every gathered gradient) of the micro-batches under layout `name` on 2 ranks."""
    dims, dp_mode, share = LAYOUTS[name]
    rank = dist.get_rank()
    split = None
    if "pp" in dims:
        split = split_pipeline(
            cfg, pp=2, vpp=None, schedule="1f1b", layers=[1, 3], microbatches=len(micro),
            rows=1, seq_len=S, max_patches=NP, image_patches=24,
        )  # fmt: skip
    model, ctx = build_model(cfg, ParallelDims(2, **dims), BuildOptions(dp_mode, pipeline=split))
    materialize_(model, "cpu", ctx)
    init_parameters_(model, 3, ctx)
    mine = micro if share == "all" else micro[rank::2]
    if ctx.pipeline is not None:
        pipe, cpu = ctx.pipeline, torch.device("cpu")
        pipe.start(
            cpu, rows=1, seq_len=S, max_patches=NP, max_video_patches=NV, seq_shards=1,
            h_dtype=torch.float32, vision_dtype=torch.float32,
        )  # fmt: skip
        shared = pipe.share(mine if rank == 0 else None, cpu)
        lm_sum, _, _ = pipe.forward_backward(shared, tokens, 2)
        with torch.no_grad():  # validation's path (send/recv, no schedule): the same token losses
            val_sum = pipe.forward_only(shared)
        dist.all_reduce(val_sum, group=ctx.pp_group)
        group = ctx.pp_group
    else:
        lm_sum = torch.zeros(())
        for mb in mine:
            out = model(**mb.model_inputs())
            part = out.lm_loss * out.num_loss_tokens
            (part / tokens).backward()
            lm_sum = lm_sum + part.detach()
        group = ctx.loss_group
    ctx.finish_gradients()
    dist.all_reduce(lm_sum, group=group)
    if ctx.pipeline is not None:
        assert abs(float(val_sum) - float(lm_sum)) <= TOL * abs(float(lm_sum)), (val_sum, lm_sum)
    grads = full_grads(model)
    if ctx.pipeline is not None:  # each rank holds its stage's
        every = [None, None]
        dist.all_gather_object(every, grads)
        grads = {k: v for d in every for k, v in d.items()}
    return float(lm_sum) / tokens, grads


def video_rows_under_layouts(rank: int) -> dict[str, dict[str, float]]:
    """Every LAYOUTS entry against one process: max relative error of the loss and of the gradients."""
    cfg = video_config()
    micro = [video_micro_batch(cfg, docs, seed) for seed, docs in enumerate(ROWS)]
    assert micro[0].videos == 2 and micro[1].pixel_values_videos is None
    ref_loss, tokens, ref_grads = one_process(cfg, micro)
    report = {}
    for name in LAYOUTS:
        loss, grads = under_layout(cfg, name, micro, tokens)
        assert grads.keys() == ref_grads.keys(), sorted(grads.keys() ^ ref_grads.keys())
        report[name] = {
            "loss": abs(loss - ref_loss) / abs(ref_loss),
            "grads": max(_rel(grads[k], ref_grads[k]) for k in ref_grads),
        }
        assert all(v <= TOL for v in report[name].values()), (name, report[name])
    if rank == 0:
        print(
            "video rows vs one process: "
            + ", ".join(
                f"{k} loss {v['loss']:.1e} grads {v['grads']:.1e}" for k, v in report.items()
            )
        )
    return report


def test_a_trainer_step_counts_the_video_flops(tmp_path):
    """The step's FLOPs (MFU's numerator) and its vision figures are the documents', the images' and the
    videos' (every frame); without the videos they would be the video FLOPs short."""
    from moevlm.config import compose_job
    from moevlm.data.sample_cache import ensure_sample
    from moevlm.train.trainer import Trainer

    job = [f"data.shards={ensure_sample()[0]}", "data.num_workers=0", "train.global_batch_size=1"]
    tr = Trainer(compose_job([*job, f"train.run_dir={tmp_path}", "train.tensorboard=false"]))
    try:
        cfg, window = tr.plan.model, _Recorder()
        mb = video_micro_batch(cfg, ROWS[0], seed=0)
        assert tr.train_step(window, [mb])
    finally:
        tr.close()
    docs = [b - a for a, b in zip(mb.cu_seqlens.tolist(), mb.cu_seqlens.tolist()[1:-1])]
    images, videos = [(1, 4, 4)], [(2, 4, 4), (1, 4, 6)]
    want = count_flops(cfg, docs, images + videos)
    video = count_flops(cfg, [], videos).vision
    assert video > 0.2 * want.vision
    assert window.seen["flops"] == pytest.approx(want.total, rel=1e-12)
    assert window.seen["vision_max"] == pytest.approx(want.vision, rel=1e-12)
    assert window.seen["vision_mean"] == pytest.approx(want.vision, rel=1e-12)
    # under cp 2 each rank's share is whole frames (as context parallel encodes them): they add up
    shares = mb.with_videos(mb.pixel_values_videos, mb.video_grid_thw, cfg, cp=2).vision_flops_cp
    assert sum(shares) == pytest.approx(want.vision) and min(shares) > 0.3 * want.vision


class _Recorder:
    def __init__(self):
        self.seen = {}

    def add(self, **kw):
        self.seen = kw


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))
