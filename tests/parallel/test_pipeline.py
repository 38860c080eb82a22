"""Pipeline stages train exactly the step one process trains.

The test model is the tiny preset with 4 decoder layers and deepstack features
on the first 2 (its config.json is written to the tmp dir and read through
`model.hf_config`), so a split can leave deepstack layer 1 on a later stage:
its feature then travels there as a stage output.  One reference run (one
process, real packed sample data, fp32, AdamW, clipping, aux loss on) records
the per-step loss, the clipped gradients and the final parameters; every
pipeline layout runs the same job through the real `Trainer` on gloo ranks and
must match each to 1e-5 relative (the gathered gradients and parameters of
every stage, `test_layouts.compare`; with `VAL` the validation loss of every step too).  Several
layouts share one launch per
world size; resuming is checked across pipeline sizes and splits: a pp2
checkpoint resumes under another split, and in one process (pp1) to the
uninterrupted run's loss (1e-6).  The scaled-down `gb200_3d` recipe of
docs/parallel.md runs under torchrun on 8 processes to one process's losses and
exported weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks
from test_layouts import (
    TOL,
    UNCLIPPED_EPS,
    check_exports,
    check_layouts,
    chunked_loss_matches_whole_logits,
    job_overrides,
    one_process_references,
    print_report,
    rel,
    runs_agree,
    with_options,
)

from moevlm.config import compose_job
from moevlm.data.loader import NoData
from moevlm.data.sample_cache import ensure_sample
from moevlm.model import VLMConfig
from moevlm.parallel import full_state_dict
from moevlm.parallel.pipeline import v_schedules_supported
from moevlm.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
MODEL = "model.hf_config=@TMP/pipe_model.json"
PP2 = [MODEL, "parallel.pp=2"]


def pipe_model() -> VLMConfig:
    cfg = VLMConfig.preset("tiny")
    cfg.text.num_layers, cfg.vision.deepstack_visual_indexes = 4, (0, 1)
    return cfg


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """ref.pt (validating after every step, test_layouts.VAL), ref_global.pt, ref_sequence.pt,
    ref_lora.pt and the initial weights as a Hugging Face folder (init_hf, for a layout that starts
    from one)."""
    tmp = tmp_path_factory.mktemp("pipeline")
    shards = str(ensure_sample()[0])
    (tmp / "pipe_model.json").write_text(json.dumps(pipe_model().to_hf("float32")))
    one_process_references(shards, tmp, [MODEL], names=("global", "sequence", "lora"), init=True)
    return tmp, shards


# deepstack feature 1 crosses to stage 1 wherever stage 0 holds one layer ([1, ...])
WORLD_2 = [
    [
        *PP2,
        "parallel.pp_layers=[1,3]",
        "RESUME",
    ],  # 1f1b; a checkpoint after step 1 (pipeline-split)
    [*PP2, "parallel.pp_layers=[3,1]", "FROM=p2_0"],  # that checkpoint under another split
    [
        *PP2,
        "parallel.pp_schedule=interleaved_1f1b",
        "parallel.vpp=2",
        "parallel.pp_layers=[1,1,1,1]",
    ],
    # with validation: the forward-only pipeline path (Pipeline.forward_only)
    [*PP2, "parallel.pp_schedule=gpipe", "parallel.dp_mode=ddp", "VAL"],
    # router balancing: the global-batch frequencies read on the last stage in schedule order, the
    # bias of each stage's layers; the sequence-wise loss travelling between stages
    with_options("global", [*PP2, "parallel.pp_layers=[1,3]"]),
    with_options("sequence", [*PP2, "parallel.pp_layers=[3,1]"]),
    # LoRA adapters in their layers' stages, resumed from each stage's adapter-only checkpoint,
    # then exported from both stages (PEFT adapters, merged HF weights)
    with_options("lora", [*PP2, "parallel.pp_layers=[1,3]", "RESUME", "EXPORT"]),
]
V_SCHEDULES = [
    [*PP2, "parallel.pp_schedule=zbv", "parallel.pp_layers=[1,1,1,1]"],
    [*PP2, "parallel.pp_schedule=dualpipev", "parallel.dp_mode=ddp"],
]
# torch 2.11's V stages start by sending to themselves, which gloo refuses
if v_schedules_supported("gloo"):
    WORLD_2 += V_SCHEDULES
WORLD_4 = [
    [*PP2, "parallel.tp=2", "parallel.pp_layers=[1,3]"],
    # another seed, then the reference's initial weights from a Hugging Face folder, each stage its own
    [
        *PP2,
        "parallel.ep=2",
        "model.dispatcher=alltoall",
        "train.seed=7",
        "model.hf_checkpoint=@TMP/init_hf",
    ],
    # dp 2 inside each stage; validation's forward-only stages under FSDP, over dp 2
    [*PP2, "parallel.dp_mode=fsdp", "VAL"],
    # the global-batch frequencies gathered over dp 2 on the last stage, inside the schedule
    with_options("global", [*PP2, "parallel.dp_mode=fsdp"]),
    [MODEL, "parallel.pp=4", "parallel.pp_layers=[1,1,1,1]"],
    # activation offload in pipeline stages (each stage's prefetch chain, several micro-batches in
    # flight) with the experts over ep 2: the all-to-all's saved tensors inside the MoE scope go too
    [
        *PP2,
        "parallel.ep=2",
        "model.dispatcher=alltoall",
        "model.offload_modules=[layer_input,core_attn,moe]",
    ],
]
WORLD_8 = [
    [
        *PP2,
        "parallel.tp=2",
        "parallel.ep=2",
        "parallel.etp=2",
        "model.dispatcher=alltoall",
        "parallel.dp_mode=fsdp",
        "parallel.pp_layers=[1,3]",
    ]
]


def _pipelines_on_ranks(rank: int, world: int, shards: str, tmp: str, layouts: list[list[str]]):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    check_layouts(
        rank,
        world,
        shards,
        tmp,
        os.path.join(tmp, "ref.pt"),
        layouts,
        "p",
        f"pipelines_w{world}.json",
        hide=(MODEL,),
    )
    if world == 2:
        _nonfinite_on_one_stage_skips_on_every_stage(rank, shards, tmp)
        # the LM head's loss over token chunks on the last stage, against its whole logits
        model = MODEL.replace("@TMP", tmp)
        chunked_loss_matches_whole_logits(
            shards, os.path.join(tmp, "p2_chunks"), [model, "parallel.pp=2"]
        )
    if world == 4:  # and with the last stage's head vocab-parallel over tp 2
        model = MODEL.replace("@TMP", tmp)
        chunked_loss_matches_whole_logits(
            shards, os.path.join(tmp, "p4_chunks"), [model, "parallel.pp=2", "parallel.tp=2"]
        )


def _nonfinite_on_one_stage_skips_on_every_stage(rank: int, shards: str, tmp: str):
    """pp2: a NaN weight on the last stage only (its rank's final norm) makes both ranks see the
    non-finite loss and gradient norm and skip the same step, leaving both stages' weights as they
    were; the last stage's rank reads no data (it receives each micro-batch's text)."""
    tr = Trainer(
        compose_job(
            job_overrides(
                shards,
                os.path.join(tmp, "p2_nonfinite"),
                [MODEL.replace("@TMP", tmp), "parallel.pp=2"],
            )
        )
    )
    try:
        assert isinstance(tr.loader, NoData) == (rank == 1)
        if rank == 1:
            with torch.no_grad():
                dict(tr.model.named_parameters())["text.norm.weight"].to_local().fill_(float("nan"))
        before = {k: v.detach().to_local().clone() for k, v in tr.model.named_parameters()}
        assert tr.train_step(type("NoWindow", (), {"add": lambda self, **kw: None})()) is False
        # NaN everywhere
        assert tr.nonfinite_steps == 1 and tr.step == 1 and tr.losses[-1] != tr.losses[-1]
        for k, v in tr.model.named_parameters():
            torch.testing.assert_close(
                v.detach().to_local(), before[k], rtol=0, atol=0, equal_nan=True
            )
    finally:
        tr.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,layouts", [(2, WORLD_2), (4, WORLD_4), (8, WORLD_8)], ids=["world2", "world4", "world8"]
)
def test_pipeline_layouts_match_one_process(reference, world, layouts):
    tmp, shards = reference
    launch_dir = tmp / f"launch_w{world}"
    launch_dir.mkdir()
    run_ranks(
        _pipelines_on_ranks, world, launch_dir, world, shards, str(tmp), layouts, timeout_s=300
    )
    print_report(tmp / f"pipelines_w{world}.json", world)
    if world == 2:
        _pp2_checkpoint_resumes_in_one_process(tmp, shards)
        i = next(i for i, x in enumerate(layouts) if "EXPORT" in x)
        check_exports(
            tmp / f"p2_{i}", tmp / "ref_lora.pt", "pp2", [MODEL.replace("@TMP", str(tmp))]
        )


def _pp2_checkpoint_resumes_in_one_process(tmp: Path, shards: str):
    """The pp2 checkpoint of step 1 (layout p2_0) resumed by one process (pp1): step 2 gives the
    uninterrupted run's loss and weights."""
    ref = torch.load(tmp / "ref.pt", weights_only=False)
    ckpt = tmp / "p2_0" / "checkpoints" / "step_00000001"
    overrides = job_overrides(
        shards, str(tmp / "pp1_from_pp2"), [MODEL.replace("@TMP", str(tmp)), f"train.resume={ckpt}"]
    )
    tr = Trainer(compose_job(overrides))
    try:
        assert tr.step == 1 and tr.pipeline is None
        assert tr.train_step(type("NoWindow", (), {"add": lambda self, **kw: None})())
        loss_err = abs(tr.losses[-1] - ref["losses"][-1]) / abs(ref["losses"][-1])
        params = full_state_dict(tr.model)
        param_err = max(rel(params[k], ref["params"][k]) for k in ref["params"])
    finally:
        tr.close()
    print(f"pp2 checkpoint resumed as pp1: rel err loss {loss_err:.1e} params {param_err:.1e}")
    assert loss_err <= 1e-6 and param_err <= TOL


