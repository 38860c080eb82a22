"""Presets, HF config round trip, and every bad input named clearly before any
large allocation."""

import dataclasses
import json

import pytest
import torch
from hf_ref import hf_model, sample, transformers

from moevlm.model import ConfigError, Qwen3VLMoe, VLMConfig
from moevlm.model.hf import CheckpointError


@pytest.mark.parametrize("name", ["tiny", "qwen3_vl_30b_a3b", "qwen3_vl_235b_a22b"])
def test_presets_validate_and_round_trip_through_hf_config(name):
    cfg = VLMConfig.preset(name).validate()
    again = VLMConfig.from_hf(cfg.to_hf())
    assert again == cfg
    hf = transformers.Qwen3VLMoeConfig(**cfg.to_hf())  # transformers accepts what we write
    assert hf.text_config.num_experts == cfg.moe.num_experts


def test_public_model_sizes_are_right():
    """Parameter counts of the public checkpoints, from a meta-device build."""
    for name, total_b, active_b in (
        ("qwen3_vl_30b_a3b", 31.1, 3.6),
        ("qwen3_vl_235b_a22b", 235.8, 22.7),
        ("qwen3_5_35b_a3b", 35.1, 3.9),  # counted the same way: embeddings, head, vision in
    ):
        cfg = VLMConfig.preset(name)
        with torch.device("meta"):
            model = Qwen3VLMoe(cfg)
        total = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        active = total - experts * (1 - cfg.moe.top_k / cfg.moe.num_experts)
        assert abs(total / 1e9 - total_b) < 0.5 and abs(active / 1e9 - active_b) < 0.5, (
            name,
            total,
            active,
        )


def test_from_hf_reads_older_rope_scaling_key():
    hf = VLMConfig.preset("tiny").to_hf()
    rope = hf["text_config"].pop("rope_parameters")
    hf["text_config"]["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    hf["text_config"]["rope_theta"] = rope["rope_theta"]
    hf["text_config"]["num_local_experts"] = hf["text_config"].pop("num_experts")
    assert VLMConfig.from_hf(hf) == VLMConfig.preset("tiny")


BAD_CONFIGS = [
    (
        lambda c: setattr(c.text, "num_kv_heads", 3),
        "text.num_heads=4 is not divisible by text.num_kv_heads=3",
    ),
    (
        lambda c: setattr(c.vision, "num_heads", 5),
        "vision.hidden_size=32 is not divisible by vision.num_heads=5",
    ),
    (lambda c: setattr(c.text, "mrope_section", (4, 2, 1)), "text.mrope_section"),
    (lambda c: setattr(c.moe, "top_k", 9), "moe.top_k=9"),
    (
        lambda c: setattr(c.vision, "deepstack_visual_indexes", (2,)),
        "vision.deepstack_visual_indexes",
    ),
    (
        lambda c: setattr(c.vision, "num_position_embeddings", 60),
        "vision.num_position_embeddings=60",
    ),
    (lambda c: setattr(c.moe, "mlp_only_layers", (7,)), "moe.mlp_only_layers"),
    (lambda c: setattr(c.moe, "grouped_gemm", "cutlass"), "moe.grouped_gemm='cutlass'"),
    (lambda c: setattr(c, "attn_backend", "xformers"), "attn_backend='xformers'"),
    (
        lambda c: setattr(c.moe, "moe_intermediate_size", 50),
        "moe.moe_intermediate_size=50 must be multiples of 8",
    ),
    (lambda c: setattr(c, "image_token_id", 5000), "image_token_id=5000"),
    # sizes are positive integers, real-valued fields finite (NaN fails no `>= 0` written as `not x < 0`)
    (lambda c: setattr(c.vision, "num_heads", 0), "vision.num_heads=0 must be a positive integer"),
    (lambda c: setattr(c.text, "num_layers", -1), "text.num_layers=-1 must be a positive integer"),
    (lambda c: setattr(c.moe, "top_k", 0), "moe.top_k=0 must be a positive integer"),
    (
        lambda c: setattr(c.moe, "router_aux_loss_coef", float("nan")),
        "moe.router_aux_loss_coef=nan must be a finite",
    ),
    (
        lambda c: setattr(c.moe, "router_aux_loss_coef", -0.1),
        "moe.router_aux_loss_coef=-0.1 must be a finite",
    ),
    (
        lambda c: setattr(c.text, "rms_norm_eps", 0.0),
        "text.rms_norm_eps=0.0 must be a finite number > 0",
    ),
    (
        lambda c: setattr(c.text, "rope_theta", float("inf")),
        "text.rope_theta=inf must be a finite number > 0",
    ),
    (
        lambda c: setattr(c.vision, "initializer_range", float("nan")),
        "vision.initializer_range=nan",
    ),
]


@pytest.mark.parametrize("mutate,message", BAD_CONFIGS)
def test_bad_config_is_named_before_any_parameter_exists(mutate, message, monkeypatch):
    cfg = VLMConfig.preset("tiny")
    mutate(cfg)
    allocated = []
    monkeypatch.setattr(
        torch.nn.Module,
        "register_parameter",
        lambda *a, **k: allocated.append(a) or pytest.fail("allocated before validation"),
    )
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Qwen3VLMoe(cfg)
    assert not allocated


def test_bf16_model_runs_with_fp32_router_and_tracks_fp32():
    """bf16 parameters and activations; the router still decides in fp32."""
    cfg = VLMConfig.preset("tiny").replace(attn_backend="sdpa")
    model = Qwen3VLMoe(cfg)
    ids, px, grid = sample(cfg, [(1, 4, 6)])
    ref = model(ids, px, grid, labels=ids)
    model.to(torch.bfloat16)
    out = model(ids, px, grid, labels=ids)
    assert out.logits.dtype == torch.bfloat16 and out.aux_loss.dtype == torch.float32
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert abs(out.lm_loss.item() - ref.lm_loss.item()) < 0.05
    err = (out.logits.float() - ref.logits).detach().abs().max() / ref.logits.detach().abs().max()
    assert float(err) < 0.05


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="qwen3_vl_30b_a3b"):
        VLMConfig.preset("qwen3_vl_7b")


