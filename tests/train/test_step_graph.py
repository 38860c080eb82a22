"""train.cuda_graph=step on the CPU: what it refuses (every reason at once), the step a capture would
record run eagerly over the static buffers equals the plain step bit for bit, and the inputs as a
captured step passes them read nothing from the device (fake CUDA, real size).  The capture itself
is tests/gpu/test_step_graph_cuda.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moevlm.config import compose_job, validate
from moevlm.errors import ConfigError
from moevlm.model import Qwen3VLMoe
from moevlm.parallel.compile import use_static_masks
from moevlm.plan.dry_run import forward_on_fake_cuda
from moevlm.plan.syncs import SyncCounter, SyncError
from moevlm.train.step_graph import StepGraph
from moevlm.train.trainer import Trainer

# text rows (images dropped from the sample set's samples, their text kept)
TEXT = ["data.pack.max_patches=0", "data.pack.max_videos=0", "data.pack.oversize=truncate"]
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
    for words in ("text rows only", "model.cuda_graph_scope=[]", "profile_components", "AdamW"):
        assert any(words in line for line in found), (words, found)
    text = "\n".join(
        [
            _refused([*TEXT, "parallel.pp=2", "model.num_layers=4"], world=2),
            _refused([*TEXT, "parallel.ep=2"], world=2),
            _refused([*TEXT, "parallel.cp=2"], world=2),
            _refused([*TEXT, "parallel.dp_mode=ddp"], world=2),
        ]
    )
    for words in ("pipeline schedule", "expert all-to-all", "context parallel", "one process"):
        assert words in text, (words, text)
    assert "CUDA device" in str(_cpu_refusal())
    # text rows on one process: accepted (the device check aside)
    validate(compose_job(["data.shards=sample", "train.cuda_graph=step", *TEXT]), 1, False)


def _cpu_refusal() -> ConfigError:
    with pytest.raises(ConfigError) as err:
        validate(compose_job(["data.shards=sample", "train.cuda_graph=step", *TEXT]), 1)
    return err.value


def _run(tmp_path, name: str, graphed: bool) -> tuple[list[float], dict, Trainer]:
    job = compose_job(
        ["data.shards=sample", *TEXT, *FAST, "train.steps=4", "train.global_batch_size=2"]
        + [f"train.run_dir={tmp_path / name}", "train.checkpoint_at_end=false"]
        + ["train.require_loss_decrease=false"]
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
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines]
    return losses, {k: v.clone() for k, v in trainer.model.state_dict().items()}, trainer


@pytest.mark.slow
def test_the_step_over_static_buffers_equals_the_plain_step(tmp_path):
    """One eager warm-up step, then three over the same buffers (the copies a replay reads): every
    step's loss and the final weights bit for bit; the gradients stay (the graph would rewrite them)."""
    plain, w_plain, _ = _run(tmp_path, "plain", graphed=False)
    graphed, w_graph, trainer = _run(tmp_path, "graphed", graphed=True)
    assert len(plain) == 4 and len(set(plain)) == 4  # each step its own data
    assert graphed == plain
    assert w_graph.keys() == w_plain.keys()
    assert all(torch.equal(w_graph[k], w_plain[k]) for k in w_plain)
    g = trainer.step_graph
    assert (g.eager_steps, g.replays, g.captured) == (1, 3, True)
    held = [n for n, p in trainer.model.named_parameters() if p.grad is not None]
    assert len(held) > 10 and all(n.startswith(("text.", "lm_head.")) for n in held), held
    # a micro-batch of another layout is refused by name, not replayed
    mb = trainer._micro_batch()
    with pytest.raises(RuntimeError, match="input_ids is .* torch.int32, captured as"):
        g.gradients([dataclasses.replace(mb, input_ids=mb.input_ids.int())] * 2, 1.0)


def test_the_captured_inputs_read_nothing_at_real_size(monkeypatch):
    """h100_1gpu's text rows at its real widths (4 decoder layers) on fake CUDA: the forward as a
    captured step calls it reads nothing; without `inputs_checked` the input check would read the
    device's cu_seqlens, named by its line."""
    job = compose_job(["+experiment=h100_1gpu", "data.shards=sample", *TEXT, "model.num_layers=4"])
    forward_on_fake_cuda(job, watch=SyncCounter("cuda", strict=True), captured=True)
    forward = Qwen3VLMoe.forward
    monkeypatch.setattr(
        Qwen3VLMoe, "forward", lambda self, **kw: forward(self, **{**kw, "inputs_checked": False})
    )
    with pytest.raises(SyncError, match=r"vlm\.py:\d+ \(in check_inputs\)"):
        forward_on_fake_cuda(job, watch=SyncCounter("cuda", strict=True), captured=True)
