"""`python -m moevlm.plan` as a user runs it (`main(argv)`, in two forked workers): the plan's table and
JSON with their exit statuses (0 fits, 9 does not fit, 2 a config error), and `--search` with `--only`."""

from __future__ import annotations

import contextlib
import io
import json
from collections import namedtuple

import pytest
from gloo_ranks import result, run_forked

from moevlm.plan.cli import main, parse_only
from moevlm.plan.report import format_plan
from moevlm.train.exit_codes import ExitCode

TINY = ["train.global_batch_size=4", "data.streams=2"]
ONLY = ["--only", "pp=1", "--only", "tp=1", "--only", "cp=1", "--only", "recompute=none,full"]
HSDP = ["train.global_batch_size=4", "data.streams=4", "--world", "4"]
HSDP_ONLY = [
    f"--only={f}" for f in ("pp=1", "tp=1", "cp=1", "ep=1", "recompute=none", "dp_replicate=1,2")
]
# every command line of each test (the searches and the full-size plan first: the longest)
CALLS = {
    "test_a_plan_prints_its_verdict_and_exits_by_it": [
        ["+experiment=h100_1gpu", "model.loss_chunk_tokens=0"],  # 72 GiB: does not fit
        [*TINY, "--world", "2", "parallel.ep=2", "--json"],
        [*TINY, "--world", "2", "parallel.tp=3"],
        ["--gpu", "a100"],
        [*TINY, "model.family=qwen3_5_moe"],
    ],
    "test_search_ranks_the_layouts_of_the_space_it_is_given": [
        [*TINY, "--world", "2", "--search", "--top", "3", *ONLY],
        [*TINY, "--world", "2", "--search", "--json", *ONLY],
        [*TINY, "--world", "2", "--search", "--only", "pp"],
        [*TINY, "--world", "2", "--search", "--only", "zz=1"],
    ],
    "test_a_plan_under_hsdp_shards_within_replicas_and_reports_its_groups": [
        [*HSDP, "--search", "--json", *HSDP_ONLY],
        [*HSDP, "--json", "parallel.dp_replicate=1"],
        [*HSDP, "--json", "parallel.dp_replicate=2"],
    ],
}
Captured = namedtuple("Captured", "out err")


@pytest.fixture(scope="module")
def ran(request):
    """Every command line of the tests this session runs: its exit status, stdout and stderr, in
    two forked workers."""
    names = {item.originalname for item in request.session.items if item.module is request.module}
    argvs = sorted(
        (argv for name, calls in CALLS.items() if name in names for argv in calls),
        key=lambda argv: "--search" not in argv and "+experiment=h100_1gpu" not in argv,
    )
    return dict(zip(map(tuple, argvs), run_forked(_main, [(a,) for a in argvs], keep_errors=True)))


def _main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


class _Cli:
    """`main(argv)` answered from `ran`; `readouterr()` the last call's output (as capsys's)."""

    def __init__(self, runs: dict):
        self.runs, self.last = runs, None

    def main(self, argv: list[str]) -> int:
        code, out, err = result(self.runs[tuple(argv)])
        self.last = Captured(out, err)
        return code

    def readouterr(self) -> Captured:
        return self.last


@pytest.fixture
def cli(ran):
    return _Cli(ran)


def test_a_plan_prints_its_verdict_and_exits_by_it(cli):
    assert cli.main(["+experiment=h100_1gpu", "model.loss_chunk_tokens=0"]) == ExitCode.DOES_NOT_FIT
    out = cli.readouterr().out
    assert out.startswith("plan: 1 x H100 SXM 80GB") and "verdict: does NOT fit H100" in out
    assert cli.main([*TINY, "--world", "2", "parallel.ep=2", "--json"]) == ExitCode.OK
    plan = json.loads(cli.readouterr().out)
    assert plan["world"] == 2 and plan["gpu"] == "h100" and plan["fits"] and plan["bubble"] == 0
    (rank,) = plan["ranks"]  # the two ranks of one stage hold the same shapes: one role
    assert {"rank", "role", "params_bytes", "peak_bytes", "comm_bytes", "fits"} <= set(rank)
    # groups of the same ranks share one entry, their roles joined: ep 2 is the data-parallel pair
    assert rank["comm_bytes"]["dp/dense/vision/ep"]["all_to_all"] > 0
    assert cli.main([*TINY, "--world", "2", "parallel.tp=3"]) == ExitCode.CONFIG
    assert cli.readouterr().err.startswith("config error: ")
    assert cli.main(["--gpu", "a100"]) == ExitCode.CONFIG
    assert "choose one of h100, h200, b200, gb200" in cli.readouterr().err
    # a model with Gated DeltaNet layers: the plan says their kernel is modelled (the others do not)
    assert "gdn_note" not in plan
    assert cli.main([*TINY, "model.family=qwen3_5_moe"]) == ExitCode.OK
    assert "gated deltanet: its chunked delta rule is planned as flash-linear-attention" in (
        cli.readouterr().out
    )


