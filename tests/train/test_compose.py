"""compose_job keeps each choice of config groups composed and applies plain `section.field=value`
overrides to a copy: every list gives what Hydra's own compose of the whole list gives (the values,
the schema's types, struct mode), and a mistake raises Hydra's own error."""

import os

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from moevlm.config import compose_job
from moevlm.config.schema import CONF, _groups_and_values, register_schema

LISTS = [
    [],
    ["train.steps=3"],
    ["+experiment=h100_fsdp", "data.shards=sample", "model.num_layers=4"],
    # a field given again: the last wins, wherever the group choice sits
    ["model.num_layers=2", "+experiment=gb200_3d", "model.num_layers=8", "data.shards=sample"],
    ["data.shards=sample", "parallel.tp=2", "parallel.ep=2", "model.dispatcher=alltoall"],
    ["optim.lr=3e-4", "model.lora_modules=[attn,mlp]", "data.pack.seq_len=512"],
    ["model=qwen3_vl_30b_a3b", "train.run_dir='/tmp/a b'", "train.seed=7"],
    ["+scale=cpu", "train.steps=2"],
    # composed whole: a field added with +, hydra.*
    ["+experiment=h100_1gpu", "++train.steps=5", "data.shards=sample"],
    ["hydra.job.chdir=false", "train.steps=4"],
]


def test_group_choices_and_plain_fields_split_and_nothing_else_does():
    assert [_groups_and_values(x) is not None for x in LISTS] == [True] * 8 + [False] * 2
    assert _groups_and_values(LISTS[3]) == (
        ("+experiment=gb200_3d",),
        ["model.num_layers=2", "model.num_layers=8", "data.shards=sample"],
    )


def hydra_compose(overrides: list[str]):
    register_schema()
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base=None):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("overrides", LISTS, ids=lambda x: " ".join(x) or "defaults")
def test_every_list_composes_as_hydra_composes_it(overrides):
    want = hydra_compose(overrides)
    for _ in range(2):  # the first composes, the second is a copy of the kept one
        got = compose_job(overrides)
        assert OmegaConf.to_yaml(got) == OmegaConf.to_yaml(want)
        assert OmegaConf.get_type(got.model) is OmegaConf.get_type(want.model)
        assert got._get_flag("struct") == want._get_flag("struct") is True
        got.train.steps = 99  # each call's own copy
    assert compose_job(overrides).train.steps == want.train.steps


@pytest.mark.parametrize(
    "overrides",
    [["train.steps=abc"], ["optim.lr=1e-3,3e-4"], ["train.steps=2", "data.pack.seq_len=[1"]],
    ids=["type", "sweep", "syntax"],
)
def test_a_mistake_raises_hydras_own_error(overrides):
    with pytest.raises(Exception) as want:
        hydra_compose(overrides)
    with pytest.raises(type(want.value)) as got:
        compose_job(overrides)
    assert str(got.value) == str(want.value)
