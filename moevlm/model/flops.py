"""Model FLOPs of one micro-batch, vision tower included, for TFLOP/s and MFU.

    flops = count_flops(cfg, doc_lens, image_grid_thw)      # a FlopCount of one micro-batch

The conventions are those of `torch.utils.flop_counter.FlopCounterMode` and the PaLM/torchtitan
MFU formula: a (m x k) @ (k x n) product is 2*m*k*n; norms, activations, softmax, rotary and the
loss are not counted; attention is the full L x L square per document; experts count at top-k;
training is 3x forward (2x for the patch embedding, 1x for a frozen vision tower); recompute is
not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from moevlm.model.attention import doc_bounds
from moevlm.model.config import VLMConfig


@dataclass
class FlopCount:
    vision: float
    decoder: float

    @property
    def total(self) -> float:
        return self.vision + self.decoder


def decoder_forward_flops(cfg: VLMConfig, doc_lens: Sequence[int]) -> float:
    """Every decoder layer and the LM head, forward."""
    return sum(
        layer_forward_flops(cfg, i, doc_lens) for i in range(cfg.text.num_layers)
    ) + head_forward_flops(cfg, sum(doc_lens))


def layer_forward_flops(cfg: VLMConfig, layer_idx: int, doc_lens: Sequence[int]) -> float:
    """Decoder layer `layer_idx` (attention + MoE or dense MLP, the router included), forward."""
    return float(sum(layer_forward_parts(cfg, layer_idx, doc_lens).values()))


def layer_forward_parts(cfg: VLMConfig, layer_idx: int, doc_lens: Sequence[int]) -> dict[str, int]:
    """Decoder layer `layer_idx`'s forward FLOPs by region: attention's projections ("attn_proj"),
    its QK^T and PV ("core_attn") (a Gated DeltaNet's: `gated_deltanet_parts`), and the MoE block with
    its router ("moe") or the dense MLP ("mlp")."""
    t, m = cfg.text, cfg.moe
    T = sum(doc_lens)
    D, hd = t.hidden_size, t.head_dim
    q, kv = t.num_heads * hd, t.num_kv_heads * hd
    if t.is_linear_layer(layer_idx):  # a Gated DeltaNet instead of attention
        parts = gated_deltanet_parts(cfg, T)
    else:
        parts = {
            # q_proj emits each head's output gate too under attn_output_gate
            "attn_proj": 2 * T * D * (q * (2 if t.attn_output_gate else 1) + 2 * kv)
            + 2 * T * q * D,
            "core_attn": sum(4 * L * L * q for L in doc_lens),
        }
    if m.is_moe_layer(layer_idx):
        parts["moe"] = 2 * T * D * m.num_experts + T * m.top_k * 6 * D * m.moe_intermediate_size
        if m.shared_expert_intermediate_size:  # the shared expert's SwiGLU and its gate
            parts["moe"] += 6 * T * D * m.shared_expert_intermediate_size + 2 * T * D
    else:
        parts["mlp"] = 6 * T * D * t.intermediate_size
    return parts


def gated_deltanet_parts(cfg: VLMConfig, T: int) -> dict[str, int]:
    """A Gated DeltaNet layer's forward over T tokens: its projections and depthwise conv
    ("attn_proj"), and the delta rule ("core_attn") counted as its recurrence's useful work, per
    token and value head 6 Kd Vd (read the state with k, write k times the correction into it, read
    it with q), whatever the chunked form computes on top."""
    t = cfg.text
    H, Kd, Vd = t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim
    key, value = t.linear_num_key_heads * Kd, H * Vd
    conv = 2 * key + value
    proj = 2 * T * t.hidden_size * (conv + value + 2 * H) + 2 * T * value * t.hidden_size
    return {
        "attn_proj": proj + 2 * T * conv * t.linear_conv_kernel_dim,
        "core_attn": 6 * T * H * Kd * Vd,
    }


def head_forward_flops(cfg: VLMConfig, tokens: int) -> float:
    """The LM head (the loss itself is not counted), forward."""
    return float(2 * tokens * cfg.text.hidden_size * cfg.text.vocab_size)


def vision_forward_flops(
    cfg: VLMConfig, image_grid_thw: torch.Tensor | Sequence | None
) -> tuple[float, float]:
    """(whole tower, of which patch embedding) forward FLOPs."""
    if image_grid_thw is None or len(image_grid_thw) == 0:
        return 0.0, 0.0
    v = cfg.vision
    grids = (
        image_grid_thw.tolist()
        if isinstance(image_grid_thw, torch.Tensor)
        else list(image_grid_thw)
    )
    N = sum(t * h * w for t, h, w in grids)
    d, wide = v.hidden_size, v.hidden_size * v.spatial_merge_size**2
    patch = 2 * N * v.patch_dim * d
    block = vision_block_forward_parts(cfg, grids)
    per_block, attn_core = block["linear"] + block["mlp"], block["core_attn"]
    merged = N // v.spatial_merge_size**2
    merger = 2 * merged * wide * wide + 2 * merged * wide * v.out_hidden_size
    total = (
        patch
        + v.depth * per_block
        + attn_core * v.depth
        + merger * (1 + len(v.deepstack_visual_indexes))
    )
    return float(total), float(patch)


def vision_block_forward_parts(cfg: VLMConfig, grids: Sequence) -> dict[str, int]:
    """One vision block's forward FLOPs over images of patch grids `grids` ((t, h, w) each), by
    region: qkv and output projections ("linear"), attention's QK^T and PV per image ("core_attn"),
    the MLP ("mlp")."""
    v = cfg.vision
    N, d = sum(t * h * w for t, h, w in grids), v.hidden_size
    return {
        "linear": 2 * N * d * 3 * d + 2 * N * d * d,
        "core_attn": sum(t * 4 * (h * w) ** 2 * d for t, h, w in grids),
        "mlp": 4 * N * d * v.intermediate_size,
    }


def count_flops(
    cfg: VLMConfig,
    doc_lens: Sequence[int],
    image_grid_thw=None,
    *,
    training: bool = True,
    freeze_vision: bool = False,
) -> FlopCount:
    """FLOPs of one micro-batch: `doc_lens` are the text document lengths (padding
    included: it is computed), `image_grid_thw` the images' patch grids."""
    dec = decoder_forward_flops(cfg, doc_lens)
    vis, patch = vision_forward_flops(cfg, image_grid_thw)
    if training:
        dec *= 3
        vis = vis if freeze_vision else 3 * vis - patch
    return FlopCount(vision=vis, decoder=dec)


def doc_lens_of(batch: int, seq: int, cu_seqlens: torch.Tensor | None = None) -> list[int]:
    """Document lengths of a (batch, seq) input packed with `cu_seqlens`."""
    b = doc_bounds(batch, seq, cu_seqlens)
    return [y - x for x, y in zip(b[:-1], b[1:]) if y > x]
