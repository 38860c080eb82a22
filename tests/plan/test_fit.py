"""The fit check (`python -m moevlm.plan ... --fit GPU`, moevlm/plan/fit.py) on the tiny job of 2 ranks
against GPUs registered for the test: one the job fits needs nothing; one 1% too small for it gets the
cheapest change proposed (recompute first), listed in cost order, and the job with the proposal applied
fits it in a whole plan of every rank role; one too small for anything lists every change it tried in
the guidance's order, cheapest first within a step, each step starting from the best of the one before.
In two forked workers."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from gloo_ranks import result, run_forked, selected

from moevlm.plan.fit import CHANGES
from moevlm.train.exit_codes import ExitCode

JOB = ["data.shards=sample", "train.global_batch_size=4", "data.streams=2"]
TINY = [*JOB, "--world", "2"]
GIB = 2**30
HEADROOM = 4 * GIB  # a small GPU's headroom (moevlm.plan.devices.Gpu.headroom_bytes)


def order_key_of(t: dict) -> tuple:
    """moevlm.plan.fit.order_key of a listed change (its JSON)."""
    return (t["error"] is not None, t["step"], t["cost_s"])


def _register(name: str, usable: float) -> None:
    from moevlm.plan import devices

    devices.GPUS[name] = devices.Gpu(name, HEADROOM + usable, 100.0, 450, 50, 8)


def _cli(argv: list[str]) -> tuple[int, str]:
    from moevlm.plan.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return int(code), out.getvalue()


def _roomy_then_snug() -> dict:
    """`--fit` against a GPU the job fits; then against one 1% smaller than its peak (the fit check's
    API and its report), and a whole plan of the job with the proposal on that GPU."""
    from moevlm.config import compose_job
    from moevlm.plan.fit import fit, format_fit

    _register("roomy", 1000 * GIB)
    roomy = _cli([*TINY, "--fit", "roomy", "--json"])
    base_peak = json.loads(roomy[1])["base"]["peak_bytes"]
    _register("snug", 0.99 * base_peak)
    found = fit(compose_job(JOB), 2, "snug")
    out = {"roomy": roomy, "found": found.as_dict(), "text": format_fit(found), "plan": None}
    if found.proposal is not None:
        code, plan = _cli([*TINY, "--gpu", "snug", "--json", *found.proposal.overrides()])
        out["plan"] = (code, json.loads(plan))
    return out


def _nothing_fits() -> tuple[int, dict]:
    _register("tiny", 1.0)  # one byte
    code, text = _cli([*TINY, "--fit", "tiny", "--json"])
    return code, json.loads(text)


WORK = {"snug": _roomy_then_snug, "nothing": _nothing_fits}


def _run(which: str):
    return WORK[which]()


@pytest.fixture(scope="module")
def ran(request):
    names = sorted(set(selected(request, "which")))
    return dict(zip(names, run_forked(_run, [(n,) for n in names], keep_errors=True)))


@pytest.mark.parametrize("which", ["snug"])
def test_the_cheapest_change_is_proposed_and_fits_when_applied(ran, which):
    r = result(ran[which])
    code, text = r["roomy"]
    assert code == ExitCode.OK and json.loads(text)["fits_as_it_is"]
    assert json.loads(text)["tried"] == []  # nothing to change, nothing tried
    found = r["found"]
    assert not found["fits_as_it_is"]
    proposal = found["proposal"]
    assert proposal is not None and proposal["fits"] and proposal["step"] == 1  # recompute first
    assert proposal["peak_bytes"] <= found["usable_bytes"] < found["base"]["peak_bytes"]
    assert proposal["changes"]["model.recompute"] == "selective"  # selective before full
    fitting = [t for t in found["tried"] if t["fits"]]
    assert fitting[0] == proposal
    keys = [order_key_of(t) for t in found["tried"]]
    assert keys == sorted(keys)
    assert "proposal: " + " ".join(proposal["overrides"]) in r["text"]
    plan_code, plan = r["plan"]  # the job with the proposal applied, every rank role planned whole
    assert plan_code == ExitCode.OK and plan["fits"]
    assert max(rank["peak_bytes"] for rank in plan["ranks"]) <= found["usable_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["nothing"])
def test_a_gpu_too_small_lists_every_change_tried_in_cost_order(ran, which):
    code, out = result(ran[which])
    assert code == ExitCode.DOES_NOT_FIT
    assert not out["fits_as_it_is"] and out["proposal"] is None
    tried = out["tried"]
    assert {t["step"] for t in tried} == {c.step for c in CHANGES}  # every step of the table
    keys = [order_key_of(t) for t in tried]  # the listing's order (moevlm.plan.fit.order_key)
    assert keys == sorted(keys)
    recompute = [t for t in tried if t["step"] == 1 and t["error"] is None]
    assert len(recompute) == 4 and all(t["recompute_s"] >= 0 for t in recompute)
    # a later step starts from the best setting of the step before (here: full recompute)
    later = [t for t in tried if t["step"] > 1]
    assert later and all(t["changes"].get("model.recompute") == "full" for t in later)
    offload = [t for t in tried if t["step"] == 4 and t["error"] is None]
    assert offload and all(t["host_bytes"] > 0 for t in offload)
