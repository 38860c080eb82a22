"""Every layout of the Qwen3.5-MoE family trains exactly the step one process trains.

test_layouts.py's machinery with the `qwen3_5_tiny` preset (3 Gated DeltaNet layers, then one gated
full-attention layer; a shared expert beside the routed ones; fp32): one reference run in one process,
then in ONE launch of 2 gloo ranks each layout through the real `Trainer`, compared per step (loss,
gathered gradients) and after the last update (parameters), each to 1e-5 relative.  Layouts: FSDP
dp2 with ep2 (all-to-all dispatch; the shared expert beside the routed experts), DDP dp2, pp2 (the
automatic split: the GDN layers 0-2 on stage 0, the full-attention layer 3 on stage 1), tp2 x ep2
(GDN key heads with their value heads: every projection, the conv channels and out_proj split as the
attention's heads are, each rank holding half of in_proj_qkv and the conv; the sequence parallel
between blocks) and cp2 (GDN layers gather the row and run half of the
heads each).  Five layouts, not one per feature: the suite's time (about 30 s on 2 cores).

Every run starts from one Hugging Face folder (`conditioned_init`): the Trainer's initial weights
with each GDN layer's A = exp(A_log) drawn from U(0.01, 0.1) instead of the reference's U(0.01, 16).
With A near 16 the per-token log decay is near -20, and the chunked delta rule's gradients of A_log,
dt_bias and in_proj_a are sums that cancel to 1e-5 of their terms: 1e-7 of float32 noise in their
inputs (another matmul split, another thread count) moves them by 1e-4 to 1e-2, in one process too.
The reference runs on one thread, as each rank does.  Errors per layout: <tmp>/qwen35_w2.json.
"""

from __future__ import annotations

import os

import pytest
import torch
from gloo_ranks import run_forked, run_ranks
from test_layouts import _one_process, check_layouts, job_overrides, print_report

from moevlm.config import compose_job, validate
from moevlm.data.sample_cache import ensure_sample
from moevlm.model import VLMConfig
from moevlm.model.strategies import local
from moevlm.parallel import ParallelDims, build_model
from moevlm.parallel.build import BuildOptions
from moevlm.train.trainer import Trainer

# 2 rows a step (one per dp rank): half the suite's time of test_layouts.py's 4; AdamW's eps 1e-5
# (test_layouts.UNCLIPPED_EPS's reason: the vision biases' tiny gradients, 5.6e-6 apart after tp2 x ep2
# with 1e-6)
QWEN35 = [
    "model.preset=qwen3_5_tiny",
    "model.hf_checkpoint=@INIT_HF",
    "train.global_batch_size=2",
    "optim.eps=1e-5",
]
WORLD_2 = [
    # FSDP2 over dp 2, the routed experts over ep 2 (all-to-all), the shared expert FSDP-sharded
    [*QWEN35, "parallel.dp_mode=fsdp", "parallel.ep=2", "model.dispatcher=alltoall"],
    [*QWEN35, "parallel.dp_mode=ddp"],
    # the automatic split (by training FLOPs, GDN layers charged theirs): [3, 1]
    [*QWEN35, "parallel.pp=2"],
    # GDN heads: in_proj_qkv/z/b/a, the conv, dt_bias, A_log and out_proj sharded; the experts over
    # the same two ranks (ep 2, etp 1)
    [*QWEN35, "parallel.tp=2", "parallel.ep=2", "parallel.etp=1", "model.dispatcher=alltoall"],
    # the row's zigzag chunks over cp 2: GDN layers gather the row and run half of the heads each
    [*QWEN35, "parallel.cp=2"],
]


def conditioned_init(shards: str, tmp: str) -> None:
    """<tmp>/init_hf: the Trainer's initial weights, each GDN layer's A_log = log U(0.01, 0.1)."""
    tr = Trainer(compose_job(job_overrides(shards, os.path.join(tmp, "init"), QWEN35[:1])))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in tr.model.named_parameters():
            if name.endswith("linear_attn.A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 0.1, generator=g).log())
    tr.model.save_pretrained(os.path.join(tmp, "init_hf"))
    tr.close()


def _references(shards: str, tmp: str) -> None:
    torch.set_num_threads(1)  # as each rank computes
    conditioned_init(shards, tmp)
    _one_process(shards, tmp, "ref", QWEN35)


def _tp_holds_half_of_qkv_and_conv() -> None:
    """Under tp 2 each rank holds half of every GDN layer's in_proj_qkv rows and conv channels."""
    cfg = VLMConfig.preset("qwen3_5_tiny")
    model, _ = build_model(cfg, ParallelDims(2, tp=2), BuildOptions())
    gdn = [layer.linear_attn for layer in model.text.layers if layer.linear_attn is not None]
    assert len(gdn) == 3
    for g in gdn:
        for w in (g.in_proj_qkv.weight, g.conv1d.weight):
            assert local(w).shape[0] * 2 == w.shape[0] == g.conv1d.in_channels


def _on_ranks(rank: int, world: int, shards: str, tmp: str, layouts: list[list[str]]) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    _tp_holds_half_of_qkv_and_conv()
    ref = os.path.join(tmp, "ref.pt")
    check_layouts(rank, world, shards, tmp, ref, layouts, "q", f"qwen35_w{world}.json", QWEN35)


@pytest.mark.slow
def test_qwen35_layouts_match_one_process(tmp_path):
    shards = str(ensure_sample()[0])
    pp2 = compose_job(job_overrides(shards, str(tmp_path / "plan"), [QWEN35[0], *WORLD_2[2][4:]]))
    assert validate(pp2, world_size=2, environment=False).pipeline.layers == (3, 1)
    run_forked(_references, [(shards, str(tmp_path))])
    (tmp_path / "launch").mkdir()
    run_ranks(_on_ranks, 2, tmp_path / "launch", 2, shards, str(tmp_path), WORLD_2, timeout_s=300)
    print_report(tmp_path / "qwen35_w2.json", 2)
