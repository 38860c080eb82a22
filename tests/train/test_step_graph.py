"""train.cuda_graph=step on the CPU: what it refuses (every reason at once), the step a capture would
record run eagerly over the static buffers equals the plain step bit for bit (text rows and image
rows; on two gloo ranks under FSDP2, HSDP and DDP), images laid out on the host give the plain forward's loss and gradients bit for bit with one
sequence of ops and shapes whatever the images, and the inputs as a captured step passes them read
nothing from the device and copy nothing to it (fake CUDA, real size).  The capture itself is
tests/gpu/test_step_graph_cuda.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moevlm.config import compose_job, validate
from moevlm.errors import ConfigError
from moevlm.model import Qwen3VLMoe
from moevlm.model.vision import VisionLayout
from moevlm.parallel.compile import use_static_masks
from moevlm.parallel.data_parallel import local_tensor
from moevlm.plan.dry_run import forward_on_fake_cuda
from moevlm.plan.fake import _leaves
from moevlm.plan.syncs import SyncCounter, SyncError
from moevlm.plan.syncs import _device as device_of
from moevlm.train.step_graph import StepGraph, host_inputs
from moevlm.train.trainer import Trainer

# text rows (images dropped from the sample set's samples, their text kept)
TEXT = ["data.pack.max_patches=0", "data.pack.max_videos=0", "data.pack.oversize=truncate"]
IMAGES = ["data.pack.max_videos=0"]  # text and image rows (the sample set's videos left out)
VIDEOS = ["data.pack.max_patches=0", "data.pack.oversize=truncate"]  # text and video rows
FAST = ["data.num_workers=1", "data.streams=1", "train.log_every=1"]


def _refused(args: list[str], world: int = 1) -> str:
    with pytest.raises(ConfigError) as err:
        validate(compose_job(["data.shards=sample", "train.cuda_graph=step", *args]), world, False)
    return str(err.value)


def test_every_refusal_is_one_line_with_its_reason():
    lines = _refused(
        [
            "model.cuda_graph_scope=[moe_router]",
            "train.profile_components=true",
            "optim.state_dtype=bfloat16",
        ]
    ).splitlines()
    found = [line for line in lines if line.startswith("train.cuda_graph=step")]
    assert len(found) == 4, lines
    for words in (
        "images or with videos",
        "model.cuda_graph_scope=[]",
        "profile_components",
        "AdamW",
    ):
        assert any(words in line for line in found), (words, found)
    text = "\n".join(
        [
            _refused([*TEXT, "parallel.pp=2", "model.num_layers=4"], world=2),
            _refused([*TEXT, "parallel.ep=2"], world=2),
            _refused([*TEXT, "parallel.cp=2"], world=2),
        ]
    )
    for words in ("pipeline schedule", "expert all-to-all", "context parallel"):
        assert words in text, (words, text)
    assert "CUDA device" in str(_cpu_refusal())
    # text rows, with images or with videos, on one process: accepted (the device check aside)
    for rows in (TEXT, IMAGES, VIDEOS):
        validate(compose_job(["data.shards=sample", "train.cuda_graph=step", *rows]), 1, False)


def _cpu_refusal() -> ConfigError:
    with pytest.raises(ConfigError) as err:
        validate(compose_job(["data.shards=sample", "train.cuda_graph=step", *TEXT]), 1)
    return err.value


def _plain_equals_graphed(tmp_path, rows=TEXT, extra=(), what: str = "") -> Trainer:
    """The plain run, then the run over the static buffers (one eager step, three replays): every
    step's loss (four, each step its own data) and every final weight (on ranks: this rank's shard)
    bit for bit.  Returns the graphed trainer, open."""
    plain, w_plain, first = _run(tmp_path, "plain", graphed=False, rows=rows, extra=extra)
    first.close()
    graphed, w_graph, trainer = _run(tmp_path, "graphed", graphed=True, rows=rows, extra=extra)
    assert len(plain) == 4 and len(set(plain)) == 4, (what, plain)
    assert graphed == plain, (what, graphed, plain)
    assert w_graph.keys() == w_plain.keys()
    differ = [k for k in w_plain if not torch.equal(w_graph[k], w_plain[k])]
    assert not differ, (what, differ[:5])
    g = trainer.step_graph
    assert (g.eager_steps, g.replays, g.captured) == (1, 3, True), what
    return trainer


def _run(
    tmp_path, name: str, graphed: bool, rows=TEXT, extra=()
) -> tuple[list[float], dict, Trainer]:
    job = compose_job(
        ["data.shards=sample", *rows, *FAST, "train.steps=4", "train.global_batch_size=2"]
        + [f"train.run_dir={tmp_path / name}", "train.checkpoint_at_end=false"]
        + ["train.require_loss_decrease=false", *extra]
    )
    trainer = Trainer(job)
    use_static_masks(trainer.model)  # both runs: the masks a captured step builds
    if graphed:  # what train.cuda_graph=step builds on CUDA, recording nothing here
        trainer.step_graph = StepGraph(
            trainer._step_gradients, trainer.opt, trainer.plan.model, trainer.device, 1, False
        )
        buffers = []
        step = trainer.train_step

        def spy(window):
            ok = step(window)
            buffers.append(trainer.step_graph.static)
            return ok

        trainer.train_step = spy
    assert trainer.run() == 0
    if graphed:
        assert buffers[0] is None and all(b is buffers[1] for b in buffers[1:])
    losses = list(trainer.losses)  # on ranks: rank 0 logs them
    if trainer.launch.rank == 0:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses = [json.loads(line)["loss"] for line in lines]
    weights = {k: local_tensor(v).clone() for k, v in trainer.model.state_dict().items()}
    return losses, weights, trainer


@pytest.mark.slow
@pytest.mark.parametrize("rows", [TEXT, IMAGES, VIDEOS], ids=["text", "images", "videos"])
def test_the_step_over_static_buffers_equals_the_plain_step(tmp_path, rows):
    """One eager warm-up step, then three over the same buffers (the copies a replay reads; image
    rows: their layout too): every step's loss and the final weights bit for bit; the gradients stay
    (the graph would rewrite them)."""
    trainer = _plain_equals_graphed(tmp_path, rows=rows)
    g = trainer.step_graph
    held = [n for n, p in trainer.model.named_parameters() if p.grad is not None]
    towers = ("text.", "lm_head.") + (("vision.",) if rows is not TEXT else ())
    assert len(held) > 10 and all(n.startswith(towers) for n in held), held
    if rows is not TEXT:  # the tower trained, and its layout was a static buffer refilled each step
        assert any(n.startswith("vision.") for n in held)
        assert isinstance(g.static[0]["vision_layout"], VisionLayout)
    # a micro-batch of another layout is refused by name, not replayed
    mb = trainer._micro_batch()
    with pytest.raises(RuntimeError, match="input_ids is .* torch.int32, captured as"):
        g.gradients([dataclasses.replace(mb, input_ids=mb.input_ids.int())] * 2, 1.0)
    trainer.close()


# data parallel in the step: FSDP2 with selective recompute (its all-gathers and reduce-scatters in the
# forward and backward, the attention cores run again in the backward),
# HSDP (the replicas' all-reduce too) and DDP (GradSync's bucketed all-reduce), each rank 1 row a step
DP2 = {
    "fsdp-selective": ["parallel.dp_mode=fsdp", "model.recompute=selective"],
    "hsdp": ["parallel.dp_mode=fsdp", "parallel.dp_replicate=2"],
    "ddp": ["parallel.dp_mode=ddp"],
}
ON_RANKS = ["data.num_workers=0", "data.streams=2"]


def _dp2_on_ranks(rank: int, tmp: str) -> None:
    import os
    from pathlib import Path

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    for mode, extra in DP2.items():
        what = f"{mode}, rank {rank}"
        _plain_equals_graphed(Path(tmp) / mode, extra=[*extra, *ON_RANKS], what=what).close()


@pytest.mark.slow
def test_the_step_over_static_buffers_equals_the_plain_step_under_fsdp_hsdp_and_ddp(tmp_path):
    """Two gloo ranks, FSDP2, HSDP and DDP: one eager warm-up step then three over the static buffers
    (the data-parallel reductions inside what a capture records; FSDP2 with selective recompute), each
    rank's losses and its shard of the final weights bit for bit those of the plain step; nothing
    refuses these layouts."""
    from gloo_ranks import run_ranks

    for extra in DP2.values():
        validate(
            compose_job(["data.shards=sample", "train.cuda_graph=step", *TEXT, *extra]), 2, False
        )
    run_ranks(_dp2_on_ranks, 2, tmp_path, str(tmp_path), timeout_s=600)


class Uploads(TorchDispatchMode):
    """The host-to-device copies of the ops below it (fake CUDA): a captured step's copies replay
    from the host memory of the step they were captured in, so its forward must make none."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src, dst = (
                (args[1], args[0]) if func is torch.ops.aten.copy_.default else (args[0], out)
            )
            if device_of(src).type == "cpu" and device_of(dst).type != "cpu":
                self.found.append((str(func), tuple(src.shape)))
        return out