# ------------------------------------------------- docs/parallel.md's scaled-down gb200_3d, torchrun, world 8
GB200_3D_CPU = ["+experiment=gb200_3d", "+scale=cpu"]


@pytest.mark.slow
def test_gb200_3d_scaled_down_runs_to_one_process_losses(tmp_path):
    """`torchrun --nproc-per-node 8 train.py +experiment=gb200_3d ...` (docs/parallel.md's command; pp2 x dp2 x tp2
    folded onto ep4, FSDP2, 1f1b) for 3 steps: it logs the pipeline plan, its losses and its exported
    Hugging Face weights (gathered from both stages) equal one process's (the job run in this process,
    1e-5): with the default data streams every layout trains on the same rows.  (A third launch, the
    recipe as plain FSDP dp8 x ep8, was dropped to save 25 s of the suite: other world-8 launches
    compare folded layouts with one process, test_layouts.py's etp2 x ep2 x edp2 and WORLD_8 here.)"""
    readme = " ".join((REPO / "docs/parallel.md").read_text().replace("\\\n", " ").split())
    assert "torchrun --standalone --nproc-per-node 8 train.py " + " ".join(GB200_3D_CPU) in readme
    # eps raised as in test_layouts (UNCLIPPED_EPS: this job is not clipped): with the CPU lr (2e-3) and a
    # small eps, AdamW turns the float noise of near-zero gradients, which differs between CPU kinds, into
    # visible parameter differences
    common = [
        *GB200_3D_CPU,
        "train.steps=3",
        "train.tensorboard=false",
        "train.checkpoint_every=0",
        UNCLIPPED_EPS,
    ]
    # one process: the scaled job's model and batch without its layout; the rows are the same with the default
    # data streams on both (layout independent)
    one = [
        *common,
        "parallel.scale_to=null",
        "parallel.world_size=1",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.ep=1",
        "train.global_batch_size=8",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "8",
        str(REPO / "train.py"),
    ]
    # one process: the job as train.py runs it, in this process
    dirs = {
        name: [f"train.run_dir={tmp_path / name}", f"train.export_hf={tmp_path / (name + '_hf')}"]
        for name in ("one", "eight")
    }
    assert Trainer(compose_job([*one, *dirs["one"]])).run() == 0
    proc = subprocess.run(
        [*torchrun, *common, *dirs["eight"]],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    out = {"eight": proc.stdout}
    assert "pipeline: 1f1b, pp 2 x vpp 1 = 2 stages, 4 micro-batches per step" in out["eight"]
    assert "world 8 = pp 2 x dp 2 x cp 1 x tp 2 = pp 2 x edp 1 x ep 4 x etp 1" in out["eight"]
    loss_err, param_err = runs_agree(tmp_path, steps=3)
    print(
        f"gb200_3d scaled down, torchrun world 8: 3 steps, max rel err loss {loss_err:.1e} params {param_err:.1e}"
    )
    assert loss_err <= TOL and param_err <= TOL
    records = {
        d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        for d in ("one", "eight")
    }
    assert len(records["eight"]) == 3
    # tokens and FLOPs are the step's, counted once (not once per stage or tp rank): one process's numbers
    assert [r["flops"] for r in records["eight"]] == pytest.approx(
        [r["flops"] for r in records["one"]], rel=1e-12
    )
    assert all(r["tokens_per_s"] > 0 for r in records["eight"])
    last = records["eight"][-1]
    assert len(last["mem_gib_by_pp_rank"]) == 2 and last["expert_load_max_over_mean"] is not None
