"""Qwen3.5-MoE at the job level: `model.preset=qwen3_5_tiny` trains to the end in process, so does
`model.family=qwen3_5_moe` with the loss falling, a Qwen3.5
`config.json` (model.hf_config) and folder (model.hf_checkpoint) compose and load (into a model of the
other family: refused by name), the proxy depth
keeps the hybrid layer pattern consistent, and an unreadable config names both families."""

from __future__ import annotations

import json
import math

import pytest

from moevlm.config import compose_job, validate
from moevlm.config.model_section import model_config
from moevlm.errors import ConfigError
from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.train.trainer import Trainer

QUIET = [
    "data.num_workers=0",
    "data.streams=1",
    "train.log_every=1",
    "train.tensorboard=false",
    "train.global_batch_size=1",
    "train.checkpoint_at_end=false",
    "train.require_loss_decrease=false",
    "train.progress=false",
]


def _losses(run_dir, overrides) -> list[float]:
    job = compose_job([*QUIET, f"train.run_dir={run_dir}", *overrides])
    assert Trainer(job).run() == 0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [float(json.loads(line)["loss"]) for line in lines if "loss" in json.loads(line)]


def test_the_tiny_preset_trains_to_the_end(tmp_path):
    losses = _losses(tmp_path, ["model.preset=qwen3_5_tiny", "train.steps=2"])
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_model_family_picks_the_tiny_preset_and_its_loss_falls(tmp_path):
    """`model.family=qwen3_5_moe` with the default preset trains qwen3_5_tiny on the sample set, the
    trainer's own check that the loss fell passing; a family the preset is not of is refused."""
    plan = validate(compose_job(["model.family=qwen3_5_moe"]))
    tiny = VLMConfig.preset("qwen3_5_tiny")
    assert (plan.model.text, plan.model.moe, plan.model.vision) == (
        tiny.text,
        tiny.moe,
        tiny.vision,
    )
    steps = ["model.family=qwen3_5_moe", "train.steps=12", "train.require_loss_decrease=true"]
    losses = _losses(tmp_path, steps)
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    for family, preset in (("qwen3_5_moe", "qwen3_vl_30b_a3b"), ("qwen3_vl_moe", "qwen3_5_tiny")):
        with pytest.raises(ConfigError, match=f"model.family={family} but model.preset={preset}"):
            validate(compose_job([f"model.family={family}", f"model.preset={preset}"]))


def test_a_qwen35_folder_composes_and_loads(tmp_path):
    """model.hf_config and model.hf_checkpoint of a Qwen3.5 folder (one matrix per expert): one step."""
    model = Qwen3VLMoe(VLMConfig.preset("qwen3_5_tiny"))
    model.init_weights()
    model.save_pretrained(tmp_path / "hf")
    hf = f"model.hf_config={tmp_path / 'hf'}"
    composed = model_config(compose_job([hf]).model)
    assert (composed.text, composed.moe.shared_expert_intermediate_size) == (
        model.config.text,
        40,
    )
    ckpt = f"model.hf_checkpoint={tmp_path / 'hf'}"
    with pytest.raises(ConfigError, match="holds a Qwen3.5-MoE checkpoint .* is Qwen3-VL-MoE"):
        validate(compose_job([ckpt]))  # the default preset: the other family
    run = [hf, ckpt, "train.steps=1"]
    assert all(math.isfinite(x) for x in _losses(tmp_path / "run", run))


def test_the_proxy_depth_cuts_or_repeats_the_layer_pattern():
    def types(*overrides):
        return model_config(compose_job(list(overrides)).model).text.layer_types

    lin, full = "linear_attention", "full_attention"
    assert types("model.preset=qwen3_5_tiny", "model.num_layers=2") == (lin, lin)
    assert types("model.preset=qwen3_5_tiny", "model.num_layers=6") == (lin, lin, lin, full) + (
        lin,
        lin,
    )
    real = types("model.preset=qwen3_5_35b_a3b", "model.num_layers=8")
    assert real == (lin, lin, lin, full) * 2
    assert types("model.num_layers=2") == ()  # Qwen3-VL: no pattern to keep


def test_an_unreadable_config_names_both_families(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_5_moe", "text_config": 3})
    )
    with pytest.raises(ConfigError, match="Qwen3-VL-MoE or Qwen3.5-MoE config.json"):
        model_config(compose_job([f"model.hf_config={tmp_path}"]).model)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type='llama'.*Qwen3-VL-MoE, Qwen3.5-MoE"):
        model_config(compose_job([f"model.hf_config={tmp_path}"]).model)