def test_the_captured_inputs_read_nothing_at_real_size(monkeypatch):
    """h100_1gpu's text rows, then its image rows, at its real widths (4 decoder layers; the tower's
    first 9 blocks, the first deepstack tap's) on fake CUDA: the forward as a captured step calls it
    reads nothing from the device and copies nothing to it (the images' layout is a static buffer;
    the plain forward copies it up, which the check sees); without `inputs_checked` the input check
    would read the device's cu_seqlens, named by its line."""
    job = compose_job(["+experiment=h100_1gpu", "data.shards=sample", *TEXT, "model.num_layers=4"])
    forward_on_fake_cuda(job, watch=SyncCounter("cuda", strict=True), captured=True)
    images = compose_job(
        ["+experiment=h100_1gpu", "data.shards=sample", *IMAGES]
        + ["model.num_layers=4", "model.vision_depth=9"]
    )
    forward_on_fake_cuda(images, watch=SyncCounter("cuda", strict=True), captured=True)
    for captured in (True, False):
        uploads = Uploads()
        forward_on_fake_cuda(images, watch=uploads, captured=captured)
        assert bool(uploads.found) != captured, uploads.found
    forward = Qwen3VLMoe.forward
    monkeypatch.setattr(
        Qwen3VLMoe, "forward", lambda self, **kw: forward(self, **{**kw, "inputs_checked": False})
    )
    with pytest.raises(SyncError, match=r"vlm\.py:\d+ \(in check_inputs\)"):
        forward_on_fake_cuda(job, watch=SyncCounter("cuda", strict=True), captured=True)


