"""Hugging Face `config.json` <-> the fields of our model config, for both families: Qwen3-VL-MoE
(`qwen3_vl_moe`) and Qwen3.5-MoE (`qwen3_5_moe`, transformers' `Qwen3_5MoeConfig`).

    parts = read(hf_dict)        # {"vision": {...}, "text": {...}, "moe": {...}, top-level fields}
    hf_dict = write(cfg, dtype)  # the family `cfg.family` names

Qwen3.5 keys the reference reads but whose value it fixes, and we with it: every layer is MoE
(`mlp_only_layers`, `decoder_sparse_step` ignored), M-RoPE is interleaved, norms zero-centred, full
attention gated, no deepstack. Keys that leave the forward unchanged are ignored (`mtp_*` and the
`mtp.*` weights, `use_cache`, token ids of bos/eos/pad, `mamba_ssm_dtype`, `output_router_logits`);
those that would change it and that we do not model are refused: a `rope_type` other than default,
`attention_dropout` > 0, `attn_output_gate: false`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moevlm.errors import ConfigError, check

if TYPE_CHECKING:
    from moevlm.model.config import VLMConfig

FAMILIES = {"qwen3_vl_moe": "Qwen3-VL-MoE", "qwen3_5_moe": "Qwen3.5-MoE"}
# transformers' Qwen3_5MoeTextConfig / VisionConfig / Config defaults (a key absent from a file)
Q35_TEXT = dict(
    vocab_size=248320,
    hidden_size=2048,
    num_hidden_layers=40,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    hidden_act="silu",
    max_position_embeddings=32768,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    attention_bias=False,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts_per_tok=8,
    num_experts=256,
    router_aux_loss_coef=0.001,
)
Q35_VISION = dict(
    depth=27,
    hidden_size=1152,
    hidden_act="gelu_pytorch_tanh",
    intermediate_size=4304,
    num_heads=16,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=3584,
    num_position_embeddings=2304,
    initializer_range=0.02,
)
Q35_TOKENS = dict(
    image_token_id=248056,
    video_token_id=248057,
    vision_start_token_id=248053,
    vision_end_token_id=248054,
)
VL_TOKENS = dict(
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
)
_LINEAR = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
_VISION_SIZES = (
    "depth",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "in_channels",
    "patch_size",
    "temporal_patch_size",
    "spatial_merge_size",
    "out_hidden_size",
    "num_position_embeddings",
    "hidden_act",
    "initializer_range",
)


# ---------------------------------------------------------------------- read
def read(hf: dict[str, Any]) -> dict[str, Any]:
    """The fields of VisionConfig, TextConfig, MoEConfig (under "vision", "text", "moe") and of
    VLMConfig that `hf` (a config.json dict of either family) describes; a field left out takes our
    dataclass default."""
    kind = hf.get("model_type")
    if kind == "qwen3_5_moe":
        return _read_qwen35(hf)
    if kind in (None, "qwen3_vl_moe"):
        return _read_qwen3_vl(hf)
    raise ConfigError(
        f"config.json has model_type={kind!r}; expected one of {sorted(FAMILIES)} ("
        + ", ".join(FAMILIES.values())
        + ")"
    )


def _rope(tc: dict) -> dict:
    return tc.get("rope_parameters") or tc.get("rope_scaling") or {}


def _read_qwen3_vl(hf: dict) -> dict:
    tc, vc = hf.get("text_config", {}), hf.get("vision_config", {})
    rope = _rope(tc)
    heads = tc["num_attention_heads"]
    text = dict(
        vocab_size=tc["vocab_size"],
        hidden_size=tc["hidden_size"],
        num_layers=tc["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=tc.get("num_key_value_heads") or heads,
        head_dim=tc.get("head_dim") or tc["hidden_size"] // heads,
        rms_norm_eps=tc.get("rms_norm_eps", 1e-6),
        mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
        attention_bias=tc.get("attention_bias", False),
        hidden_act=tc.get("hidden_act", "silu"),
        initializer_range=tc.get("initializer_range", 0.02),
    )
    _some(text, tc, intermediate_size=None, max_position_embeddings=None)
    theta = rope.get("rope_theta", tc.get("rope_theta"))
    if theta is not None:
        text["rope_theta"] = float(theta)
    if "mrope_section" in rope:
        text["mrope_section"] = tuple(rope["mrope_section"])
    moe = dict(
        decoder_sparse_step=tc.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(tc.get("mlp_only_layers") or ()),
        router_aux_loss_coef=tc.get("router_aux_loss_coef", 0.001),
    )
    experts = tc.get("num_experts", tc.get("num_local_experts"))
    if experts is not None:
        moe["num_experts"] = experts
    _some(moe, tc, top_k="num_experts_per_tok", moe_intermediate_size=None)
    required = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
    missing = [k for k in (*required, "num_position_embeddings") if k not in vc]
    if missing:
        raise KeyError(f"vision_config has no {missing[0]!r}")
    vision = _read_vision(vc, {})
    vision["deepstack_visual_indexes"] = tuple(vc.get("deepstack_visual_indexes", ()))
    return dict(vision=vision, text=text, moe=moe, **_top(hf, VL_TOKENS))


def _some(out: dict, src: dict, **names) -> None:
    """out[ours] = src[theirs or ours] for the keys `src` has."""
    for ours, theirs in names.items():
        if (theirs or ours) in src:
            out[ours] = src[theirs or ours]


def _read_vision(vc: dict, defaults: dict) -> dict:
    """Vision fields from `vc`; absent keys take `defaults` (the family's) or ours."""
    vision = {k: vc.get(k, defaults.get(k)) for k in _VISION_SIZES if k in vc or k in defaults}
    theta = (vc.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return dict(vision, rope_theta=float(theta))


def _top(hf: dict, tokens: dict) -> dict:
    out = {k: hf.get(k, v) for k, v in tokens.items()}
    return dict(out, tie_word_embeddings=hf.get("tie_word_embeddings", False))


def _read_qwen35(hf: dict) -> dict:
    tc, vc = hf.get("text_config") or {}, hf.get("vision_config") or {}

    def get(key: str):
        return tc.get(key, Q35_TEXT[key])

    rope = _rope(tc)
    _refuse_unmodelled(tc, rope)
    layers, heads = get("num_hidden_layers"), get("num_attention_heads")
    types = tuple(tc.get("layer_types") or interval_layer_types(layers, tc))
    text = dict(
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or get("hidden_size") // heads,
        rms_norm_eps=get("rms_norm_eps"),
        rope_theta=float(rope.get("rope_theta", tc.get("rope_theta", 10000.0))),
        mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
        mrope_interleaved=True,
        partial_rotary_factor=rope.get(
            "partial_rotary_factor", tc.get("partial_rotary_factor", 0.25)
        ),
        max_position_embeddings=get("max_position_embeddings"),
        attention_bias=get("attention_bias"),
        hidden_act=get("hidden_act"),
        initializer_range=get("initializer_range"),
        attn_output_gate=True,
        norm_zero_centered=True,
        layer_types=types if "linear_attention" in types else (),
        **{k: get(k) for k in _LINEAR},
    )
    _some(text, tc, intermediate_size=None)
    moe = dict(
        num_experts=get("num_experts"),
        top_k=get("num_experts_per_tok"),
        moe_intermediate_size=get("moe_intermediate_size"),
        shared_expert_intermediate_size=get("shared_expert_intermediate_size"),
        router_aux_loss_coef=get("router_aux_loss_coef"),
    )
    vision = dict(_read_vision(vc, Q35_VISION), deepstack_visual_indexes=())
    return dict(vision=vision, text=text, moe=moe, **_top(hf, Q35_TOKENS))


def interval_layer_types(layers: int, tc: dict) -> list[str]:
    """The reference's pattern without `layer_types`: every `full_attention_interval`-th layer full."""
    every = tc.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]


def _refuse_unmodelled(tc: dict, rope: dict) -> None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    check(
        kind in ("default", "mrope"),
        f"config.json text_config rope_type={kind!r}: only the default rotary embedding is modelled "
        "(no rope scaling); remove the scaling or use transformers",
    )
    check(
        not tc.get("attention_dropout"),
        f"config.json text_config attention_dropout={tc.get('attention_dropout')!r}: attention dropout "
        "is not modelled; set it to 0",
    )
    check(
        tc.get("attn_output_gate", True) is not False,
        "config.json text_config attn_output_gate=false: Qwen3.5-MoE's full attention is always "
        "gated (transformers' Qwen3_5MoeAttention); remove the key",
    )


# --------------------------------------------------------------------- write
def write(cfg: VLMConfig, dtype: str) -> dict[str, Any]:
    """The Hugging Face `config.json` dict of `cfg`, in the form of its family (`cfg.family`)."""
    return _write_qwen35(cfg, dtype) if cfg.family == "qwen3_5_moe" else _write_qwen3_vl(cfg, dtype)


def _text_common(cfg: VLMConfig, dtype: str) -> dict:
    t, m = cfg.text, cfg.moe
    return {
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "num_hidden_layers": t.num_layers,
        "num_attention_heads": t.num_heads,
        "num_key_value_heads": t.num_kv_heads,
        "head_dim": t.head_dim,
        "rms_norm_eps": t.rms_norm_eps,
        "max_position_embeddings": t.max_position_embeddings,
        "attention_bias": t.attention_bias,
        "hidden_act": t.hidden_act,
        "initializer_range": t.initializer_range,
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.moe_intermediate_size,
        "router_aux_loss_coef": m.router_aux_loss_coef,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "dtype": dtype,
    }


def _vision_common(cfg: VLMConfig) -> dict:
    v = cfg.vision
    return {k: getattr(v, k) for k in _VISION_SIZES} | {
        "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}
    }


def _top_common(cfg: VLMConfig, dtype: str) -> dict:
    return {
        "image_token_id": cfg.image_token_id,
        "video_token_id": cfg.video_token_id,
        "vision_start_token_id": cfg.vision_start_token_id,
        "vision_end_token_id": cfg.vision_end_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "dtype": dtype,
    }


def _write_qwen3_vl(cfg: VLMConfig, dtype: str) -> dict:
    t, m = cfg.text, cfg.moe
    check(
        t.partial_rotary_factor == 1.0,
        f"text.partial_rotary_factor={t.partial_rotary_factor}: a Qwen3-VL-MoE config.json has no "
        "partial rotary; only the Qwen3.5-MoE form (zero-centred norms, gated attention, shared expert) "
        "does",
    )
    text = dict(_text_common(cfg, dtype), model_type="qwen3_vl_moe_text")
    text |= {
        "intermediate_size": t.intermediate_size,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": t.rope_theta,
            "mrope_section": list(t.mrope_section),
            "mrope_interleaved": t.mrope_interleaved,
        },
        "decoder_sparse_step": m.decoder_sparse_step,
        "mlp_only_layers": list(m.mlp_only_layers),
    }
    vision = dict(_vision_common(cfg), model_type="qwen3_vl_moe_vision")
    vision["deepstack_visual_indexes"] = list(cfg.vision.deepstack_visual_indexes)
    return {
        "architectures": ["Qwen3VLMoeForConditionalGeneration"],
        "model_type": "qwen3_vl_moe",
        "text_config": text,
        "vision_config": vision,
        **_top_common(cfg, dtype),
    }


