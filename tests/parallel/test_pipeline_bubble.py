"""The simulated pipeline bubble of torch's schedules: GPipe and 1F1B reproduce the textbook
(p-1)/(m+p-1) exactly (a check of the simulator, not only of torch), more stages per rank shrink
the bubble, the zero-bubble schedules give a fraction in [0, 1), and a configuration torch refuses
is a ValueError that names the configuration and torch's reason."""

from __future__ import annotations

from fractions import Fraction

import pytest

from moevlm.model import VLMConfig
from moevlm.parallel.pipeline_bubble import (
    ScheduleRefused,
    schedule_bubble,
    simulate_schedule,
)
from moevlm.parallel.pipeline_split import split_pipeline

PM = [(2, 2), (2, 8), (3, 5), (4, 4), (4, 8)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", PM)
def test_gpipe_and_1f1b_match_the_textbook_formula_exactly(schedule, p, m):
    exact = Fraction(p - 1, m + p - 1)
    assert simulate_schedule(schedule, p, m).bubble == exact
    assert schedule_bubble(schedule, p, m) == float(exact)


def test_1f1b_last_rank_repair_is_reported():
    """torch 2.11/2.13 number the last rank's 1F1B forwards 1..m; the repair is what makes the
    formula above hold, and the run says it was applied (False once torch fixes its IR)."""
    run = simulate_schedule("1f1b", 4, 8)
    assert isinstance(run.repaired_1f1b, bool)
    assert run.busy == (24,) * 4 and run.makespan == 33
    assert run.placement == {r: [r] for r in range(4)}


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8)])
def test_interleaved_is_below_1f1b(p, m):
    one = schedule_bubble("1f1b", p, m)
    two = schedule_bubble("interleaved_1f1b", p, m, vpp=2)
    # the aliases of pipeline_schedules.schedule_name are accepted
    assert schedule_bubble("Interleaved1F1B", p, m, vpp=2) == two
    assert 0 < two < one
    assert two == float(Fraction(p - 1, 2 * m + p - 1))


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("p,m", [(2, 8), (4, 8)])
def test_zero_bubble_schedules_give_a_fraction(schedule, p, m):
    b = schedule_bubble(schedule, p, m, vpp=2)
    assert 0 <= b < 1
    assert b < schedule_bubble("1f1b", p, m)
    run = simulate_schedule(schedule, p, m, vpp=2)
    assert run.placement == {r: sorted({r, 2 * p - 1 - r}) for r in range(p)}  # the V


@pytest.mark.parametrize(
    "args,match",
    [
        (
            ("1f1b", 4, 2, 1),
            r"torch refuses 1f1b with pp=4, microbatches=2, vpp=1: ValueError: Number of "
            r"microbatches \(2\) must be",
        ),
        (("dualpipev", 4, 4, 2), r"torch refuses dualpipev with pp=4, microbatches=4, vpp=2: "),
        (("gpipe", 2, 8, 2), r"torch refuses gpipe with pp=2, microbatches=8, vpp=2: "),
    ],
)
def test_refused_configuration_is_a_readable_value_error(args, match):
    with pytest.raises(ValueError, match=match) as info:
        schedule_bubble(*args)
    assert isinstance(info.value, ScheduleRefused) and "\n" not in str(info.value)


def test_unknown_schedule_is_a_value_error():
    with pytest.raises(ValueError, match=r"'1f2b'; choose one of"):
        schedule_bubble("1f2b", 2, 8)


def test_pipeline_split_reports_its_bubble():
    cfg = VLMConfig.preset("tiny")
    cfg.text.num_layers = 4
    budgets = dict(layers="auto", rows=1, seq_len=256, max_patches=64, image_patches=16)
    plan = split_pipeline(cfg, pp=2, vpp=None, schedule="1f1b", microbatches=8, **budgets)
    assert plan.bubble == float(Fraction(1, 9))
    zbv = split_pipeline(cfg, pp=2, vpp=None, schedule="zbv", microbatches=8, **budgets)
    assert zbv.bubble == schedule_bubble("zbv", 2, 8, vpp=2)
