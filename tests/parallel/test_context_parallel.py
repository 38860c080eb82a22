"""Context parallel trains exactly the step one process trains, on real packed rows with images.

The same machinery as test_layouts.py, and its reference runs (one process, tiny model, the embedded sample
set, fp32, AdamW, clipping, aux loss on), then each layout through the real Trainer on gloo ranks:
per-step loss, gathered gradients of every step and the parameters after the last update, each within
1e-5 relative (AdamW's eps raised as there, so that the parameters do not depend on the CPU kind).
World 2: cp2 (allgather, ring), cp2 x ep2 (all-to-all dispatch of each cp shard's tokens), cp2 with
full and with selective recompute.  World 4: cp4 (ring), cp2 x tp2 (the sequence over cp x tp),
cp2 x dp2 (FSDP2 over dp x cp), cp2 x pp2 (pipeline stages pass the cp shard), and a Gated DeltaNet
layer built by `build_model` under cp2 x tp2 (each tp rank's key heads split over cp) against the
whole layer in one process (output, input and weight gradients).  Then the job of
`train.py parallel.cp=2 parallel.tp=2` run on 4 ranks against one process.  The errors per layout go to
<tmp>/cp_w<world>.json and are printed.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from test_layouts import (
    TOL,
    UNCLIPPED_EPS,
    check_layouts,
    chunked_loss_matches_whole_logits,
    print_report,
    runs_agree,
    trainer_run_on_ranks,
    with_options,
)

from moevlm.config import compose_job, validate
from moevlm.data.sample_cache import ensure_sample
from moevlm.errors import ConfigError
from moevlm.model import VLMConfig
from moevlm.model.gated_deltanet import GatedDeltaNet
from moevlm.model.strategies import local
from moevlm.parallel import ParallelDims, build_model, materialize_
from moevlm.parallel.build import BuildOptions
from moevlm.parallel.weights import copy_full_
from moevlm.train.trainer import Trainer

WORLD_2 = [
    # with validation (test_layouts.VAL): the held-out loss summed over the cp ranks' halves
    ["parallel.cp=2", "VAL"],
    ["parallel.cp=2", "parallel.cp_comm=ring"],
    ["parallel.cp=2", "parallel.ep=2", "model.dispatcher=alltoall"],
    # recompute over the cp attention: its collectives must not be reissued out of step
    ["parallel.cp=2", "parallel.cp_comm=ring", "model.recompute=full"],
    ["parallel.cp=2", "model.recompute=selective", "model.recompute_modules=[core_attn,moe]"],
    # router balancing: documents split over the cp ranks' chunks (sequence-wise loss)
    with_options("sequence", ["parallel.cp=2"]),
    # forced routing by sequence position, the sequence in load-balanced chunks over cp 2
    with_options("forced", ["parallel.cp=2"]),
]
WORLD_4 = [
    ["parallel.cp=4", "parallel.cp_comm=ring"],
    ["parallel.cp=2", "parallel.tp=2"],
    # VISION: the logged vision figures per (dp, cp) rank too (test_layouts.check_vision_figures)
    ["parallel.cp=2", "parallel.dp_mode=fsdp", "VISION"],
    # validation through the forward-only pipeline on cp-split rows
    ["parallel.cp=2", "parallel.pp=2", "VAL"],
]


def _on_ranks(rank: int, world: int, shards: str, tmp: str, layouts: list[list[str]]):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    check_layouts(
        rank, world, shards, tmp, os.path.join(tmp, "ref.pt"), layouts, "cp", f"cp_w{world}.json"
    )
    if world == 2:  # the LM head's loss over token chunks of each cp rank's share
        chunked_loss_matches_whole_logits(
            shards, os.path.join(tmp, "cp2_chunks"), ["parallel.cp=2"]
        )
    if world == 4:  # each cp rank's share with the head vocab-parallel over tp 2
        chunked_loss_matches_whole_logits(
            shards, os.path.join(tmp, "cp4_chunks"), ["parallel.cp=2", "parallel.tp=2"]
        )
        gdn_cp2_tp2_equals_one_process()


def gdn_cp2_tp2_equals_one_process() -> dict[str, float]:
    """Layer 0 (Gated DeltaNet, 4 key heads, 8 value heads) of the Qwen3.5 tiny model laid out over cp 2
    x tp 2 (DDP): on this rank's tokens of a packed row, its output and input gradient, and its weight
    gradients summed over cp (and tp for the norm), equal the whole layer's to 1e-5."""
    cfg = VLMConfig.preset("qwen3_5_tiny")
    cfg.text.linear_num_key_heads, cfg.text.linear_num_value_heads = 4, 8
    model, ctx = build_model(cfg.validate(), ParallelDims(4, cp=2, tp=2), BuildOptions("ddp"))
    materialize_(model, "cpu", ctx)
    mine = model.text.layers[0].linear_attn
    t = cfg.text
    whole = GatedDeltaNet(
        t.hidden_size, 4, 8, t.linear_key_head_dim, t.linear_value_head_dim,
        t.linear_conv_kernel_dim, backend="torch",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for (name, p), (_, q) in zip(whole.named_parameters(), mine.named_parameters()):
            p.copy_(0.3 * torch.randn(p.shape, generator=gen) + (name == "norm.weight"))
            copy_full_(q, p)
    B, S, D = 1, 48, t.hidden_size
    x, dy = torch.randn(B, S, D, generator=gen), torch.randn(B, S, D, generator=gen)
    cu = torch.tensor([0, 7, 30, 48], dtype=torch.int32)
    x_ref = x.clone().requires_grad_()
    y_ref = whole(x_ref, cu)
    (y_ref * dy).sum().backward()
    mine.seq.begin(cu, B, S, "cpu")
    assert mine.share == (
        ctx.meshes[0]["tp"].get_local_rank() * 2 + dist.get_rank(ctx.groups["cp"]),
        4,
    )
    x_mine = mine.seq.enter(x).detach().requires_grad_()
    y = mine(x_mine, cu)
    (y * mine.seq.enter(dy)).sum().backward()
    errors = {
        "y": _rel(y, mine.seq.enter(y_ref)),
        "dx": _rel(x_mine.grad, mine.seq.enter(x_ref.grad)),
    }
    for (name, p), (_, q) in zip(whole.named_parameters(), mine.named_parameters()):
        g = local(q.grad)
        dist.all_reduce(g, group=ctx.groups["cp"])
        if name == "norm.weight":  # shared by the heads: partial over tp too
            dist.all_reduce(g, group=ctx.groups["tp"])
            want = p.grad
        else:
            want = local(distribute_like(p.grad, q))
        errors[name] = _rel(g, want)
    assert all(v <= TOL for v in errors.values()), errors
    return errors


def distribute_like(full: torch.Tensor, param) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).norm() / b.detach().norm())


