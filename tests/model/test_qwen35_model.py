"""The Qwen3.5-MoE hybrid decoder assembled from its blocks (`TextConfig.layer_types`: Gated DeltaNet and
gated full-attention layers; the shared expert, partial rotary, zero-centred norms; the vision tower
without deepstack) equals transformers' `Qwen3_5MoeForConditionalGeneration` on a random tiny config:
logits and every gradient of a text-only batch (fp32, CPU, weights copied by name); its parameters are
counted in closed form, its layers' FLOPs by hand; tensor and context parallelism whose ranks do not
divide the key heads, and CUDA graphs of its attention regions, are refused with the reason."""

from __future__ import annotations

import pytest
import torch
from hf_ref import as_ours, qwen35_model

from moevlm.errors import ConfigError
from moevlm.model import Qwen3VLMoe, VLMConfig, hf

pytestmark = pytest.mark.usefixtures("_fp32_and_seed")
LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention", "linear_attention")
GDN = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
)


def _ours() -> VLMConfig:
    cfg = VLMConfig.preset("tiny")
    t, m = cfg.text, cfg.moe
    t.num_layers, t.layer_types = len(LAYER_TYPES), LAYER_TYPES
    t.attn_output_gate, t.partial_rotary_factor, t.norm_zero_centered = True, 0.5, True
    t.mrope_section = (2, 1, 1)
    for k, v in GDN.items():
        setattr(t, k, v)
    m.shared_expert_intermediate_size = 40
    cfg.vision.deepstack_visual_indexes = ()
    return cfg.validate()


def _reference(cfg: VLMConfig):
    pytest.importorskip("transformers.models.qwen3_5_moe")
    return qwen35_model(cfg)  # transformers' model of our config.json, every parameter randomised


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _as_ours(name: str, t: torch.Tensor, cfg: VLMConfig) -> tuple[str, torch.Tensor]:
    """`as_ours`, a Gated DeltaNet's in_proj_qkv rows and conv channels grouped by key head as
    moevlm.model.hf loads them."""
    ours, t = as_ours(name, t)
    if ours.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")):
        t = t[hf.key_head_order(cfg)]
    return ours, t


def test_hybrid_decoder_equals_the_reference_logits_and_gradients():
    cfg = _ours()
    ref = _reference(cfg)
    ours = Qwen3VLMoe(cfg).eval()
    state = dict(_as_ours(n, t, cfg) for n, t in ref.state_dict().items())
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    ids = torch.randint(0, 1000, (2, 37))
    want = ref(input_ids=ids).logits
    got = ours(input_ids=ids).logits
    assert got.shape == want.shape
    assert _rel(got, want) <= 1e-5
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    grads = {n: p.grad for n, p in ours.named_parameters()}
    checked = 0
    for name, p in ref.named_parameters():
        if p.grad is None:  # the vision tower: no image in the batch
            continue
        mine, want_g = _as_ours(name, p.grad, cfg)
        assert _rel(grads[mine], want_g) <= 5e-5, name  # A_log / dt_bias: see test_gated_deltanet
        checked += 1
    assert checked > 40


def test_packed_documents_equal_each_alone():
    """A row of two documents (positions restarting) gives each document's logits alone: attention's
    mask and the Gated DeltaNet layers' state and conv reset read the same `cu_seqlens`."""
    model = Qwen3VLMoe(_ours()).eval()
    model.init_weights()
    lengths = (15, 22)
    ids = torch.randint(0, 1000, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths]).expand(3, 1, -1)
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    with torch.no_grad():
        packed = model(ids, position_ids=pos, cu_seqlens=cu, return_logits=True).logits
        alone = [model(d, return_logits=True).logits for d in ids.split(lengths, dim=1)]
        crossed = model(ids, position_ids=pos, return_logits=True).logits  # one document
    assert _rel(packed, torch.cat(alone, dim=1)) <= 1e-5
    assert _rel(crossed[:, lengths[0] :], alone[1]) > 1e-2  # without the bounds it reads across


def test_parameters_flops_and_refused_layouts():
    from moevlm.model.flops import layer_forward_parts
    from moevlm.model.params import parameter_counts
    from moevlm.parallel import ParallelDims

    cfg = _ours()
    with torch.device("meta"):
        model = Qwen3VLMoe(cfg)
    assert sum(parameter_counts(cfg).values()) == sum(p.numel() for p in model.parameters())
    assert model.text.layers[0].self_attn is None and model.text.layers[1].linear_attn is None
    T, D, H, Kd, Vd = 100, cfg.text.hidden_size, 4, 8, 12
    conv = 2 * 2 * Kd + H * Vd
    by_hand = {  # in_proj_qkv, z, b, a; out_proj; the depthwise conv (K 4); the recurrence
        "attn_proj": 2 * T * D * (conv + H * Vd + 2 * H) + 2 * T * H * Vd * D + 2 * T * conv * 4,
        "core_attn": 6 * T * H * Kd * Vd,
    }
    parts = layer_forward_parts(cfg, 0, [T])
    assert {k: parts[k] for k in by_hand} == by_hand
    with pytest.raises(ConfigError, match=r"linear_num_key_heads=2 .* by parallel.cp x tp=4"):
        ParallelDims(4, cp=2, tp=2).check_model(cfg)
    for dims, name in ((ParallelDims(4, tp=4), "tp"), (ParallelDims(4, cp=4), "cp")):
        with pytest.raises(ConfigError, match=f"linear_num_key_heads=2 .* by parallel.{name}=4"):
            dims.check_model(cfg)
    for dims in (ParallelDims(2, ep=2), ParallelDims(2, tp=2), ParallelDims(2, cp=2)):
        dims.check_model(cfg)  # FSDP / EP; TP and CP by key heads
    cfg.text.linear_num_key_heads, cfg.text.linear_num_value_heads = 4, 8
    ParallelDims(4, cp=2, tp=2).check_model(cfg)  # each tp rank's key heads over cp
    from moevlm.parallel.cuda_graphs import apply_cuda_graphs

    with pytest.raises(ValueError, match="cannot capture a Gated DeltaNet layer"):
        apply_cuda_graphs(Qwen3VLMoe(cfg), ("attn",))