def _write_qwen35(cfg: VLMConfig, dtype: str) -> dict:
    _check_qwen35_form(cfg)
    t, m = cfg.text, cfg.moe
    text = dict(_text_common(cfg, dtype), model_type="qwen3_5_moe_text")
    text |= {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": t.rope_theta,
            "partial_rotary_factor": t.partial_rotary_factor,
            "mrope_section": list(t.mrope_section),
            "mrope_interleaved": True,
        },
        "layer_types": list(t.layer_types or ["full_attention"] * t.num_layers),
        "shared_expert_intermediate_size": m.shared_expert_intermediate_size,
        **{k: getattr(t, k) for k in _LINEAR},
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "vision_config": dict(_vision_common(cfg), model_type="qwen3_5_moe_vision"),
        **_top_common(cfg, dtype),
    }


def _check_qwen35_form(cfg: VLMConfig) -> None:
    """What transformers' Qwen3.5-MoE always has: a config with less cannot be written in its form."""
    t, m, v = cfg.text, cfg.moe, cfg.vision
    fixed = {
        "text.norm_zero_centered=true": t.norm_zero_centered,
        "text.attn_output_gate=true": t.attn_output_gate,
        "text.mrope_interleaved=true": t.mrope_interleaved,
        "moe.num_experts > 0": m.num_experts > 0,
        "moe.shared_expert_intermediate_size > 0": m.shared_expert_intermediate_size > 0,
        "moe.mlp_only_layers=[] and moe.decoder_sparse_step=1 (every layer MoE)": not m.mlp_only_layers
        and m.decoder_sparse_step == 1,
        "vision.deepstack_visual_indexes=[]": not v.deepstack_visual_indexes,
    }
    lacking = [k for k, ok in fixed.items() if not ok]
    check(
        not lacking,
        f"this config mixes the families: it has Qwen3.5-MoE options but not {lacking}, which "
        "transformers' Qwen3.5-MoE always has; it cannot be written as either config.json",
    )
