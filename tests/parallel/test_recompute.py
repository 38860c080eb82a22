"""Recompute gives the same loss and gradients as none, keeps fewer activations,
and never runs a collective again in backward.

(a) One process, the tiny model with two images and a dense layer, fp32: none,
each selective module, all of them, and full: loss and every gradient equal
(<= 1e-6 relative); saved-activation bytes (`SavedBytes`) fall for each
selective module and most for full.
(b) One launch of 2 gloo ranks: tp2 x ep2 (all-to-all dispatcher, FSDP): none,
selective (all modules) and full match the one-process reference in loss and
gathered gradients, and backward issues exactly as many collectives with
recompute as without (forward issues some: the count sees them); full with
model.recompute_collectives=reissue matches too, issues in backward what
forward issued on top of none's backward, and keeps fewer bytes than full; then pp2
(pipeline stages, 1F1B, the real Trainer, 2 steps): selective and full give
none's losses and gathered gradients.
(c) The trainer logs which recompute ran, and its FLOPs stay useful work.
"""

from __future__ import annotations

import copy

import pytest
import torch
from gloo_ranks import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from moevlm.dispatch import DispatcherSpec
from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.parallel.build import BuildOptions
from moevlm.parallel.recompute import (
    COMM_NAMESPACES,
    MODULES,
    SavedBytes,
    apply_recompute,
    check,
    describe,
)

TOL = 1e-6
SETTINGS = [
    ("none", ()),
    *(("selective", (m,)) for m in MODULES),
    ("selective", MODULES),
    ("full", ()),
]


def tiny_config() -> VLMConfig:
    cfg = VLMConfig.preset("tiny")
    cfg.moe.mlp_only_layers = (1,)  # a dense SwiGLU layer for `mlp`
    return cfg


def image_batch(cfg: VLMConfig, seed: int = 0) -> dict:
    """64 tokens: text, a 2x2-token image, text, a 2x4-token image, text."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, 4, 4], [1, 4, 8]])
    pixels = torch.randn(int(grid.prod(-1).sum()), cfg.vision.patch_dim, generator=g)
    text = torch.randint(0, 1000, (1, 48), generator=g)

    def image(n):
        return torch.tensor(
            [[cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id]]
        )

    ids = torch.cat([text[:, :4], image(4), text[:, 4:20], image(8), text[:, 20:]], 1)
    return dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, labels=ids)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def test_recompute_same_gradients_fewer_saved_bytes():
    cfg = tiny_config()
    torch.manual_seed(0)
    base, batch = Qwen3VLMoe(cfg), image_batch(cfg)
    saved, ref = {}, None
    for mode, modules in SETTINGS:
        model = copy.deepcopy(base)
        apply_recompute(model, mode, modules)
        with SavedBytes(model) as meter:
            out = model(**batch)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        saved[describe(mode, modules)] = meter.bytes
        if ref is None:
            ref = out.loss.detach(), grads
            assert all(g is not None for g in grads.values())
            continue
        assert rel(out.loss.detach(), ref[0]) <= TOL, (mode, modules)
        for n, g in ref[1].items():
            assert rel(grads[n], g) <= TOL, (mode, modules, n)
    none, full = saved.pop("none"), saved.pop("full")
    for name, b in saved.items():
        assert b < none, (name, b, none)
    assert full < min(saved.values()), saved


def test_qwen35_core_attn_recomputes_the_delta_rule_same_gradients_fewer_bytes():
    """On the hybrid model `core_attn` wraps each Gated DeltaNet layer's chunked delta rule too (its
    fp32 chunk intermediates not kept): the same loss and gradients, fewer bytes than none, and more
    than full."""
    cfg = VLMConfig.preset("qwen3_5_tiny")
    torch.manual_seed(0)
    base, batch = Qwen3VLMoe(cfg), image_batch(cfg)
    saved, ref = {}, None
    for mode, modules in (("none", ()), ("selective", ("core_attn",)), ("full", ())):
        model = copy.deepcopy(base)
        apply_recompute(model, mode, modules)
        with SavedBytes(model) as meter:
            out = model(**batch)
        out.loss.backward()
        saved[mode] = meter.bytes
        if mode == "selective":
            wrapped = [n for n, m in model.named_modules() if n.endswith("linear_attn.core_region")]
        grads = {n: p.grad for n, p in model.named_parameters()}
        if ref is None:
            ref = out.loss.detach(), grads
            continue
        assert rel(out.loss.detach(), ref[0]) <= TOL, mode
        for n, g in ref[1].items():
            assert rel(grads[n], g) <= TOL, (mode, n)
    assert len(wrapped) == sum(t == "linear_attention" for t in cfg.text.layer_types)
    assert saved["full"] < saved["selective"] < saved["none"], saved


def test_recompute_runs_plainly_without_autograd():
    cfg = tiny_config()
    torch.manual_seed(0)
    model, batch = Qwen3VLMoe(cfg), image_batch(cfg)
    want = model(**batch).loss
    apply_recompute(model, "full")
    with torch.no_grad():
        assert torch.equal(model(**batch).loss, want.detach())


def test_bad_settings_are_named():
    assert "choose one of none, selective, full" in check("some", ())
    assert "['attn']" in check("selective", ("attn",)) and "core_attn" in check(
        "selective", ("attn",)
    )
    assert "at least one" in check("selective", ())
    assert (
        check("full", ()) is None
        and describe("selective", ("core_attn", "moe_act")) == "selective:core_attn,moe_act"
    )
    assert (
        describe("full", (), "reissue") == "full+reissue"
        and describe("none", (), "reissue") == "none"
    )
    assert "choose one of save, reissue" in check("full", (), "again")
    with pytest.raises(ValueError, match="model.recompute='x'"):
        apply_recompute(Qwen3VLMoe(tiny_config()), "x")
    with pytest.raises(ValueError, match="model.recompute_collectives='again'"):
        apply_recompute(Qwen3VLMoe(tiny_config()), "full", collectives="again")


# ------------------------------------------------------------------ 2 ranks
class CountCollectives(TorchDispatchMode):
    """Counts the collectives issued (functional or in-place c10d), waits left out."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            (func.namespace in COMM_NAMESPACES or func.namespace == "c10d")
            and "wait" not in func.__name__
            and "wrap" not in func.__name__
        ):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _two_ranks(rank: int, shards: str, tmp: str) -> None:
    import os

    # what the Trainer reads
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    _tp2_ep2(rank)
    _pp2(shards, tmp)


