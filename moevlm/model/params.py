"""Parameter counts in closed form, from the config alone (no module is built).

    parameter_counts(cfg)      # {"vision": ..., "embed_tokens": ..., "layers": ..., "norm": ..., "lm_head": ...}
    layer_parameters(cfg, i)   # decoder layer i by part: q_o, k_v, norms, router, experts, dense_mlp

Counted by the parts a parallel layout shards differently; a tied LM head counts 0.  Tests hold
the counts equal to `sum(p.numel())` of the model built on meta.
"""

from __future__ import annotations

from moevlm.model.config import VisionConfig, VLMConfig


def linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def vision_parameters(v: VisionConfig) -> int:
    """Patch embedding, position table, blocks, the merger and the deepstack mergers."""
    h = v.hidden_size
    block = (
        2 * h
        + linear(h, 3 * h)
        + linear(h, h)
        + 2 * h
        + linear(h, v.intermediate_size)
        + linear(v.intermediate_size, h)
    )
    width = h * v.spatial_merge_size**2
    merger = linear(width, width) + linear(width, v.out_hidden_size)
    # pre / post-shuffle norm
    mergers = (2 * h + merger) + len(v.deepstack_visual_indexes) * (2 * width + merger)
    return linear(v.patch_dim, h) + v.num_position_embeddings * h + v.depth * block + mergers


def layer_parameters(cfg: VLMConfig, layer_idx: int) -> dict[str, int]:
    """Decoder layer `layer_idx` by part (an MoE layer has router + experts, a dense one dense_mlp)."""
    t, m = cfg.text, cfg.moe
    D, q, kv, bias = (
        t.hidden_size,
        t.num_heads * t.head_dim,
        t.num_kv_heads * t.head_dim,
        t.attention_bias,
    )
    parts = {
        "q_o": linear(D, q * (2 if t.attn_output_gate else 1), bias) + linear(q, D, bias),
        "k_v": 2 * linear(D, kv, bias),
        "norms": 2 * D + 2 * t.head_dim,
        "linear_attn": 0,
        "router": 0,
        "experts": 0,
        "dense_mlp": 0,
    }
    if t.is_linear_layer(layer_idx):  # a Gated DeltaNet instead of attention
        parts["q_o"] = parts["k_v"] = 0
        parts["norms"] = 2 * D
        parts["linear_attn"] = gated_deltanet_parameters(cfg)
    if m.is_moe_layer(layer_idx):
        parts["router"] = m.num_experts * D
        # gate_up (E, D, 2F) + down (E, F, D)
        parts["experts"] = m.num_experts * 3 * D * m.moe_intermediate_size
        # a shared expert is laid out as a dense MLP, its gate as the router (replicated)
        parts["dense_mlp"] = 3 * D * m.shared_expert_intermediate_size
        parts["router"] += D if m.shared_expert_intermediate_size else 0
    else:
        parts["dense_mlp"] = 3 * D * t.intermediate_size
    return parts


def gated_deltanet_parameters(cfg: VLMConfig) -> int:
    """One Gated DeltaNet layer: in_proj_qkv / z / b / a, the depthwise conv, dt_bias, A_log, the
    gated norm and out_proj."""
    t = cfg.text
    key = t.linear_num_key_heads * t.linear_key_head_dim
    value = t.linear_num_value_heads * t.linear_value_head_dim
    conv, H, D = 2 * key + value, t.linear_num_value_heads, t.hidden_size
    projections = D * (conv + value + 2 * H) + value * D
    return projections + conv * t.linear_conv_kernel_dim + 2 * H + t.linear_value_head_dim


def moe_layer_count(cfg: VLMConfig, layers: range | None = None) -> int:
    """How many of `layers` (default: all) are MoE layers."""
    layers = range(cfg.text.num_layers) if layers is None else layers
    return sum(1 for i in layers if cfg.moe.is_moe_layer(i))


def layers_parameters(cfg: VLMConfig, layers: range | None = None) -> dict[str, int]:
    """`layer_parameters` summed over `layers` (default: all): one count per kind of layer (MoE or
    dense, attention or Gated DeltaNet), times how many there are."""
    layers = range(cfg.text.num_layers) if layers is None else layers
    kinds: dict[tuple[bool, bool], list[int]] = {}
    for i in layers:
        kinds.setdefault((cfg.moe.is_moe_layer(i), cfg.text.is_linear_layer(i)), []).append(i)
    out = dict.fromkeys(layer_parameters(cfg, 0), 0)
    for idx in kinds.values():
        for k, v in layer_parameters(cfg, idx[0]).items():
            out[k] += v * len(idx)
    return out


def parameter_counts(cfg: VLMConfig) -> dict[str, int]:
    """Parameters of `Qwen3VLMoe(cfg)` by top-level part; their sum is the model's."""
    t = cfg.text
    return {
        "vision": vision_parameters(cfg.vision),
        "embed_tokens": t.vocab_size * t.hidden_size,
        "layers": sum(layers_parameters(cfg).values()),
        "norm": t.hidden_size,
        "lm_head": 0 if cfg.tie_word_embeddings else t.vocab_size * t.hidden_size,
    }


def num_parameters(cfg: VLMConfig) -> int:
    return sum(parameter_counts(cfg).values())


__all__ = [
    "layer_parameters",
    "layers_parameters",
    "moe_layer_count",
    "num_parameters",
    "parameter_counts",
    "vision_parameters",
]
