"""The pipeline plan without processes: schedule names, stage placement, the FLOP-balanced split
(checked against brute force and against the model's FLOP counter), and the pipeline mistakes a
user makes, each refused before anything is allocated with what to change."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moevlm.config import compose_job, validate
from moevlm.errors import ConfigError
from moevlm.model import VLMConfig, count_flops
from moevlm.parallel.pipeline_schedules import schedule_name
from moevlm.parallel.pipeline_split import StageCosts, balance, budget_grids, split_pipeline

REPO = Path(__file__).resolve().parents[2]


def test_schedule_names_and_their_old_spellings():
    assert [
        schedule_name(n)
        for n in ("1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV", "zbv")
    ] == ["1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev", "zbv"]
    with pytest.raises(
        ConfigError, match=r"parallel.pp_schedule='1f2b'; choose one of \['gpipe', '1f1b'"
    ):
        schedule_name("1f2b")


def _plan(cfg=None, **kw):
    args = dict(
        pp=2,
        vpp=None,
        schedule="1f1b",
        layers="auto",
        microbatches=8,
        rows=1,
        seq_len=1024,
        max_patches=256,
        image_patches=64,
    )
    args.update(kw)
    return split_pipeline(cfg or _six_layers(), **args)


def _six_layers() -> VLMConfig:
    cfg = VLMConfig.preset("tiny")
    cfg.text.num_layers = 6
    return cfg


def test_stage_placement_loop_and_v():
    loop = _plan(schedule="interleaved_1f1b", vpp=2)
    assert (loop.num_stages, loop.stages_of(0), loop.stages_of(1)) == (4, [0, 2], [1, 3])
    v = _plan(schedule="zbv")
    assert (v.vpp, v.stages_of(0), v.stages_of(1)) == (2, [0, 3], [1, 2])
    explicit = _plan(layers="1,5")
    assert [list(explicit.layer_range(s)) for s in range(2)] == [[0], [1, 2, 3, 4, 5]]
    assert _plan(layers=[2, 4]).layers == (2, 4)  # a Hydra list works too


def test_balance_is_the_exact_minimax_split():
    costs = StageCosts(first=7.0, layers=(3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0), last=2.5)
    for K in (2, 3, 4):
        got = balance(costs, K)
        brute = []
        for cuts in itertools.combinations(range(1, 8), K - 1):
            b = (0, *cuts, 8)
            split = tuple(y - x for x, y in zip(b, b[1:]))
            brute.append(max(_stage_costs(costs, split)))
        assert max(_stage_costs(costs, got)) == min(brute), K


def _stage_costs(c: StageCosts, split):
    out, at = [], 0
    for s, n in enumerate(split):
        out.append(
            sum(c.layers[at : at + n])
            + (c.first if s == 0 else 0)
            + (c.last if s == len(split) - 1 else 0)
        )
        at += n
    return out


def test_auto_split_moves_decoder_layers_off_a_heavy_vision_stage():
    """Qwen3-VL-30B-A3B, pp 2: with a small patch budget the split is near even; at 16k patches the
    vision tower costs ~8 decoder layers, so stage 0 gives layers away and the stages stay balanced."""
    cfg = VLMConfig.preset("qwen3_vl_30b_a3b")
    kw = dict(seq_len=8192, image_patches=4096, microbatches=16)
    light = _plan(cfg, max_patches=256, **kw)
    heavy = _plan(cfg, max_patches=16384, **kw)
    assert light.layers[0] >= 23 and heavy.layers[0] <= light.layers[0] - 3, (
        light.layers,
        heavy.layers,
    )
    assert max(heavy.flops) / min(heavy.flops) < 1.05
    # the plan's FLOPs are the model's FLOP counter at the budgets (the MFU convention)
    total = count_flops(cfg, [8192], budget_grids(16384, 4096, 2), training=True).total
    assert sum(heavy.flops) == pytest.approx(total, rel=1e-12)
    text = heavy.describe()
    assert "stage 0 (pp rank 0): decoder layers 0-" in text and "vision tower, embedding" in text
    assert "norm, LM head, loss" in text and "% of the FLOPs" in text


def test_auto_split_balances_ranks_with_several_stages_each():
    cfg = VLMConfig.preset("qwen3_vl_30b_a3b")
    for schedule in ("interleaved_1f1b", "zbv"):
        p = _plan(
            cfg, pp=4, vpp=2, schedule=schedule, seq_len=8192, max_patches=16384, image_patches=4096
        )
        by_rank = [sum(p.flops[s] for s in p.stages_of(r)) for r in range(4)]
        assert max(by_rank) / min(by_rank) < 1.15, (schedule, p.layers, by_rank)


def _refused(overrides: list[str], world: int, match: str):
    job = compose_job(["data.shards=/nonexistent", "train.global_batch_size=8", *overrides])
    with pytest.raises(ConfigError, match=match):
        validate(job, world, environment=False)  # only the layout and config are under test


@pytest.mark.parametrize(
    "overrides,world,match",
    [
        (
            ["parallel.pp=2", "parallel.pp_schedule=1f2b"],
            2,
            r"parallel.pp_schedule='1f2b'; choose one of",
        ),
        (
            ["parallel.pp=2", "parallel.vpp=2"],
            2,
            r"1f1b runs 1 stage\(s\) per rank but parallel.vpp=2; set parallel.vpp=1",
        ),
        (
            ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.vpp=1"],
            2,
            "needs parallel.vpp >= 2",
        ),
        (
            ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.vpp=3"],
            2,
            r"zbv runs 2 stage\(s\) per rank",
        ),
        (
            ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b"],
            2,
            r"text.num_layers=3 < 4 pipeline stages \(pp 2 x vpp 2\)",
        ),
        (["parallel.pp=2", "parallel.pp_layers=[1,1,1]"], 2, "lists 3 stages but there are 2"),
        (
            ["parallel.pp=2", "parallel.pp_layers=[1,1]"],
            2,
            "sums to 2 but the model has text.num_layers=3",
        ),
        (
            ["parallel.pp=2", "parallel.pp_layers=[0,3]"],
            2,
            "every stage needs at least one decoder layer",
        ),
        (
            ["parallel.pp=2", "parallel.pp_layers=two"],
            2,
            "give 'auto' or the decoder layers of every stage",
        ),
        (
            ["parallel.pp=4", "train.global_batch_size=2", "model.num_layers=4"],
            4,
            "1f1b needs at least pp=4 micro-batches per step, got 2",
        ),
        (
            [
                "parallel.pp=2",
                "parallel.pp_schedule=dualpipev",
                "model.num_layers=4",
                "train.global_batch_size=2",
            ],
            2,
            r"dualpipev needs at least 4 micro-batches per step \(2 x pp\), got 2",
        ),
        (["parallel.pp_layers=[1,2]"], 1, "describe pipeline stages but parallel.pp=1"),
    ],
)
def test_pipeline_mistakes_are_refused_with_what_to_change(overrides, world, match):
    _refused(overrides, world, match)


def test_tied_embeddings_are_refused_across_stages():
    cfg = _six_layers()
    cfg.tie_word_embeddings = True
    with pytest.raises(ConfigError, match="tied word embeddings"):
        _plan(cfg)


@pytest.mark.slow
def test_train_py_refuses_a_pipeline_mistake_before_allocating(tmp_path):
    """Through train.py (WORLD_SIZE set as torchrun would): exit 2, the message only, no run directory."""
    env = dict(
        os.environ,
        WORLD_SIZE="2",
        RANK="0",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29511",  # (never reached: the refusal comes before the rendezvous)
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            "parallel.pp=2",
            "parallel.pp_schedule=zbv",
            "parallel.vpp=3",
            f"train.run_dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        "config error: parallel.pp_schedule=zbv runs 2 stage(s) per rank but parallel.vpp=3"
        in proc.stderr
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
