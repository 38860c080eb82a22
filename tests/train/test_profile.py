"""train.profile_components / train.profile_steps (moevlm.train.profile).

One tiny trainer run (sample data with images, two micro-batches per step) checks the metrics, the end
table and the trace; the timer's accounting (nesting, recomputation) is checked without a trainer.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moevlm.config import compose_job, validate
from moevlm.config.train_checks import check_profile
from moevlm.errors import ConfigError
from moevlm.model import Qwen3VLMoe
from moevlm.model.config import VLMConfig
from moevlm.train.profile import COMPONENTS, ComponentTimer, WallClock, parse_profile_steps
from moevlm.train.trainer import Trainer

SMALL = [
    "data.num_workers=1",
    "data.streams=1",
    "train.log_every=1",
    "train.tensorboard=false",
    "data.pack.seq_len=256",
    "data.pack.max_patches=64",
    "train.checkpoint_at_end=false",
    "train.require_loss_decrease=false",
]
NAMED = [c for c in COMPONENTS if c != "other"]


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("profiled")
    job = compose_job(
        SMALL
        + [
            "train.steps=3",
            f"train.run_dir={run_dir}",
            "train.profile_components=true",
            "train.profile_steps='2,2'",
        ]
    )
    code = Trainer(job).run()
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, code, recs


def test_components_account_for_the_step(profiled_run):
    run_dir, code, recs = profiled_run
    assert code == 0 and [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        c, step = r["components_s"], r["step_time_s"]
        assert list(c) == list(COMPONENTS)
        # the tiny MoE model with images runs every part
        assert all(c[name] > 0 for name in NAMED), c
        assert c["other"] >= -1e-6 * step  # the named parts never overlap
        assert abs(sum(c.values()) - step) <= 0.10 * step, (sum(c.values()), step)
        # what is left untimed (embedding, norms, residuals, masks, the aux loss, all-reduces) is a minor
        # share: ~7-16% measured on a loaded 2-core machine; 40% leaves room for scheduling noise
        assert sum(c[name] for name in NAMED) >= 0.60 * step, c


def test_end_table_and_trace(profiled_run):
    run_dir, _, _ = profiled_run
    table = (run_dir / "profile_components.md").read_text()
    for name in COMPONENTS:
        assert f"| {name} |" in table
    assert "| step (measured) |" in table
    trace = json.loads((run_dir / "profile" / "rank0_steps2-2.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {f"moevlm.{n}" for n in NAMED} <= names


class TickClock(WallClock):
    """Each mark is one tick later: interval lengths count the marks between their ends."""

    def __init__(self):
        self.t = 0

    def mark(self) -> float:
        self.t += 1
        return float(self.t)


def test_nested_intervals_are_exclusive():
    timer = ComponentTimer(TickClock(), ranges=False)  # reset: tick 1
    timer.open("vision_encoder")  # 2
    timer.open("merger")  # 3
    timer.close("merger")  # 4
    timer.close("vision_encoder")  # 5
    timer.open("backward")  # 6
    timer.close("backward")  # 7
    parts, total = timer.step_seconds()  # end: 8
    assert (
        total == 7
        and parts["merger"] == 1
        and parts["vision_encoder"] == 2
        and parts["backward"] == 1
    )
    assert parts["other"] == 7 - 3 - 1 and sum(parts.values()) == total
    with pytest.raises(RuntimeError, match="unbalanced"):
        timer.open("a"), timer.close("b")


@pytest.mark.parametrize("reentrant", [False, True])
def test_recomputed_regions_count_once(reentrant):
    torch.manual_seed(0)
    model = Qwen3VLMoe(VLMConfig.preset("tiny"))
    layers = list(model.text.layers)
    calls = []
    # activation recompute as torch.utils.checkpoint does it, around every layer
    for layer in layers:
        layer.self_attn.register_forward_pre_hook(lambda *_: calls.append(1))
        layer.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=reentrant))(
            layer.forward
        )
    timer = ComponentTimer(WallClock(), ranges=False)
    timer.attach(model)
    ids = torch.randint(0, 100, (1, 16))
    model(ids, labels=ids).loss.backward()
    assert len(calls) == 2 * len(layers)  # the hooks did run again during backward ...
    assert timer.names.count("attention") == len(layers)  # ... and were not counted there
    assert timer.names.count("lm_head_loss") == 2 and not timer.stack  # the head and lm_loss
    timer.detach()
    assert "lm_loss" not in model.__dict__ and not model.lm_head._forward_hooks


@pytest.mark.parametrize(
    "value, expected",
    [
        ("", None),
        (None, None),
        ([], None),
        ("2,3", (2, 3)),
        ([1, 4], (1, 4)),
        (3, (3, 3)),
        ("4", (4, 4)),
    ],
)
def test_profile_steps_accepted(value, expected):
    assert parse_profile_steps(value, steps=4) == expected


@pytest.mark.parametrize("value", ["3,2", [0, 2], "1,5", "a,b", [1, 2, 3], True])
def test_profile_steps_refused(value):
    with pytest.raises(ConfigError, match=r"train.profile_steps=.*1 <= A <= B <= train.steps=4"):
        parse_profile_steps(value, steps=4)


def test_validation_names_profile_problems():
    with pytest.raises(ConfigError, match=r"train.profile_steps=.*train.steps=3"):
        validate(compose_job(SMALL + ["train.steps=3", "train.profile_steps=[2,7]"]))
    with pytest.raises(ConfigError, match="profile eagerly"):
        check_profile(
            SimpleNamespace(profile_components=True, compile=True, profile_steps="", steps=3)
        )
    check_profile(
        SimpleNamespace(profile_components=True, compile=False, profile_steps="", steps=3)
    )
