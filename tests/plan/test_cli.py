"""`python -m moevlm.plan` as a user runs it (in-process, `main(argv)`): the plan's table and JSON
with their exit statuses (0 fits, 9 does not fit, 2 a config error), and `--search` with `--only`."""

from __future__ import annotations

import json

import pytest

from moevlm.plan.cli import main, parse_only
from moevlm.plan.report import format_plan
from moevlm.train.exit_codes import ExitCode

TINY = ["train.global_batch_size=4", "data.streams=2"]


def test_a_plan_prints_its_verdict_and_exits_by_it(capsys):
    assert main(["+experiment=h100_1gpu"]) == ExitCode.DOES_NOT_FIT
    out = capsys.readouterr().out
    assert out.startswith("plan: 1 x H100 SXM 80GB") and "verdict: does NOT fit H100" in out
    assert main([*TINY, "--world", "2", "parallel.ep=2", "--json"]) == ExitCode.OK
    plan = json.loads(capsys.readouterr().out)
    assert plan["world"] == 2 and plan["gpu"] == "h100" and plan["fits"] and plan["bubble"] == 0
    (rank,) = plan["ranks"]  # the two ranks of one stage hold the same shapes: one role
    assert {"rank", "role", "params_bytes", "peak_bytes", "comm_bytes", "fits"} <= set(rank)
    # groups of the same ranks share one entry, their roles joined: ep 2 is the data-parallel pair
    assert rank["comm_bytes"]["dp/dense/vision/ep"]["all_to_all"] > 0
    assert main([*TINY, "--world", "2", "parallel.tp=3"]) == ExitCode.CONFIG
    assert capsys.readouterr().err.startswith("config error: ")
    assert main(["--gpu", "a100"]) == ExitCode.CONFIG
    assert "choose one of h100, h200, b200, gb200" in capsys.readouterr().err


def test_search_ranks_the_layouts_of_the_space_it_is_given(capsys):
    only = ["--only", "pp=1", "--only", "tp=1", "--only", "cp=1", "--only", "recompute=none,full"]
    assert main([*TINY, "--world", "2", "--search", "--top", "3", *only]) == ExitCode.OK
    captured = capsys.readouterr()
    text = captured.out
    assert text.startswith("## Layouts on 2 x H100 SXM 80GB")
    table = text.split("| # | tp |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    rows = [[c.strip() for c in row.split("|")[1:-1]] for row in table]
    # ep 1 and 2 without recompute rank first; full recompute of a layout that fits is dominated
    assert [(r[0], r[5], r[9]) for r in rows] == [("1", "1", "none"), ("2", "2", "none")]
    assert "dominated: recompute=none of this layout fits" in text
    assert "peak" in captured.err  # the progress lines
    assert main([*TINY, "--world", "2", "--search", "--json", *only]) == ExitCode.OK
    result = json.loads(capsys.readouterr().out)
    assert sorted(e["layout"]["ep"] for e in result["top"]) == [1, 2]
    assert result["space"]["recompute"] == ["none", "full"] and result["complete"]
    assert parse_only(["ep=1,2", "etp=tp"]) == {"ep": [1, 2], "etp": ["tp"]}
    assert main([*TINY, "--world", "2", "--search", "--only", "pp"]) == ExitCode.CONFIG
    assert "expected FIELD=V1,V2" in capsys.readouterr().err
    assert main([*TINY, "--world", "2", "--search", "--only", "zz=1"]) == ExitCode.CONFIG
    assert "the candidate fields are" in capsys.readouterr().err


def test_a_plan_under_hsdp_shards_within_replicas_and_reports_its_groups(capsys):
    """dp_replicate 2 on 4 ranks: parameters, gradients and optimizer state sharded over 2, not 4
    (twice FSDP's bytes); FSDP's collectives on the shard groups of 2, the gradients' all-reduce
    across the 2 replicas; each group reported with its size and its bytes on the wire."""
    plans = {}
    for r in (1, 2):
        argv = ["train.global_batch_size=4", "data.streams=4", "--world", "4", "--json"]
        assert main([*argv, f"parallel.dp_replicate={r}"]) == ExitCode.OK
        plans[r] = json.loads(capsys.readouterr().out)
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
    only = [
        f"--only={f}"
        for f in ("pp=1", "tp=1", "cp=1", "ep=1", "recompute=none", "dp_replicate=1,2")
    ]
    assert (
        main(
            [
                "train.global_batch_size=4",
                "data.streams=4",
                "--world",
                "4",
                "--search",
                "--json",
                *only,
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert sorted(e["layout"]["dp_replicate"] for e in result["top"]) == [1, 2]
