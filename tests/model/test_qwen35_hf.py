"""Qwen3.5-MoE folders in and out against transformers' Qwen3_5MoeForConditionalGeneration (fp32,
CPU, random tiny configs): its saved folder loads into ours with equal logits on text and images
(M-RoPE position ids equal too), ours saved loads in transformers (one matrix per expert, the fused
layout, several files) with equal logits, config.json round trips, a row of packed documents with images equals each document alone in
transformers, and a folder of the other family is refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hf_ref import hf_forward, qwen35_model, rel_err, sample
from safetensors.torch import load_file, save_file

from moevlm.errors import ConfigError
from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model import hf as hf_io
from moevlm.model.rope import mrope_position_ids

pytest.importorskip("transformers.models.qwen3_5_moe")
TOL = 1e-5
INPUTS = {"text": [], "one_image": [(1, 4, 6)], "two_images": [(1, 4, 6), (1, 8, 4)]}


def _tiny() -> VLMConfig:
    return VLMConfig.preset("qwen3_5_tiny").replace(attn_backend="sdpa")


def _full_first_tied() -> VLMConfig:
    """Another layer pattern (full attention first and last), tied embeddings, top-1 of 8."""
    cfg = _tiny().replace(tie_word_embeddings=True)
    types = ("full_attention", "linear_attention", "linear_attention", "full_attention")
    cfg.text = dataclasses.replace(cfg.text, layer_types=types)
    cfg.moe = dataclasses.replace(cfg.moe, top_k=1)
    return cfg


def _linear_heavy() -> VLMConfig:
    """Three Gated DeltaNet layers then one full-attention layer, other GDN head counts and widths,
    a wider conv window, a wider shared expert, top-3."""
    cfg = _tiny()
    types = ("linear_attention",) * 3 + ("full_attention",)
    gdn = dict(linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=12)
    cfg.text = dataclasses.replace(cfg.text, layer_types=types, linear_conv_kernel_dim=3, **gdn)
    cfg.moe = dataclasses.replace(cfg.moe, top_k=3, shared_expert_intermediate_size=56)
    return cfg.validate()


CONFIGS = {
    "qwen3_5_tiny": _tiny,
    "full_first_tied_top1": _full_first_tied,
    "linear_heavy_top3": _linear_heavy,
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """{config name: (transformers model, its saved folder)}, built once per config."""
    out = {}
    for name, make in CONFIGS.items():
        folder = tmp_path_factory.mktemp(name)
        ref = qwen35_model(make())
        ref.save_pretrained(folder)
        out[name] = (ref, folder)
    return out


def _logits(model, cfg, grids):
    ids, pixels, grid = sample(cfg, grids, batch=2 if not grids else 1)
    with torch.no_grad():
        if isinstance(model, Qwen3VLMoe):
            return model(ids, pixels, grid).logits
        return hf_forward(model, ids, pixels, grid).logits


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("config", CONFIGS)
def test_transformers_folder_loads_with_equal_logits(reference, config, inputs):
    ref, folder = reference[config]
    cfg = CONFIGS[config]()
    ours = Qwen3VLMoe.from_pretrained(folder, attn_backend="sdpa").eval()
    assert ours.config == cfg
    assert rel_err(_logits(ours, cfg, INPUTS[inputs]), _logits(ref, cfg, INPUTS[inputs])) < TOL


@pytest.mark.parametrize("config", CONFIGS)
def test_packed_documents_with_images_equal_transformers_on_each_alone(reference, config):
    """One row of three documents (an image, text only, two images), positions per document and
    `cu_seqlens` at their bounds, through `moevlm.model.from_pretrained`: each document's logits equal
    transformers' on that document alone (attention's mask, the GDN state and conv resets)."""
    import moevlm.model

    ref, folder = reference[config]
    cfg = CONFIGS[config]()
    ours = moevlm.model.from_pretrained(folder, attn_backend="sdpa").eval()
    assert ours.config == cfg and ours.config.family == "qwen3_5_moe"
    docs = [sample(cfg, g, seed=i) for i, g in enumerate(([(1, 4, 6)], [], [(1, 4, 4), (1, 6, 4)]))]
    merge, image = cfg.vision.spatial_merge_size, cfg.image_token_id
    ids = torch.cat([d[0] for d in docs], dim=1)
    pos = torch.cat([mrope_position_ids(d[0], d[2], image, merge) for d in docs], dim=-1)
    bounds = torch.tensor([0, *(d[0].shape[1] for d in docs)]).cumsum(0).int()
    pixels = torch.cat([d[1] for d in docs if d[1] is not None])
    grid = torch.cat([d[2] for d in docs if d[2] is not None])
    with torch.no_grad():
        packed = ours(ids, pixels, grid, position_ids=pos, cu_seqlens=bounds).logits
        alone = [hf_forward(ref, *d).logits for d in docs]
    assert rel_err(packed, torch.cat(alone, dim=1)) < TOL


def test_mrope_position_ids_equal_the_reference(reference):
    ref, _ = reference["qwen3_5_tiny"]
    cfg = _tiny()
    ids, _, grid = sample(cfg, [(1, 4, 6), (1, 8, 4)], batch=2)
    theirs, _ = ref.model.get_rope_index(
        ids, mm_token_type_ids=(ids == cfg.image_token_id).int(), image_grid_thw=grid
    )
    merge = cfg.vision.spatial_merge_size
    assert torch.equal(mrope_position_ids(ids, grid, cfg.image_token_id, merge), theirs)


@pytest.mark.parametrize("how", ["hub", "hf", "hub_sharded", "save_hf"])
def test_our_folder_loads_in_transformers_with_equal_logits(reference, tmp_path, how):
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

    from moevlm.parallel.hf_io import save_hf

    cfg = _tiny()
    ours = Qwen3VLMoe.from_pretrained(reference["qwen3_5_tiny"][1], attn_backend="sdpa").eval()
    layout = "hf" if how == "hf" else "hub"
    if how == "save_hf":
        save_hf(ours, tmp_path)
    else:
        shard = 100_000 if how == "hub_sharded" else 5 << 30
        ours.save_pretrained(tmp_path, expert_layout=layout, max_shard_bytes=shard)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert (len(files) > 1) == (how == "hub_sharded")
    names = set().union(*(load_file(f) for f in files))
    assert any(n.endswith(".experts.0.gate_proj.weight") for n in names) == (layout == "hub")
    back, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(
        tmp_path, output_loading_info=True, attn_implementation="sdpa"
    )
    assert not any(info.values()), info
    back.eval().set_experts_implementation("eager")
    assert rel_err(_logits(back, cfg, [(1, 4, 6)]), _logits(ours, cfg, [(1, 4, 6)])) < TOL


def test_config_json_round_trips(reference):
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig

    for name in ("qwen3_5_tiny", "qwen3_5_35b_a3b"):
        cfg = VLMConfig.preset(name)
        assert cfg.family == "qwen3_5_moe" and VLMConfig.from_hf(cfg.to_hf()) == cfg
        theirs = Qwen3_5MoeConfig(**cfg.to_hf()).to_dict()  # transformers takes what we write
        assert VLMConfig.from_hf(theirs) == cfg
    saved = json.loads((reference["full_first_tied_top1"][1] / "config.json").read_text())
    again = VLMConfig.from_hf(saved).to_hf("float32")
    for part in ("text_config", "vision_config"):
        assert {k: v for k, v in again[part].items() if k in saved[part]} == {
            k: v for k, v in saved[part].items() if k in again[part]
        }
    assert VLMConfig.preset("tiny").family == "qwen3_vl_moe"


def test_config_json_reads_the_hubs_keys_and_refuses_what_changes_the_numbers():
    hub = VLMConfig.preset("qwen3_5_35b_a3b").to_hf()
    tc = hub["text_config"]
    del tc["layer_types"]  # the hub's interval form
    tc |= {"full_attention_interval": 4, "mtp_num_hidden_layers": 1, "attn_output_gate": True}
    hub["vision_config"]["deepstack_visual_indexes"] = []
    assert VLMConfig.from_hf(hub) == VLMConfig.preset("qwen3_5_35b_a3b")
    tc["full_attention_interval"] = 2
    assert VLMConfig.from_hf(hub).text.layer_types[:4] == ("linear_attention", "full_attention") * 2
    for change, words in (
        ({"rope_parameters": dict(tc["rope_parameters"], rope_type="yarn")}, "rope_type='yarn'"),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
        ({"attn_output_gate": False}, "always gated"),
    ):
        with pytest.raises(ConfigError, match=words):
            VLMConfig.from_hf(dict(hub, text_config=tc | change))
    mixed = VLMConfig.preset("qwen3_5_tiny")
    mixed.vision.deepstack_visual_indexes = (0,)
    with pytest.raises(ConfigError, match="mixes the families.*deepstack"):
        mixed.to_hf()


def test_a_folder_of_the_other_family_is_refused(reference, tmp_path):
    from moevlm.parallel.hf_io import load_hf_weights_

    vl = Qwen3VLMoe(VLMConfig.preset("tiny"))
    vl.save_pretrained(tmp_path / "vl")
    q35_folder = reference["qwen3_5_tiny"][1]
    q35 = Qwen3VLMoe(_tiny())
    with pytest.raises(hf_io.CheckpointError, match="Qwen3-VL-MoE checkpoint .* is Qwen3.5-MoE"):
        load_hf_weights_(q35, tmp_path / "vl")
    with pytest.raises(hf_io.CheckpointError, match="Qwen3.5-MoE checkpoint .* is Qwen3-VL-MoE"):
        load_hf_weights_(vl, q35_folder)
    with pytest.raises(hf_io.CheckpointError, match="missing: .*linear_attn"):  # by names too
        hf_io.match_checkpoint(hf_io.expected_shapes(q35), hf_io.checkpoint_files(tmp_path / "vl"))


def test_per_expert_pieces_are_checked_and_mtp_is_not_read(reference, tmp_path):
    folder = reference["qwen3_5_tiny"][1]
    tensors = load_file(folder / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(3, 3)  # the hub's multi-token-prediction head
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    Qwen3VLMoe.from_pretrained(tmp_path)
    gone = "model.language_model.layers.2.mlp.experts.5.up_proj.weight"
    tensors[gone.replace("up_proj", "down_proj")] = torch.zeros(3, 3)
    del tensors[gone]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(hf_io.CheckpointError, match=rf"missing: {gone}(.|\n)*wrong shape"):
        Qwen3VLMoe.from_pretrained(tmp_path)
