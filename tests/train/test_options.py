"""The option reference (moevlm.config.reference): every field described once, in its dataclass, and shown by
`python train.py --help` and docs/configuration.md with the allowed values validation checks against."""

import copy
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from moevlm.kernels import GROUPED_GEMMS
from omegaconf import OmegaConf

from moevlm.config import JobConfig, compose_job, schema, validate
from moevlm.config import reference as opt
from moevlm.errors import ConfigError
from moevlm.parallel.pipeline_schedules import SCHEDULES

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _leaf_paths(node, prefix=""):
    """The schema's leaves as OmegaConf sees them (independent of options.sections)."""
    for key, value in node.items():
        if OmegaConf.is_dict(value):
            yield from _leaf_paths(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_every_field_of_the_job_is_listed_with_a_description():
    paths = [o.path for o in schema.options()]
    assert sorted(paths) == sorted(_leaf_paths(OmegaConf.structured(JobConfig)))
    assert schema.missing_help() == []
    assert all(doc for _, doc, _ in schema.sections())


def test_a_field_added_without_a_description_is_named():
    @dataclass
    class Section:  # no docstring either
        documented: int = field(default=1, metadata={"help": "has one"})
        bare: int = 0

    @dataclass
    class Job:
        train: Section = field(default_factory=Section)

    assert schema.missing_help(Job) == ["train.bare", "train"]


def test_allowed_values_are_the_ones_validation_refuses_others_for():
    """Each listed choice field names a real field, and validation refuses a value outside its list."""
    paths = {o.path for o in schema.options()}
    allowed = opt.allowed_values()
    assert set(allowed) <= paths, "allowed_values() names fields the schema no longer has"
    assert set(GROUPED_GEMMS) <= set(allowed["model.grouped_gemm"])
    assert allowed["parallel.pp_schedule"] == tuple(SCHEDULES)
    job = compose_job(["data.shards=sample"])
    validate(job)
    for path in allowed:
        bad = copy.deepcopy(job)
        value = f"no_such_{path}"
        OmegaConf.update(
            bad, path, [value] if OmegaConf.is_list(OmegaConf.select(job, path)) else value
        )
        with pytest.raises(ConfigError, match=f"no_such_{path}"):
            validate(bad)


def test_composed_values_missing_and_unresolved_are_shown():
    job = OmegaConf.structured(JobConfig)
    job.data.shards = "???"
    job.train.steps = 7
    job.train.run_dir = "${oc.env:NO_SUCH_VARIABLE_FOR_MOEVLM}"
    lines = {
        line.split()[0]: line
        for line in opt.describe_options(job).splitlines()
        if line.startswith("  ")
    }
    assert "(int, default 20, set to 7)" in lines["train.steps"]
    assert "set to ??? (must be set)" in lines["data.shards"]
    assert "set to ${oc.env:NO_SUCH_VARIABLE_FOR_MOEVLM}" in lines["train.run_dir"]
    assert "set to" not in lines["train.seed"]


def _entries(text: str) -> dict[str, str]:
    """`--help` listing -> {path: its entry, wrapped lines joined}."""
    out, path = {}, None
    for line in text.splitlines():
        if line.startswith("  ") and not line.startswith("   ") and "  (" in line:
            path = line.split()[0]
            out[path] = line.strip()
        elif path and line.startswith("      "):
            out[path] += " " + line.strip()
        else:
            path = None
    return out


@pytest.mark.slow
def test_train_py_help_all_is_wrapped_and_shows_every_field_and_its_values():
    """`--help all`: no line over 100 columns; every section; every field with its description, and every
    enumerated one (allowed_values) with its values; what the command line sets."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT), COLUMNS="200")
    out = subprocess.run(
        [sys.executable, "train.py", "train.steps=7", "--help", "all"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert max(len(line) for line in text.splitlines()) <= opt.WIDTH
    for section, _, _ in schema.sections():
        assert f"== {section} ==" in text
    entries = _entries(text)
    assert sorted(entries) == sorted(o.path for o in schema.options())
    for o in schema.options():
        assert entries[o.path].endswith(" ".join(o.help.split())), entries[o.path]
        if o.allowed:
            assert f"of {'|'.join(o.allowed)})" in entries[o.path], o.path
    assert "(str, default fsdp; one of fsdp|ddp)" in entries["parallel.dp_mode"]
    assert "(str, default none; one of none|selective|full)" in entries["model.recompute"]
    assert "each of core_attn|" in entries["model.recompute_modules"]
    assert "(str, default skip; one of skip|stop)" in entries["train.nonfinite"]
    assert f"default 1f1b; one of {'|'.join(SCHEDULES)})" in entries["parallel.pp_schedule"]
    # the command line's own overrides
    assert "(int, default 20, set to 7)" in entries["train.steps"]
    assert "experiment: gb200_3d, gb200_fsdp" in text  # the config groups


def test_help_overview_and_sections(monkeypatch):
    """Plain `--help`: the groups and every section with its fields' names; `--help SECTION`: those
    sections (a name selects its subsections) in full; an unknown name is refused, naming them."""
    try:
        opt.show_sections([])
        short = opt.help_listing(width=100)
        assert max(len(line) for line in short.splitlines()) <= 100
        assert (
            len(short.splitlines()) < 80 and "recompute_modules" in short and "(str," not in short
        )
        assert all(f"\n{name}  " in short for name in opt.section_names())
        opt.show_sections(["data", "optim"])
        picked = _entries(opt.help_listing(width=80))
        assert {p.split(".")[0] for p in picked} == {
            "data",
            "optim",
        } and "data.pack.seq_len" in picked
        with pytest.raises(
            ValueError, match="--help nosuch: no such section; choose among all, model"
        ):
            opt.show_sections(["nosuch"])
    finally:
        opt.show_sections([])


def test_an_enumerated_field_lists_its_values():
    """A text field whose validation refuses an unknown value with a list to choose from is in
    allowed_values() (so --help and conf/README.md show the list): found by trying one on each."""
    job = compose_job(["data.shards=sample"])
    allowed, missed = opt.allowed_values(), []
    for o in schema.options():
        if o.path in allowed or o.type not in ("str", "[str]", "list", "any"):
            continue
        bad = copy.deepcopy(job)
        OmegaConf.update(
            bad, o.path, ["no_such_x"] if o.type.startswith(("[", "list")) else "no_such_x"
        )
        try:
            validate(bad, environment=False)
        except ConfigError as err:
            lines = [x for x in str(err).splitlines() if "no_such_x" in x]
            if any("choose" in x or "one of" in x for x in lines):
                missed.append(o.path)
    assert missed == []


def test_configuration_reference_is_generated_from_the_dataclasses():
    path = os.path.join(ROOT, "docs/configuration.md")
    with open(path) as f:
        text = f.read()
    assert opt.with_options(text) == text, (
        "docs/configuration.md's option reference is stale: run python -m moevlm.config.reference --write"
    )
    for o in schema.options():
        assert f"| `{o.path}` |" in text


def test_readme_without_markers_is_refused_with_what_to_add():
    with pytest.raises(ValueError, match="lacks the markers"):
        opt.with_options("# conf/\n")
