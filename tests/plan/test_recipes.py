"""Every recipe of conf/experiment/ through one training step on fake tensors at its launch size
(world, layout, dispatcher, budgets, precision) and real widths, and its forward on fake CUDA.

CI keeps the recipes' widths and budgets but not their depth: 2 decoder layers per pipeline stage
and a 2-block vision tower (`model.num_layers`, `model.vision_depth`); the full-depth plans are
printed in docs/plans.md (`python -m moevlm.plan +experiment=NAME`).  A recipe whose dispatcher's
package is absent (deep_ep) runs with moevlm's TEST EMULATOR of that package (tests/dispatch/),
which follows the real one's API but says nothing of its speed.  The forward on fake CUDA runs the
recipe's model as one process (its kernels' and attention's CUDA paths at the real widths; the
multi-rank parts need CUDA streams a CPU build lacks: moevlm.plan.fake).  The recipes run in two
forked workers; two of the smallest stay in the fast tier."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gloo_ranks import result, run_forked, selected

from moevlm.config import compose_job, validate
from moevlm.plan.dry_run import forward_on_fake_cuda
from moevlm.plan.report import make_plan, role_ranks

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
EMULATORS = {
    "deepep": REPO / "tests" / "dispatch" / "deep_ep_emulator",
    "hybridep": REPO / "tests" / "dispatch" / "hybrid_ep_emulator",
}


def shallow(name: str) -> list[str]:
    job = compose_job([f"+experiment={name}", "data.shards=sample"])
    pp = job.parallel.pp
    return [
        f"+experiment={name}",
        "data.shards=sample",
        f"model.num_layers={2 * pp}",
        "model.vision_depth=2",
    ]


# the recipes whose dry runs take seconds, not tens: the fast tier's
FAST = ("h100_1gpu", "sweep_tuning")


@pytest.fixture(scope="module")
def computed(request):
    """Each selected recipe's plan and forward on fake CUDA, in two forked workers (the largest first)."""
    names = sorted(selected(request, "name"), key=lambda n: (n in FAST, n))
    return dict(zip(names, run_forked(_plan_and_forward, [(n,) for n in names], keep_errors=True)))


def _plan_and_forward(name: str) -> tuple[dict, dict]:
    """make_plan at the recipe's launch size and the one-process forward on fake CUDA."""
    overrides = shallow(name)
    job = compose_job(overrides)
    emulator = EMULATORS.get(job.model.dispatcher)
    path = list(sys.path)
    if emulator is not None:  # this worker's deep_ep is the emulator, for this recipe only
        sys.path.insert(0, str(emulator))
        sys.modules.pop("deep_ep", None)
    one = compose_job(
        overrides
        + [
            "parallel.world_size=1",
            "parallel.tp=1",
            "parallel.cp=1",
            "parallel.pp=1",
            "parallel.ep=1",
            "parallel.etp=1",
        ]
        + ["model.dispatcher=auto"]
    )
    try:
        return make_plan(job, job.parallel.world_size or 1, "gb200"), forward_on_fake_cuda(one)
    finally:
        sys.path[:] = path
        sys.modules.pop("deep_ep", None)


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in RECIPES]
)
def test_recipe_dry_run(name, computed):
    job = compose_job(shallow(name))
    world = job.parallel.world_size or 1
    out, found = result(computed[name])
    plan = validate(job, world, environment=False)
    assert [r["rank"] for r in out["ranks"]] == role_ranks(plan)
    # AdamW's two moments of every trained parameter, in optim.state_dtype (bf16: half the bytes);
    # with LoRA adapters the frozen base has no gradient and no optimizer state
    moment = 0.5 if job.optim.state_dtype == "bfloat16" else 1.0
    for r in out["ranks"]:
        if job.model.lora_rank:
            assert 0 < r["grads_bytes"] < r["params_bytes"] < r["peak_bytes"]
        else:
            assert 0 < r["params_bytes"] == r["grads_bytes"] < r["peak_bytes"]
        assert r["optimizer_bytes"] >= 2 * moment * r["grads_bytes"]
        assert r["activation_peak_bytes"] > 0
        if world > 1:
            assert r["comm_bytes"], name
    if plan.dims.ep > 1:  # the token exchange is counted on the expert-parallel group
        assert any("ep" in group.split("/") for group in out["ranks"][0]["comm_bytes"]), name
    assert found["loss_device"] == torch.device("cuda", 0) and found["loss_dtype"] == torch.float32
