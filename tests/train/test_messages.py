"""Mistakes a user brings from elsewhere, each refused in one `config error:` line that names the fix:
option names of other trainers (HF Trainer, torchtitan, Megatron) under any section or none, a recipe or
group choice that conf/ lacks (the nearest and the whole list), a GPU recipe launched on a machine
without CUDA (the `+scale=cpu` way to run its shape there, after the refusal's own lines), and an HF
checkpoint of another architecture (the fields that differ, both values)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moevlm.config import check_overrides, compose_job, validate
from moevlm.config.validation import CPU_TRY
from moevlm.errors import ConfigError
from moevlm.model.config import VLMConfig


def _refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        check_overrides(overrides)
    lines = str(err.value).splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "given, fix",
    [
        ("optim.learning_rate=1e-3", "did you mean optim.lr?"),
        ("learning_rate=1e-3", "did you mean optim.lr?"),
        ("lr=1e-3", "did you mean optim.lr?"),
        ("train.max_steps=5", "did you mean train.steps?"),
        ("train.batch_size=8", "did you mean train.global_batch_size or train.micro_batch_size?"),
        ("seq_length=4096", "did you mean data.pack.seq_len?"),
        ("data.max_seq_len=4096", "did you mean data.pack.seq_len?"),
        ("train.output_dir=runs/a", "did you mean train.run_dir?"),
    ],
)
def test_names_from_other_trainers_point_at_ours(given, fix):
    line = _refusal([given])
    assert line.startswith(f"{given.split('=')[0]} is not an option; {fix}"), line


def test_a_group_choice_conf_lacks_names_the_nearest_and_lists_them():
    line = _refusal(["+experiment=gb200-3d"])
    assert line.startswith(
        "+experiment=gb200-3d is not a recipe of conf/experiment/; did you mean +experiment=gb200_3d?"
    )
    assert "h100_fsdp" in line and "sweep_tuning" in line  # the whole list
    assert "did you mean model=tiny?" in _refusal(["model=tiny2"])
    # what exists passes, and plain options are not group choices
    check_overrides(["+experiment=h100_fsdp", "+scale=cpu", "model=tiny", "train.steps=3"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the line is for a machine without CUDA")
def test_a_gpu_recipe_on_a_cpu_machine_ends_with_the_scale_line():
    with pytest.raises(ConfigError) as err:
        validate(compose_job(["+experiment=gb200_3d", "data.shards=sample"]), 1)
    lines = str(err.value).splitlines()
    assert len(lines) > 1 and lines[-1] == CPU_TRY
    assert "+scale=cpu" in CPU_TRY
    # a job that is wrong for another reason gets no such line
    with pytest.raises(ConfigError) as err:
        validate(compose_job(["data.shards=sample", "model.attn_backend=nope"]), 1)
    assert CPU_TRY not in str(err.value)


def test_an_hf_checkpoint_of_another_architecture_names_the_fields(tmp_path):
    tiny = VLMConfig.preset("tiny")
    deeper = dataclasses.replace(tiny, text=dataclasses.replace(tiny.text, num_layers=5))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(deeper.to_hf("float32")))
    (folder / "model.safetensors").write_text("")
    with pytest.raises(ConfigError) as err:
        validate(compose_job(["data.shards=sample", f"model.hf_checkpoint={folder}"]))
    (line,) = str(err.value).splitlines()
    assert "holds a different architecture than the configured model" in line
    assert f"(text.num_layers: checkpoint 5, configured {tiny.text.num_layers})" in line


def test_data_tokenizer_takes_a_folder_holding_tokenizer_json(tmp_path):
    from moevlm.data.checks import tokenizer_choice
    from moevlm.data.config import DataConfig
    from moevlm.data.errors import DataSetupError

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    chosen = tokenizer_choice(DataConfig(shards="x", tokenizer=str(tmp_path / "tok")), [])
    assert chosen == (str(tmp_path / "tok" / "tokenizer.json"), "data.tokenizer")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataSetupError, match="is not a file and the folder has no tokenizer.json"):
        tokenizer_choice(DataConfig(shards="x", tokenizer=str(tmp_path / "empty")), [])
