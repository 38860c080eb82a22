"""`train.py model.lora_rank=8` on the embedded default, in process: the loss falls with only the
adapters trained, and the end of the run exports the adapters (PEFT format) and merged weights."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from moevlm.config import compose_job, validate
from moevlm.errors import ConfigError
from moevlm.train.trainer import Trainer

FAST = ["data.num_workers=1", "data.streams=1", "train.log_every=1"]


def test_lora_run_trains_adapters_and_exports(tmp_path):
    run_dir, adapter, hf = tmp_path / "run", tmp_path / "adapter", tmp_path / "hf"
    job = compose_job(
        FAST
        + ["model.lora_rank=8", "model.lora_modules=[attn,mlp,experts]", "optim.lr=1e-2"]
        + ["train.steps=4", f"train.run_dir={run_dir}", "train.checkpoint_at_end=false"]
        + [f"train.export_adapter={adapter}", f"train.export_hf={hf}"]
    )
    trainer = Trainer(job)
    with contextlib.redirect_stdout(io.StringIO()):
        assert trainer.run() == 0
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [float(r["loss"]) for r in recs]
    print("LoRA run losses:", losses)
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8
    assert (adapter / "adapter_model.safetensors").exists()
    assert list(hf.glob("*.safetensors"))


@pytest.mark.parametrize(
    "layout, named",
    [
        ([], "parallel.dp=2"),
        (["parallel.tp=2"], "parallel.tp=2"),
        (["parallel.ep=2"], "parallel.ep=2"),
        (["parallel.pp=2"], "parallel.pp=2"),
        (["parallel.cp=2"], "parallel.cp=2"),
    ],
)
def test_lora_refuses_layouts_not_built_yet(layout, named):
    with pytest.raises(ConfigError, match=f"{named}: adapters under that layout are not built yet"):
        validate(compose_job(["model.lora_rank=8", *layout]), world_size=2, environment=False)


@pytest.mark.parametrize(
    "extra, says",
    [
        (["train.compile=true"], "train.compile=true"),
        (["model.lora_modules=[vision]", "model.freeze_vision=true"], "freeze_vision"),
        (["model.lora_rank=0", "train.export_adapter=x"], "needs adapters"),
    ],
)
def test_lora_refusals(extra, says):
    with pytest.raises(ConfigError, match=says):
        validate(compose_job(["model.lora_rank=8", *extra]), world_size=1, environment=False)
