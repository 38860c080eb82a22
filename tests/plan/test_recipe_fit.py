"""Every recipe of conf/experiment/ fits the GPU it is named for at its launch size: pipeline rank 0's
peak at the recipe's real depth and widths (extrapolated from reduced dry runs on fake tensors, as
`python -m moevlm.plan +experiment=NAME --fit` estimates it), at most 90% of that GPU's memory.
Modelled dispatchers (DeepEP, HybridEP) need no package.  The recipes run in two forked workers; the
full plans of every rank role are in docs/plans.md (`python bench/plans.py recipes`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gloo_ranks import result, run_forked, selected

from moevlm.config import compose_job
from moevlm.plan.devices import gpu, recipe_gpu

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
GIB = 2**30


def _base(name: str) -> tuple[float, bool]:
    """The recipe as it is on its own GPU: (peak bytes of pp rank 0, fits)."""
    from moevlm.plan.fit import fit

    job = compose_job([f"+experiment={name}", "data.shards=sample"])
    out = fit(job, job.parallel.world_size or 1, recipe_gpu(name))
    return out.base.peak_bytes, out.base.fits


@pytest.fixture(scope="module")
def planned(request):
    names = selected(request, "name")
    return dict(zip(names, run_forked(_base, [(n,) for n in names], keep_errors=True)))


# the estimates take about a minute each at full depth (the 235B recipe longer)
@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_fits_its_gpu(name, planned):
    peak, fits = result(planned[name])
    g = gpu(recipe_gpu(name))
    assert fits and peak <= 0.9 * g.memory_bytes, (
        f"{name}: planned peak {peak / GIB:.1f} GiB on {g.name} "
        f"(usable {(g.memory_bytes - g.headroom_bytes) / GIB:.1f} GiB): "
        f"python -m moevlm.plan +experiment={name} --fit"
    )
