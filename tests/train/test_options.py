"""The option reference (moevlm.train.options): every field described once, in its dataclass, and shown by
`python train.py --help` and conf/README.md with the allowed values validation checks against."""

import copy
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from moevlm.kernels import GROUPED_GEMMS
from omegaconf import OmegaConf

from moevlm.model.config import ConfigError
from moevlm.parallel.pipeline_plan import SCHEDULES
from moevlm.train import options as opt
from moevlm.train.config import JobConfig, compose_job, validate

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _leaf_paths(node, prefix=""):
    """The schema's leaves as OmegaConf sees them (independent of options.sections)."""
    for key, value in node.items():
        if OmegaConf.is_dict(value):
            yield from _leaf_paths(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_every_field_of_the_job_is_listed_with_a_description():
    paths = [o.path for o in opt.options()]
    assert sorted(paths) == sorted(_leaf_paths(OmegaConf.structured(JobConfig)))
    assert opt.missing_help() == []
    assert all(doc for _, doc, _ in opt.sections())


def test_a_field_added_without_a_description_is_named():
    @dataclass
    class Section:  # no docstring either
        documented: int = field(default=1, metadata={"help": "has one"})
        bare: int = 0

    @dataclass
    class Job:
        train: Section = field(default_factory=Section)

    assert opt.missing_help(Job) == ["train.bare", "train"]


def test_allowed_values_are_the_ones_validation_refuses_others_for():
    """Each listed choice field names a real field, and validation refuses a value outside its list."""
    paths = {o.path for o in opt.options()}
    allowed = opt.allowed_values()
    assert set(allowed) <= paths, "allowed_values() names fields the schema no longer has"
    assert set(GROUPED_GEMMS) <= set(allowed["model.grouped_gemm"])
    assert allowed["parallel.pp_schedule"] == tuple(SCHEDULES)
    job = compose_job(["data.shards=sample"])
    validate(job)
    for path in allowed:
        bad = copy.deepcopy(job)
        OmegaConf.update(bad, path, f"no_such_{path}")
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


def test_train_py_help_shows_every_field_its_description_and_allowed_values():
    env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT))
    out = subprocess.run(
        [sys.executable, "train.py", "train.steps=7", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for o in opt.options():
        line = next((ln for ln in text.splitlines() if ln.split()[:1] == [o.path]), None)
        assert line is not None, f"{o.path} missing from train.py --help"
        assert line.endswith(o.help), line
    assert "parallel.dp_mode" in text and "(str, default fsdp; one of fsdp|ddp)" in text
    assert "(str, default skip; one of skip|stop)" in text
    assert f"default 1f1b; one of {'|'.join(SCHEDULES)})" in text
    assert "(int, default 20, set to 7)" in text  # the command line's own overrides
    assert "experiment: gb200_3d, gb200_fsdp" in text  # Hydra's group listing is kept


def test_conf_readme_reference_is_generated_from_the_dataclasses():
    path = os.path.join(ROOT, "conf", "README.md")
    with open(path) as f:
        text = f.read()
    assert opt.readme_with_options(text) == text, (
        "conf/README.md's option reference is stale: run python -m moevlm.train.options --write-readme"
    )
    for o in opt.options():
        assert f"| `{o.path}` |" in text


def test_readme_without_markers_is_refused_with_what_to_add():
    with pytest.raises(ValueError, match="lacks the markers"):
        opt.readme_with_options("# conf/\n")