class OpShapes(TorchDispatchMode):
    """Each op below it with its outputs' shapes: what a CUDA graph would record."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = tuple(tuple(t.shape) for t in _leaves(out) if isinstance(t, torch.Tensor))
        self.ops.append((str(func), shapes))
        return out


@pytest.mark.parametrize("rows", [IMAGES, VIDEOS], ids=["images", "videos"])
def test_laid_out_images_equal_the_plain_forward_with_one_sequence_of_shapes(tmp_path, rows):
    """The tiny model on micro-batches of the sample set holding 0, 1 and 2 images (then videos): laid
    out on the host (`vision_layout`, as a captured step passes them) the loss and every gradient
    equal the plain forward's bit for bit, and forward and backward run the same ops on the same
    shapes for every micro-batch (one graph replays them all); the plain forward's shapes follow
    the images."""
    job = compose_job(
        ["data.shards=sample", *rows, "data.num_workers=0", "data.streams=1"]
        + [f"train.run_dir={tmp_path}", "train.checkpoint_at_end=false"]
    )
    trainer = Trainer(job)
    model = trainer.model
    use_static_masks(model)
    picked: dict[int, object] = {}  # a micro-batch per count of images (videos): 0, 1 and 2
    for _ in range(40):
        mb = trainer._micro_batch()
        picked.setdefault(mb.images if rows is IMAGES else mb.videos, mb)
        if len(picked) == 3:
            break
    assert sorted(picked) == [0, 1, 2], sorted(picked)
    traces: dict[bool, list] = {False: [], True: []}
    for mb in picked.values():
        found = {}
        for laid_out in (False, True):
            model.zero_grad(set_to_none=True)
            kwargs = mb.forward_kwargs()
            if laid_out:
                kwargs = host_inputs(mb, model.config)
            with OpShapes() as ops:
                out = model(**kwargs)
                out.loss.backward()
            traces[laid_out].append(ops.ops)
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            found[laid_out] = (out.loss.detach(), grads)
        (plain, g_plain), (laid, g_laid) = found[False], found[True]
        assert torch.equal(plain, laid) and g_plain.keys() == g_laid.keys()
        assert any(n.startswith("vision.") for n in g_laid)
        assert all(torch.equal(g_plain[n], g_laid[n]) for n in g_plain), (mb.images, mb.videos)
    assert all(t == traces[True][0] for t in traces[True])
    assert any(t != traces[False][0] for t in traces[False])