@pytest.mark.slow
def test_search_ranks_the_layouts_of_the_space_it_is_given(cli):
    assert cli.main([*TINY, "--world", "2", "--search", "--top", "3", *ONLY]) == ExitCode.OK
    captured = cli.readouterr()
    text = captured.out
    assert text.startswith("## Layouts on 2 x H100 SXM 80GB")
    table = text.split("| # | tp |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    rows = [[c.strip() for c in row.split("|")[1:-1]] for row in table]
    # ep 1 and 2 without recompute rank first; full recompute of a layout that fits is dominated
    assert [(r[0], r[5], r[9]) for r in rows] == [("1", "1", "none"), ("2", "2", "none")]
    assert "dominated: recompute=none of this layout fits" in text
    assert "peak" in captured.err  # the progress lines
    assert cli.main([*TINY, "--world", "2", "--search", "--json", *ONLY]) == ExitCode.OK
    result = json.loads(cli.readouterr().out)
    assert sorted(e["layout"]["ep"] for e in result["top"]) == [1, 2]
    assert result["space"]["recompute"] == ["none", "full"] and result["complete"]
    assert parse_only(["ep=1,2", "etp=tp"]) == {"ep": [1, 2], "etp": ["tp"]}
    assert cli.main([*TINY, "--world", "2", "--search", "--only", "pp"]) == ExitCode.CONFIG
    assert "expected FIELD=V1,V2" in cli.readouterr().err
    assert cli.main([*TINY, "--world", "2", "--search", "--only", "zz=1"]) == ExitCode.CONFIG
    assert "the candidate fields are" in cli.readouterr().err


@pytest.mark.slow
def test_a_plan_under_hsdp_shards_within_replicas_and_reports_its_groups(cli):
    """dp_replicate 2 on 4 ranks: parameters, gradients and optimizer state sharded over 2, not 4
    (twice FSDP's bytes); FSDP's collectives on the shard groups of 2, the gradients' all-reduce
    across the 2 replicas; each group reported with its size and its bytes on the wire."""
    plans = {}
    for r in (1, 2):
        assert cli.main([*HSDP, "--json", f"parallel.dp_replicate={r}"]) == ExitCode.OK
        plans[r] = json.loads(cli.readouterr().out)
    text = format_plan(plans[2])  # the table the command prints without --json
    (fsdp,), (hsdp,) = plans[1]["ranks"], plans[2]["ranks"]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert hsdp[key] == pytest.approx(2 * fsdp[key], rel=0.01), key
    groups = hsdp["comm_groups"]
    shard = next(k for k in groups if "dense_shard" in k.split("/"))
    replicas = next(k for k in groups if "dense_replicate" in k.split("/"))
    assert groups[shard]["ranks"] == groups[replicas]["ranks"] == 2
    assert set(hsdp["comm_bytes"][replicas]) == {"all_reduce"}
    # ring all-reduce over 2: 2 (n - 1) / n = 1 x what a rank puts in
    assert (
        groups[replicas]["wire_bytes"]["all_reduce"] == hsdp["comm_bytes"][replicas]["all_reduce"]
    )
    fsdp_group = next(k for k in fsdp["comm_groups"] if "dense" in k.split("/"))
    assert fsdp["comm_groups"][fsdp_group]["ranks"] == 4
    assert not any("replicate" in k for k in fsdp["comm_bytes"])
    assert (
        "dp 4 (replicate 2 x shard 2)" in text
        and "| dense_shard | 2 | nvlink | all_gather |" in text
    )
    # a search given the replicas ranks HSDP beside FSDP
    assert cli.main([*HSDP, "--search", "--json", *HSDP_ONLY]) == 0
    result = json.loads(cli.readouterr().out)
    assert sorted(e["layout"]["dp_replicate"] for e in result["top"]) == [1, 2]