@pytest.mark.slow
@pytest.mark.parametrize("world,layouts", [(2, WORLD_2), (4, WORLD_4)], ids=["world2", "world4"])
def test_context_parallel_matches_one_process(layout_references, world, layouts):
    """Against test_layouts.py's references (tests/parallel/conftest.py): the same jobs."""
    tmp, shards = layout_references
    launch = tmp / f"cp_launch_w{world}"
    launch.mkdir()
    run_ranks(_on_ranks, world, launch, world, shards, str(tmp), layouts, timeout_s=300)
    print_report(tmp / f"cp_w{world}.json", world)


@pytest.mark.slow
def test_cp2_tp2_run_matches_one_process(tmp_path, capfd):
    """`parallel.cp=2 parallel.tp=2` on 4 gloo ranks running the job as train.py does, 3 steps of the
    embedded default: logged losses and exported weights equal one process's (1e-5 relative)."""
    shards = str(ensure_sample()[0])
    common = [
        f"data.shards={shards}",
        "data.num_workers=0",
        "train.steps=3",
        "train.log_every=1",
        "train.tensorboard=false",
        "train.checkpoint_every=0",
        "train.require_loss_decrease=false",
        # not the default eps 1e-8: float32 sums run in another order on another CPU kind, and AdamW
        # with a small eps turns that noise on near-zero gradients into parameter differences above the
        # bound after 3 steps while the loss agrees to 1e-7 (test_layouts.UNCLIPPED_EPS says why 1e-5)
        "optim.warmup_steps=0",
        UNCLIPPED_EPS,
    ]
    one = Trainer(
        compose_job(
            common + [f"train.run_dir={tmp_path / 'one'}", f"train.export_hf={tmp_path / 'one_hf'}"]
        )
    )
    assert one.run() == 0
    layout = ["parallel.cp=2", "parallel.tp=2"]
    dirs = [f"train.run_dir={tmp_path / 'eight'}", f"train.export_hf={tmp_path / 'eight_hf'}"]
    (tmp_path / "launch").mkdir()
    capfd.readouterr()
    run_ranks(
        trainer_run_on_ranks, 4, tmp_path / "launch", 4, [*common, *layout, *dirs], timeout_s=300
    )
    out = "".join(capfd.readouterr())  # the ranks' stdout and stderr
    assert "world 4 = pp 1 x dp 1 x cp 2 x tp 2" in out, out[-4000:]
    loss_err, param_err = runs_agree(tmp_path, steps=3)
    print(
        f"world 4 [parallel.cp=2 parallel.tp=2]: 3 steps, max rel err loss {loss_err:.1e} "
        f"params {param_err:.1e}"
    )
    assert loss_err <= TOL and param_err <= TOL


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (
            ["parallel.cp=2", "data.pack.seq_len=1026"],
            2,
            r"data.pack.seq_len=1026 must be divisible by 2\*cp=4 .* use a multiple of 4",
        ),
        (
            ["parallel.cp=2", "parallel.tp=4", "data.pack.seq_len=1028"],
            8,
            r"and seq_len/cp by tp=4 .* use a multiple of 8",
        ),
        (
            ["parallel.cp=2", "model.attn_backend=flex"],
            2,
            r"model.attn_backend=flex cannot run inside it",
        ),
        (
            ["parallel.cp=2", "train.compile=true"],
            2,
            r"parallel.cp=2 with train.compile=true is not supported",
        ),
        (
            ["parallel.cp=2", "parallel.cp_comm=p2p"],
            2,
            r"parallel.cp_comm='p2p'; choose one of \['allgather', 'ring'\]",
        ),
        (
            ["parallel.cp=2", "model.cuda_graph_scope=[attn]", "model.attn_backend=sdpa"],
            2,
            r"tensor/context-parallel collectives",
        ),
    ],
    ids=["seq_len", "seq_len_tp", "backend", "compile", "comm", "cuda_graphs"],
)
def test_context_parallel_refusals_before_anything_runs(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(
            compose_job(["data.shards=sample", *overrides]), world_size=world, environment=False
        )
