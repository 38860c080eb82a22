"""train.cuda_graph=step on one GPU: the trainer with the whole step captured (gradients graph and
optimizer graph) equals the eager trainer, step by step, on the tiny model's text rows, then its
image rows and video rows (the layout refilled each step), from the sample set; each graph is captured once and
replayed every later step.  On two GPUs (NCCL), the same under FSDP2, HSDP and DDP: the data-parallel
reductions inside the captured gradients.  Skipped without CUDA (the two-GPU test: without two).

Tolerances: fp32 losses 1e-5 relative and weights 1e-4 relative / 1e-6 absolute (the same kernels run,
captured or not; the MoE combine and the embedding backward add by atomics in no fixed order); bf16
losses 2e-2 relative (two bf16 trajectories)."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from moevlm.config import compose_job
from moevlm.parallel.compile import use_static_masks
from moevlm.parallel.data_parallel import local_tensor
from moevlm.train.trainer import Trainer

pytestmark = pytest.mark.gpu

TEXT = ["data.pack.max_patches=0", "data.pack.max_videos=0", "data.pack.oversize=truncate"]
IMAGES = ["data.pack.max_videos=0"]  # text and image rows
VIDEOS = ["data.pack.max_patches=0", "data.pack.oversize=truncate"]  # text and video rows
STEPS, WARMUP = 6, 2
# torch._grouped_mm takes bf16 only on CUDA: fp32 experts run the Triton kernel (sync-free)
FP32 = ["train.precision=fp32", "model.grouped_gemm=triton"]


def _run(tmp_path, name: str, extra: list[str], graphed: bool):
    """(losses, this rank's weights, trainer); on ranks the weights are this rank's shards."""
    job = compose_job(
        ["data.shards=sample", "data.num_workers=1", "train.device=cuda"]
        + [f"train.steps={STEPS}", "train.log_every=1", "train.global_batch_size=2"]
        + [f"train.run_dir={tmp_path / name}", "train.checkpoint_at_end=false"]
        + ["train.require_loss_decrease=false", "train.seed=3", *extra]
        + (["train.cuda_graph=step", f"train.cuda_graph_warmup={WARMUP}"] if graphed else [])
    )
    trainer = Trainer(job)
    use_static_masks(trainer.model)  # the eager run builds the masks a captured step builds
    assert trainer.run() == 0
    losses = list(trainer.losses)  # (rank 0 logs them)
    if int(os.environ.get("RANK", 0)) == 0:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses = [float(json.loads(line)["loss"]) for line in lines]
    weights = {k: local_tensor(v).float().clone() for k, v in trainer.model.state_dict().items()}
    return losses, weights, trainer


@pytest.mark.parametrize(
    "extra",
    [
        [*TEXT, *FP32],
        [*TEXT, *FP32, "model.recompute=full"],
        [*TEXT, *FP32, "optim.implementation=foreach"],
        [*TEXT, "train.precision=bf16"],
        [*TEXT, "train.precision=bf16", "train.compile=true"],
        [*IMAGES, *FP32],
        [*IMAGES, "train.precision=bf16"],
        [*VIDEOS, *FP32],
    ],
    ids=[
        "fp32",
        "fp32-recompute",
        "fp32-foreach",
        "bf16",
        "bf16-compile",
        "fp32-images",
        "bf16-images",
        "fp32-videos",
    ],
)
def test_captured_step_equals_eager(tmp_path, extra):
    _compare(tmp_path, extra)


def _compare(tmp_path, extra: list[str]) -> None:
    eager, w_eager, first = _run(tmp_path, "eager", extra, graphed=False)
    first.close()
    graphed, w_graph, trainer = _run(tmp_path, "graph", extra, graphed=True)
    g = trainer.step_graph
    print(extra, "eager", eager, "graph", graphed, g.describe())
    assert g.captured and g.update_graph is not None
    assert (g.eager_steps, g.replays) == (WARMUP, STEPS - WARMUP)
    assert len(set(eager)) == STEPS  # each step its own rows
    bf16 = "train.precision=bf16" in extra
    rel = 2e-2 if bf16 else 1e-5
    for step, (a, b) in enumerate(zip(graphed, eager), 1):
        assert abs(a - b) <= rel * abs(b), (step, a, b)
    if not bf16:
        worst = max(float((w_graph[k] - w_eager[k]).abs().max()) for k in w_eager)
        print("largest weight difference", worst)
        for k in w_eager:
            torch.testing.assert_close(w_graph[k], w_eager[k], rtol=1e-4, atol=1e-6)
    trainer.close()


# two ranks, one row each a step: FSDP2 with selective recompute (all-gathers in the forward and
# backward, reduce-scatters in the backward, the attention cores again in the backward), HSDP (and
# the replicas' all-reduce), DDP (GradSync's bucketed all-reduce after it)
DP2 = {
    "fsdp-selective": ["parallel.dp_mode=fsdp", "model.recompute=selective"],
    "hsdp": ["parallel.dp_mode=fsdp", "parallel.dp_replicate=2"],
    "ddp": ["parallel.dp_mode=ddp"],
}


def _on_gpu(rank: int, port: int, tmp: str) -> None:
    from pathlib import Path

    import torch.distributed as dist

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    # one process group for the six trainers (each would start and end its own)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for mode, extra in DP2.items():
            _compare(Path(tmp) / mode, [*TEXT, *FP32, "data.streams=2", *extra])
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_captured_step_equals_eager_under_fsdp_hsdp_and_ddp(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_on_gpu, args=(port, str(tmp_path)), nprocs=2, join=True)