@pytest.fixture(scope="module")
def tiny_model():
    return Qwen3VLMoe(VLMConfig.preset("tiny").replace(attn_backend="sdpa"))


BAD_INPUTS = {
    "pixels_without_grid": (lambda ids, px, g: (ids, px, None), "image_grid_thw is missing"),
    "grid_without_pixels": (lambda ids, px, g: (ids, None, g), "pixel_values is missing"),
    "grid_too_many_patches": (
        lambda ids, px, g: (ids, px, torch.tensor([[1, 4, 8]])),
        "pixel_values has 24 patches but image_grid_thw describes 32",
    ),
    "grid_not_multiple_of_merge": (
        lambda ids, px, g: (ids, px, torch.tensor([[1, 3, 8]])),
        r"image_grid_thw\[0\]=\(1, 3, 8\)",
    ),
    "grid_wrong_shape": (
        lambda ids, px, g: (ids, px, torch.tensor([4, 6])),
        "image_grid_thw must be",
    ),
    "pixels_wrong_width": (
        lambda ids, px, g: (ids, px[:, :100], g),
        r"pixel_values must be \(num_patches, 1536\)",
    ),
    "one_pad_became_text": (
        lambda ids, px, g: (torch.where(torch.arange(ids.shape[1]) == 9, 5, ids), px, g),
        "input_ids has 5 image tokens",
    ),
    "image_tokens_without_pixels": (
        lambda ids, px, g: (ids, None, None),
        "input_ids has 6 image tokens",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_image_inputs_are_named(case, tiny_model, monkeypatch):
    cfg = tiny_model.config
    ids, px, g = sample(cfg, [(1, 4, 6)])
    make, message = BAD_INPUTS[case]
    args = make(ids, px, g)
    called = []
    monkeypatch.setattr(tiny_model.vision, "forward", lambda *a: called.append(1))
    with pytest.raises(ValueError, match=message):
        tiny_model(*args)
    assert not called  # rejected before the vision tower ran


def test_bad_sequence_inputs_are_named(tiny_model):
    ids, _, _ = sample(tiny_model.config, [], batch=2)
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        tiny_model(ids, cu_seqlens=torch.tensor([0, 5, 3, ids.numel()]))
    with pytest.raises(ValueError, match="labels"):
        tiny_model(ids, labels=ids[:, :-1])
    with pytest.raises(ValueError, match="position_ids must be"):
        tiny_model(ids, position_ids=torch.zeros(3, 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids must be a 2-D integer tensor"):
        tiny_model(ids.float())


def test_image_split_across_documents_is_named(tiny_model):
    cfg = tiny_model.config
    ids, px, g = sample(cfg, [(1, 4, 6)])
    cu = torch.tensor([0, 10, ids.shape[1]], dtype=torch.int32)  # boundary inside the image pads
    with pytest.raises(ValueError, match="consecutive image tokens inside one document"):
        tiny_model(ids, px, g, cu_seqlens=cu)


def _saved(cfg, tmp_path):
    ref = hf_model(cfg)
    ref.save_pretrained(tmp_path)
    return tmp_path


def test_checkpoint_mismatch_lists_every_problem_before_allocating(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    path = _saved(VLMConfig.preset("tiny"), tmp_path)
    sd = load_file(path / "model.safetensors")
    sd["model.language_model.layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 64)  # wrong shape
    del sd["model.language_model.norm.weight"]  # missing
    sd["model.visual.extra.weight"] = torch.zeros(1)  # unexpected
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    materialised = []
    monkeypatch.setattr(torch.nn.Module, "to_empty", lambda *a, **k: materialised.append(1))
    with pytest.raises(CheckpointError) as err:
        Qwen3VLMoe.from_pretrained(path)
    text = str(err.value)
    assert "1 missing: model.language_model.norm.weight" in text
    assert "1 unexpected: model.visual.extra.weight" in text
    assert "layers.0.self_attn.q_proj.weight: checkpoint (32, 64), model expects (64, 64)" in text
    assert not materialised


def test_config_and_checkpoint_must_agree(tmp_path):
    """A config.json whose sizes disagree with the tensors is a checkpoint error."""
    path = _saved(VLMConfig.preset("tiny"), tmp_path)
    hf = json.loads((path / "config.json").read_text())
    hf["text_config"]["moe_intermediate_size"] = 40
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="experts.gate_up_proj: checkpoint"):
        Qwen3VLMoe.from_pretrained(path)


def test_square_expert_weights_need_a_layout(tmp_path):
    """D == 2F: the shape cannot tell hub from transformers layout.  Our own exports
    record it; a foreign file without the record asks the caller."""
    cfg = VLMConfig.preset("tiny")
    cfg.moe = dataclasses.replace(cfg.moe, moe_intermediate_size=32)  # 2F == D == 64
    path = _saved(cfg, tmp_path / "hf")
    with pytest.raises(CheckpointError, match="expert_layout='hub'"):
        Qwen3VLMoe.from_pretrained(path)
    ours = Qwen3VLMoe.from_pretrained(path, expert_layout="hf")
    ours.save_pretrained(tmp_path / "ours")
    back = Qwen3VLMoe.from_pretrained(tmp_path / "ours")
    for (n, a), (_, b) in zip(back.state_dict().items(), ours.state_dict().items()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("loader", ["from_pretrained", "load_hf_weights_"])
def test_integer_or_bool_tensor_is_refused_naming_it_its_dtype_and_file(
    loader, tmp_path, monkeypatch
):
    """An int32 or bool tensor where a float weight belongs would be cast and trained: refused from the
    headers (before anything is materialised), every such tensor named with its dtype and file."""
    from safetensors.torch import load_file, save_file

    from moevlm.parallel.hf_io import load_hf_weights_

    path = _saved(VLMConfig.preset("tiny"), tmp_path)
    sd = load_file(path / "model.safetensors")
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    sd[q] = sd[q].to(torch.int32)
    sd["model.language_model.norm.weight"] = sd["model.language_model.norm.weight"].bool()
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    if loader == "from_pretrained":
        materialised = []
        monkeypatch.setattr(torch.nn.Module, "to_empty", lambda *a, **k: materialised.append(1))
        with pytest.raises(CheckpointError) as err:
            Qwen3VLMoe.from_pretrained(path)
        assert not materialised
    else:
        model = Qwen3VLMoe(VLMConfig.preset("tiny"))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(CheckpointError) as err:
            load_hf_weights_(model, path)
        # nothing copied
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    text = str(err.value)
    file = str(path / "model.safetensors")
    assert "2 not floating point" in text
    assert (
        f"{q}: I32 in {file}" in text
        and f"model.language_model.norm.weight: BOOL in {file}" in text
    )


def test_a_float_of_another_width_loads(tmp_path):
    """A bf16 file into fp32 weights: allowed, converted by the copy."""
    from safetensors.torch import load_file, save_file

    path = _saved(VLMConfig.preset("tiny"), tmp_path)
    sd = {k: v.to(torch.bfloat16) for k, v in load_file(path / "model.safetensors").items()}
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    model = Qwen3VLMoe.from_pretrained(path)
    q = model.state_dict()["text.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.float32
    assert torch.equal(q, sd["model.language_model.layers.0.self_attn.q_proj.weight"].float())
