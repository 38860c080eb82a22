"""The planner's options are checked like the trainer's: a count that is not a whole number >= 1 or an
--only value its field cannot take is one `config error:` line and exit 2, before anything is planned."""

from __future__ import annotations

import pytest

from moevlm.plan import cli
from moevlm.plan.cli import parse_only
from moevlm.train.exit_codes import ExitCode

CASES = {
    "--top 0": "argument --top: expected a whole number >= 1, not '0'",
    "--top -5": "argument --top: expected a whole number >= 1, not '-5'",
    "--world 0": "argument --world: expected a whole number >= 1, not '0'",
    "--max-dry-runs -1": "argument --max-dry-runs: expected a whole number >= 1, not '-1'",
    "--top x": "argument --top: expected a whole number >= 1, not 'x'",
    "--only tp=abc": "--only 'tp=abc': tp takes positive whole numbers, not 'abc'",
    "--only pp=0": "--only 'pp=0': pp takes positive whole numbers, not '0'",
    "--only dp_mode=1": "--only 'dp_mode=1': dp_mode takes 'fsdp' or 'ddp', not '1'",
    "--only etp=tq": "--only 'etp=tq': etp takes positive whole numbers or 'tp', not 'tq'",
}


@pytest.mark.parametrize("option", CASES, ids=lambda s: s.replace(" ", ""))
def test_a_bad_option_is_one_line_and_exit_2(option, capsys, monkeypatch):
    def never(*a, **kw):
        raise AssertionError("composed a job although an option was refused")

    monkeypatch.setattr("moevlm.config.compose_job", never)
    if option.startswith("--only"):  # checked once the job is composed: the real composition
        monkeypatch.undo()
    try:
        code = cli.main(["--search", "--world", "2", *option.split()])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == ExitCode.CONFIG == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: "), err
    assert CASES[option] in lines[0] and "Traceback" not in err and out == ""


def test_only_keeps_the_values_fields_take():
    only = ["pp=1,2", "etp=tp,1", "dp_replicate=nodes,2", "recompute=none,full", "dp_mode=ddp"]
    assert parse_only(only) == {
        "pp": [1, 2],
        "etp": ["tp", 1],
        "dp_replicate": ["nodes", 2],
        "recompute": ["none", "full"],
        "dp_mode": ["ddp"],
    }
