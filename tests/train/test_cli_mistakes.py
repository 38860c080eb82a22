"""The mistakes that used to pass validation and fail later with a traceback (after the model, the data
workers or the sample set were built) are each one `config error:` line from validation, the first thing
a Trainer does: an HF checkpoint folder without config.json, with a config but no weights, with an index
naming missing files, or of another architecture; a tokenizer whose special ids are not the model's
(the sample set's own included), with advice naming keys that exist and fix it; relative paths shown
resolved; shards (training or held-out) too few for the data-parallel ranks.  train.py's command-line
check refuses a key given more than once (a brace pattern the shell expanded), showing the quoted form.
One subprocess shows the whole CLI: exit 2, one line, no traceback, nothing created."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moevlm.config import compose_job, validate
from moevlm.errors import ConfigError
from moevlm.model.config import VLMConfig

REPO = Path(__file__).resolve().parents[2]
TINY_HF = json.dumps(VLMConfig.preset("tiny").to_hf("float32"))


def _folder(root: Path, name: str, files: dict[str, str]) -> Path:
    path = root / name
    path.mkdir()
    for file, text in files.items():
        (path / file).write_text(text)
    return path


def _one_line(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        validate(compose_job(overrides))
    lines = str(err.value).splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "files, says",
    [
        (
            {},
            "has no config.json; give an HF Qwen3-VL-MoE folder (config.json, and model.safetensors",
        ),
        (
            {"config.json": TINY_HF},
            (
                "has a config.json but no weights (neither model.safetensors nor "
                "model.safetensors.index.json); give an HF Qwen3-VL-MoE folder"
            ),
        ),
        (
            {
                "config.json": TINY_HF,
                "model.safetensors.index.json": json.dumps(
                    {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
                ),
            },
            (
                "model.safetensors.index.json names 1 weight file(s) that are not in the folder, e.g. "
                "['model-00001-of-00002.safetensors']"
            ),
        ),
        (
            {
                "config.json": json.dumps(VLMConfig.preset("qwen3_vl_30b_a3b").to_hf()),
                "model.safetensors": "",
            },
            (
                "holds a different architecture than the configured model; build the model from its "
                "config.json (model.hf_config)"
            ),
        ),
        ({"config.json": "{not json", "model.safetensors": ""}, "its config.json is not a "),
    ],
    ids=["no_config", "no_weights", "index_names_missing_files", "other_architecture", "bad_json"],
)
def test_an_hf_checkpoint_that_cannot_load_is_one_line_shown_resolved(
    tmp_path, monkeypatch, files, says
):
    _folder(tmp_path, "ckpt", files)
    monkeypatch.chdir(tmp_path)
    line = _one_line(["model.hf_checkpoint=ckpt"])
    assert line.startswith(f"model.hf_checkpoint=ckpt (= {tmp_path / 'ckpt'})") and says in line


def test_a_tokenizer_that_does_not_fit_is_one_line_whose_keys_fix_it(tmp_path):
    """The sample set's tokenizer (ids of the tiny preset) with a large model's proxy: the line names
    model.* keys; with them the job validates.  With a checkpoint, its own tokenizer is the fix."""
    proxy = ["model.preset=qwen3_vl_30b_a3b", "model.num_layers=1", "model.vision_depth=1"]
    line = _one_line(proxy)
    assert line.startswith("the sample set's tokenizer (data.shards=sample")
    assert (
        "<|image_pad|>" not in line
        and "image_token_id is 1020 there but 151655 in the model" in line
    )
    keys = line.split("take the tokenizer's: ")[1].split(";")[0].split()
    assert keys == [
        "model.image_token_id=1020",
        "model.video_token_id=1021",
        "model.vision_start_token_id=1018",
        "model.vision_end_token_id=1019",
    ]
    plan = validate(compose_job(proxy + keys))
    assert plan.model.image_token_id == 1020 and plan.model.text.vocab_size == 151936

    # more ids than the model's vocabulary: model.vocab_size is named too, and the named keys fix it
    small = ["model.vocab_size=1000"] + [f"{k.split('=')[0]}={996 + i}" for i, k in enumerate(keys)]
    line = _one_line(proxy + small)
    assert "it has 1022 ids but the model's vocabulary 1000" in line
    keys = line.split("take the tokenizer's: ")[1].split(";")[0].split()
    assert keys[-1] == "model.vocab_size=1022" and len(keys) == 5
    assert validate(compose_job(proxy + keys)).model.text.vocab_size == 1022
    # with a checkpoint: its own tokenizer, named when it has one
    ckpt = _folder(tmp_path, "ckpt", {"model.safetensors": "", "tokenizer.json": "{}"})
    with pytest.raises(ConfigError) as err:
        validate(compose_job([*proxy, f"model.hf_checkpoint={ckpt}"]))
    assert f"use its tokenizer (data.tokenizer={ckpt / 'tokenizer.json'})" in str(err.value)
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"use its tokenizer \(data.tokenizer=FILE\)"):
        validate(compose_job([*proxy, f"model.hf_checkpoint={ckpt}"]))


def _train_py():
    spec = importlib.util.spec_from_file_location("train_cli", REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["data.shards=/d/s-000.tar", "data.shards=/d/s-001.tar", "data.shards=/d/s-002.tar"],
            (
                "data.shards is given 3 times (/d/s-000.tar, /d/s-001.tar, /d/s-002.tar): the shell "
                "expanded a brace pattern, and only the last would be used; quote it: "
                "data.shards=\"'/d/s-{000..002}.tar'\""
            ),
        ),
        (
            ["-m", "train.steps=2", "data.shards=/d/a.tar", "data.shards=/d/b.tar"],
            (
                "data.shards is given 2 times (/d/a.tar, /d/b.tar): the shell expanded a brace pattern, "
                "and only the last would be used; quote it: data.shards=\"'/d/a.tar,/d/b.tar'\""
            ),
        ),
        (
            ["train.steps=2", "train.steps=3"],
            "train.steps is given 2 times (2, 3) and only the last would be used; give it once",
        ),
        # a sweep's value that Hydra would refuse for the whole sweep (with exit 1) before any job
        (
            ["-m", "optim.lr=1e-3,2e-3", "train.steps=1,x"],
            (
                "Error merging override train.steps=x; Value 'x' of type 'str' could not be converted "
                "to Integer"
            ),
        ),
    ],
    ids=["numbered_shards", "sweep", "any_key", "sweep_value"],
)
def test_a_key_given_more_than_once_is_refused_with_the_quoted_form(
    monkeypatch, capsys, argv, says
):
    train = _train_py()
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    with pytest.raises(SystemExit) as stop:
        train._check_command_line()
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"config error: {says}\n"


@pytest.mark.slow
def test_train_py_says_it_in_one_line_and_builds_nothing(tmp_path):
    """The whole CLI on the first mistake: exit 2, one line (the relative path resolved), no traceback,
    no run directory, no sample set."""
    _folder(tmp_path, "ckpt", {"config.json": TINY_HF})
    env = {**os.environ, "MOEVLM_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "model.hf_checkpoint=ckpt"],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        (
            f"config error: model.hf_checkpoint=ckpt (= {tmp_path / 'ckpt'}) has a config.json but no "
            "weights (neither model.safetensors nor model.safetensors.index.json); give an HF Qwen3-VL-MoE "
            "folder (config.json, and model.safetensors or model.safetensors.index.json), or set "
            f"model.hf_config={tmp_path / 'ckpt'} to take only its architecture (random weights)"
        )
    ]
    assert "Traceback" not in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_shards_too_few_for_the_ranks_are_refused_before_anything_is_built(tmp_path):
    """The loader's stream rule, found by validation on every rank: a pipeline's later stages build no
    loader, so the loader's own refusal would leave them waiting for the first stage."""
    for name, n in (("train", 3), ("val", 1)):
        (tmp_path / name).mkdir()
        for i in range(n):
            (tmp_path / name / f"s-{i}.tar").write_bytes(b"")
    from moevlm.data.sample_cache import ensure_sample

    tokenizer = ensure_sample()[0] / "tokenizer.json"
    ok = [
        f"data.shards={tmp_path / 'train'}",
        f"data.tokenizer={tokenizer}",
        "train.global_batch_size=4",
    ]
    validate(compose_job(ok), world_size=2)
    with pytest.raises(ConfigError, match=r"^3 shards cannot feed 4 data-parallel ranks"):
        validate(compose_job(ok), world_size=4)
    val = ok + [f"data.val_shards={tmp_path / 'val'}", "train.val_every=2", "parallel.pp=2"]
    validate(compose_job(val), world_size=2)
    with pytest.raises(
        ConfigError, match=r"^data.val_shards: 1 shards cannot feed 2 data-parallel"
    ):
        validate(compose_job(val), world_size=4)
