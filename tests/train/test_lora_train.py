"""`train.py model.lora_rank=8` on the embedded default, in process: the loss falls with only the
adapters trained, the end of the run exports the adapters (PEFT format) and merged weights, and its
checkpoint holds the adapters alone; the config checks of LoRA under layouts."""

from __future__ import annotations

import contextlib
import math
import io
import json

import pytest

from moevlm.config import compose_job, validate
from moevlm.errors import ConfigError
from moevlm.model.linear import is_adapter
from moevlm.train.checkpoint import CheckpointError, read_marker
from moevlm.train.checkpoint.dcp_io import checkpoint_index
from moevlm.train.trainer import Trainer

FAST = ["data.num_workers=1", "data.streams=1", "train.log_every=1"]


def test_lora_run_trains_adapters_and_exports(tmp_path):
    run_dir, adapter, hf = tmp_path / "run", tmp_path / "adapter", tmp_path / "hf"
    job = (
        FAST
        + ["model.lora_rank=8", "model.lora_modules=[attn,mlp,experts]", "optim.lr=1e-2"]
        + ["train.steps=4", f"train.run_dir={run_dir}"]
        + [f"train.export_adapter={adapter}", f"train.export_hf={hf}"]
    )
    trainer = Trainer(compose_job(job))
    with contextlib.redirect_stdout(io.StringIO()):
        assert trainer.run() == 0
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [float(r["loss"]) for r in recs]
    print("LoRA run losses:", losses)
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8
    assert (adapter / "adapter_model.safetensors").exists()
    assert list(hf.glob("*.safetensors"))
    adapter_only_checkpoint(run_dir / "checkpoints" / "step_00000004", trainer.model, job)


def adapter_only_checkpoint(path, model, job: list[str]) -> None:
    """The run's checkpoint holds the adapters and their AdamW state alone, with the base's identity
    (seed and architecture: no hf_checkpoint) in its marker; a run drawing another base refuses it."""
    marker, saved = read_marker(path), checkpoint_index(path)
    assert marker["base"]["source"] == "seed=0 (no hf_checkpoint)", marker["base"]
    for part in ("model.", "optim.state."):
        keys = [k for k in saved if k.startswith(part)]
        assert keys and all(is_adapter(k) for k in keys), [k for k in keys if not is_adapter(k)]
    files = sum(f["bytes"] for f in marker["files"].values())
    tensors = sum(
        math.prod(v.size) * 4 for k, v in saved.items() if k.startswith(("model.", "optim.state."))
    )
    weights = 4 * sum(p.numel() for p in model.parameters())  # the base's fp32 weights (merged)
    print(
        f"LoRA checkpoint: files {files / 1e6:.2f} MB, adapters + AdamW state {tensors / 1e6:.2f} "
        f"MB; the base's fp32 weights {weights / 1e6:.2f} MB"
    )
    assert tensors < weights / 2
    with pytest.raises(CheckpointError, match="LoRA adapters of another base") as err:
        Trainer(compose_job([*job, "train.seed=1"]))
    assert str(err.value).count("sha256") == 2 and "seed=1" in str(err.value)


@pytest.mark.parametrize(
    "layout", [[], ["parallel.tp=2"], ["parallel.ep=2"], ["parallel.pp=2"], ["parallel.cp=2"]]
)
def test_lora_layouts_validate_with_their_exports(layout):
    """Every layout trains adapters and exports them (tests/parallel/test_layouts.py and
    test_pipeline.py export from 2 ranks)."""
    job = compose_job(["model.lora_rank=8", "train.export_adapter=x", "train.export_hf=y", *layout])
    validate(job, world_size=2, environment=False)


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda c: setattr(c.text, "num_kv_heads", 1), "parallel.tp=2 > the 1 kv heads"),
        (lambda c: setattr(c.text, "layer_types", ("linear_attention",) * 3), "Gated DeltaNet"),
    ],
)
def test_lora_attention_adapters_a_layout_slices_are_refused_at_build(change, says):
    from moevlm.model import VLMConfig
    from moevlm.parallel import ParallelDims, build_model
    from moevlm.parallel.build import ParallelNotBuilt

    cfg = VLMConfig.preset("tiny")
    cfg.lora.rank = 8
    change(cfg)
    with pytest.raises(ParallelNotBuilt, match=says):
        build_model(cfg, ParallelDims(2, tp=2))


@pytest.mark.parametrize(
    "extra, says",
    [
        (["model.lora_modules=[vision]", "model.freeze_vision=true"], "freeze_vision"),
        (["model.lora_rank=0", "train.export_adapter=x"], "needs adapters"),
    ],
)
def test_lora_refusals(extra, says):
    with pytest.raises(ConfigError, match=says):
        validate(compose_job(["model.lora_rank=8", *extra]), world_size=1, environment=False)


def test_lora_validates_with_compile_or_fp8():
    """Adapters compose with train.compile (tests/train/test_compile.py) and with FP8 base GEMMs
    (tests/model/test_lora.py): neither is refused."""
    for extra in (["train.compile=true"], ["model.fp8=blockwise", "model.fp8_backend=emulate"]):
        job = compose_job(["model.lora_rank=8", *extra])
        assert validate(job, world_size=1, environment=False).model.lora.rank == 8


def test_base_identity_of_a_folder_changes_with_its_weights(tmp_path):
    """A Hugging Face base is named by its folder and a hash of sampled bytes: other weights of the same
    shapes and file sizes give another hash, and the refusal names both."""
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    from moevlm.train.checkpoint.base import base_identity, check_base

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    save_file({"w": torch.arange(300_000, dtype=torch.float32)}, str(folder / "model.safetensors"))
    first = base_identity(str(folder), 0, None)
    assert first == base_identity(str(folder), 5, None)  # the seed draws no weight of it
    # another fine-tune of the same architecture: same names, shapes and file sizes, other values
    save_file(
        {"w": torch.arange(300_000, dtype=torch.float32) / 2}, str(folder / "model.safetensors")
    )
    second = base_identity(str(folder), 0, None)
    assert second["source"] == first["source"] and second["sha256"] != first["sha256"]
    check_base({"base": first}, first, Path("ck"))
    with pytest.raises(CheckpointError, match="another base") as err:
        check_base({"base": first}, second, Path("ck"))
    assert first["sha256"][:16] in str(err.value) and second["sha256"][:16] in str(err.value)
    with pytest.raises(CheckpointError, match="holds LoRA adapters only"):
        check_base({"base": first}, None, Path("ck"))
    with pytest.raises(CheckpointError, match="holds a whole model"):
        check_base({}, first, Path("ck"))
