"""`model.dispatcher=auto` (the default) resolved by validate() from the layout alone (no processes):
`local` when no token leaves its rank, `alltoall` otherwise; an explicit name wins; `local` with ep > 1
stays refused with its message."""

from __future__ import annotations

from pathlib import Path

import pytest

from moevlm.config import ModelConfig, compose_job, validate
from moevlm.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SHARDS = "data.shards='/datasets/shards/{000000..000999}.tar'"


def test_auto_is_the_default():
    assert ModelConfig().dispatcher == "auto" and compose_job([]).model.dispatcher == "auto"


@pytest.mark.parametrize(
    "overrides, world, want",
    [
        ([], 1, "local"),
        (
            ["parallel.dp=2", "train.global_batch_size=2"],
            2,
            "local",
        ),  # data parallel only: tokens stay
        (["parallel.tp=2"], 2, "local"),  # experts whole per rank: ep x etp = 1
        (["parallel.ep=2", "train.global_batch_size=2"], 2, "alltoall"),
        (["parallel.tp=2", "parallel.etp=2"], 2, "alltoall"),  # ep=1 but ETP gathers tokens
        (["parallel.ep=4", "train.global_batch_size=4"], 4, "alltoall"),
    ],
)
def test_auto_picks_from_the_layout(overrides, world, want):
    plan = validate(compose_job(overrides), world)
    assert plan.dispatcher.name == want  # the concrete name, carried by the model config
    chose = [n for n in plan.notes if n.startswith("model.dispatcher=auto chose")]
    if want == "local":
        assert chose == []
    else:  # one line for the log, naming the layout and how to choose another
        d = plan.dims
        assert chose == [
            f"model.dispatcher=auto chose alltoall: parallel.ep x etp = {d.ep} x {d.etp} > 1 moves "
            "tokens between ranks"
        ]


# (deepep, hybridep: tests/dispatch/test_availability.py)
@pytest.mark.parametrize("name", ["local", "alltoall"])
def test_an_explicit_dispatcher_wins(name):
    plan = validate(compose_job([f"model.dispatcher={name}"]), 1)
    assert plan.dispatcher.name == name and plan.notes == []
    if name != "local":
        plan = validate(
            compose_job([f"model.dispatcher={name}", "parallel.ep=2", "train.global_batch_size=2"]),
            2,
        )
        assert plan.dispatcher.name == name and plan.notes == []


def test_local_with_expert_parallel_and_unknown_names_are_refused():
    with pytest.raises(ConfigError) as err:
        validate(
            compose_job(["model.dispatcher=local", "parallel.ep=2", "train.global_batch_size=2"]), 2
        )
    assert str(err.value) == (
        "parallel.ep=2 moves tokens between ranks: model.dispatcher='local' cannot; choose "
        "alltoall (or auto)"
    )
    with pytest.raises(ConfigError) as err:
        validate(compose_job(["model.dispatcher=a2a"]), 1)
    assert (
        str(err.value)
        == "model.dispatcher='a2a'; choose auto or one of ['local', 'alltoall', 'deepep', 'hybridep']"
    )


@pytest.mark.parametrize(
    "path", sorted((REPO / "conf" / "experiment").glob("*.yaml")), ids=lambda p: p.stem
)
def test_experiments_resolve_to_a_concrete_dispatcher(path):
    """The recipes with ep > 1 rely on auto for alltoall; one GPU is local; h100_deepep names deepep and
    gb200_hybridep hybridep (their adapters are built; checked for another machine, so the package is not
    looked for)."""
    job = compose_job([f"+experiment={path.stem}", SHARDS])
    named = {"h100_deepep": "deepep", "gb200_hybridep": "hybridep"}
    if path.stem in named:
        assert (
            validate(job, job.parallel.world_size, environment=False).dispatcher.name
            == named[path.stem]
        )
        return
    # GPU recipes, checked here
    plan = validate(job, job.parallel.world_size or 1, environment=False)
    want = "alltoall" if plan.dims.ep * plan.dims.etp > 1 else "local"
    assert plan.dispatcher.name == want
    assert path.stem != "h200_1gpu" or want == "local"
