"""bench/host_time.py on the tiny model at 2 and 4 decoder layers (a check that each framework's
step runs; no timing is compared): positive host times, op counts growing with depth, the table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moevlm.config import compose_job

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import host_time  # noqa: E402


@pytest.fixture(scope="module")
def jobs():
    return {n: compose_job(["data.shards=sample", f"model.num_layers={n}"]) for n in (2, 4)}


def _check(result: dict) -> None:
    assert "na" not in result, result.get("na")
    assert all(ms > 0 for ms in result["ms"].values())
    assert 0 < result["ops"][2] < result["ops"][4]
    assert host_time.per_layer(result["ops"]) > 0


def test_moevlm_and_transformers_steps(jobs):
    pytest.importorskip("transformers")
    results = host_time.run(jobs, ["moevlm", "transformers"], repeats=1)
    for name in ("moevlm", "transformers"):
        _check(results[name])
    rows = host_time.table(results, 4).splitlines()
    assert rows[2].startswith("| moevlm |") and "1.00x, 1.00x" in rows[2]
    assert rows[3].startswith("| transformers |")


def test_torchtitan_step(jobs):
    pytest.importorskip(
        "torchtitan.models.qwen3", reason=f"torchtitan not installed: {host_time.TITAN_HOW}"
    )
    _check(host_time.run(jobs, ["torchtitan"], repeats=1)["torchtitan"])