def _pp2(shards: str, tmp: str) -> None:
    """Pipeline stages (pp2, 1F1B, the Trainer): full and selective recompute train the steps none trains."""
    from test_layouts import rel as rel64
    from test_layouts import run_job

    runs = {
        mode: run_job(
            shards,
            f"{tmp}/pp2_{mode}",
            [
                "parallel.pp=2",
                f"model.recompute={mode}",
                "model.recompute_modules=[core_attn,moe,vision]",
            ],
            params=False,  # the losses and every step's gradients are compared, not the weights
        )
        for mode in ("none", "selective", "full")
    }
    for mode in ("selective", "full"):
        for a, b in zip(runs[mode]["losses"], runs["none"]["losses"]):
            assert abs(a - b) <= TOL * abs(b), (mode, a, b)
        for got, want in zip(runs[mode]["grads"], runs["none"]["grads"]):
            assert got.keys() == want.keys()
            for n in want:
                assert rel64(got[n], want[n]) <= TOL, (mode, n)


def _tp2_ep2(rank: int) -> None:
    from moevlm.parallel import (
        ParallelDims,
        build_model,
        full_grads,
        init_parameters_,
        materialize_,
    )

    cfg = tiny_config()
    batch = image_batch(cfg)
    ref = Qwen3VLMoe(cfg)
    init_parameters_(ref, 7)
    ref_out = ref(**batch)
    ref_out.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    counts, kept = {}, {}
    for mode, modules, collectives in (
        ("none", (), "save"),
        ("selective", MODULES, "save"),
        ("full", (), "save"),
        ("full", (), "reissue"),
    ):
        model, ctx = build_model(
            cfg,
            ParallelDims(2, tp=2, ep=2),
            BuildOptions(
                dp_mode="fsdp",
                dispatcher=DispatcherSpec("alltoall"),
                recompute=(mode, modules),
                recompute_collectives=collectives,
            ),
        )
        materialize_(model, "cpu", ctx)
        init_parameters_(model, 7, ctx)
        if collectives == "reissue":
            mode = "full reissue"
        with CountCollectives() as fwd, SavedBytes(model) as meter:
            out = model(**batch)
        with CountCollectives() as bwd:
            out.loss.backward()
        ctx.finish_gradients()
        counts[mode], kept[mode] = (fwd.n, bwd.n), meter.bytes
        assert rel(out.loss.detach(), ref_out.loss.detach()) <= TOL, (mode, out.loss, ref_out.loss)
        grads = full_grads(model)
        assert grads.keys() == ref_grads.keys()
        for n, g in ref_grads.items():
            assert rel(grads[n], g) <= 1e-5, (mode, n, rel(grads[n], g))
    assert counts["none"][0] > 0 and counts["none"][1] > 0, counts
    assert counts["selective"][1] == counts["none"][1] == counts["full"][1], counts
    # reissued: each recomputed layer's exchanges run again (the vision tower's gathers too)
    assert counts["full reissue"][1] > counts["full"][1], counts
    assert counts["full reissue"][0] == counts["full"][0], counts
    assert kept["full reissue"] < kept["full"] < kept["none"], kept


@pytest.mark.slow
def test_recompute_two_ranks_same_gradients_no_extra_collectives(tmp_path):
    """tp2 x ep2 (FSDP, all-to-all) against one process, then pp2 stages through the Trainer."""
    from moevlm.data.sample_cache import ensure_sample

    run_ranks(_two_ranks, 2, tmp_path, str(ensure_sample()[0]), str(tmp_path), timeout_s=300)


# ------------------------------------------------------------------ trainer
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.recompute=some"], "model.recompute='some'; choose one of none, selective, full"),
        (
            ["model.recompute=selective", "model.recompute_modules=[attn]"],
            r"recompute_modules has \['attn'\]",
        ),
        (["model.recompute=selective", "model.recompute_modules=[]"], "name at least one of"),
        (["model.recompute_collectives=keep"], "recompute_collectives.*save, reissue"),
    ],
)
def test_config_errors_name_the_choices(overrides, message):
    from moevlm.config import compose_job, validate
    from moevlm.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        validate(compose_job(overrides), 1)


def test_trainer_logs_which_recompute_ran_and_useful_flops(tmp_path):
    """One step without and with full recompute: same loss, same FLOPs (useful work only), and
    each metrics record names the setting."""
    from one_step import first_records

    recs = first_records(
        tmp_path,
        {
            "none": [],
            "selective:core_attn,moe": [
                "model.recompute=selective",
                "model.recompute_modules=[core_attn,moe]",
            ],
        },
    )
    a, b = recs["none"], recs["selective:core_attn,moe"]
    assert a["recompute"] == "none" and b["recompute"] == "selective:core_attn,moe"
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b["flops"] == a["flops"] > 0
