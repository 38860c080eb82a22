"""Qwen3.5-MoE's blocks in the Qwen3-VL-MoE model, each equal to its transformers reference in output and
every gradient (fp32, CPU, weights copied):
- the MoE block's gated shared expert (`MoEConfig.shared_expert_intermediate_size`) against
  `Qwen3_5MoeSparseMoeBlock` (routed experts + a SwiGLU over every token scaled by a sigmoid gate), and
  under every router option (global-batch and sequence aux loss, expert bias, z-loss, forced balance)
  the routed output beside the whole gated shared expert;
- the zero-centred RMSNorm (`TextConfig.norm_zero_centered`: scale 1 + w, w initialised 0) against
  `Qwen3_5MoeRMSNorm` (fp32 to 1e-6, bf16 bit-equal);
- gated attention with partial rotary (`TextConfig.attn_output_gate`, `partial_rotary_factor`) against
  `Qwen3_5MoeAttention`, its rotary cos/sin against `Qwen3_5MoeTextRotaryEmbedding` (interleaved M-RoPE on
  the first dims of each head);
- the vision tower without deepstack (`VisionConfig.deepstack_visual_indexes=()`) against
  `Qwen3_5MoeVisionModel` (learned position grid interpolated to each image, 2-D rotary, the merger), on
  two images of different grids;
their parameters and FLOPs counted in closed form; on 2 gloo ranks the tiny model with both, tp2 and
tp2 x ep2 (FSDP, all-to-all; the shared expert sharded as a dense MLP, its gate replicated; q_proj's
query and gate rows sharded by head), gives the one-process loss and gradients.  Off, the blocks are the
Qwen3-VL-MoE ones, which the other model tests hold."""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import run_ranks

from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model.config import MoEConfig
from moevlm.model.moe import MoEBlock

pytestmark = pytest.mark.usefixtures("_fp32_and_seed")
D, E, K, F, FS = 32, 8, 2, 24, 40


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm())


def test_equals_the_reference_block_with_gradients():
    pytest.importorskip("transformers.models.qwen3_5_moe")
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    hf_cfg = Qwen3_5MoeTextConfig(
        hidden_size=D,
        moe_intermediate_size=F,
        shared_expert_intermediate_size=FS,
        num_experts=E,
        num_experts_per_tok=K,
    )
    ref = Qwen3_5MoeSparseMoeBlock(hf_cfg)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = MoEBlock(D, MoEConfig(E, K, F, grouped_gemm="loop", shared_expert_intermediate_size=FS))
    with torch.no_grad():
        ours.router.weight.copy_(ref.gate.weight)
        ours.experts.gate_up_proj.copy_(ref.experts.gate_up_proj.transpose(1, 2))
        ours.experts.down_proj.copy_(ref.experts.down_proj.transpose(1, 2))
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared_expert, name).weight.copy_(getattr(ref.shared_expert, name).weight)
        ours.shared_expert_gate.weight.copy_(ref.shared_expert_gate.weight)
    x = torch.randn(2, 11, D)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, (got, _) = ref(xr), ours(xo)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    assert _rel(got, want) <= 1e-5
    assert _rel(xo.grad, xr.grad) <= 1e-5
    pairs = {
        "router.weight": ref.gate.weight.grad,
        "experts.gate_up_proj": ref.experts.gate_up_proj.grad.transpose(1, 2),
        "experts.down_proj": ref.experts.down_proj.grad.transpose(1, 2),
        "shared_expert_gate.weight": ref.shared_expert_gate.weight.grad,
        **{
            f"shared_expert.{n}.weight": getattr(ref.shared_expert, n).weight.grad
            for n in ("gate_proj", "up_proj", "down_proj")
        },
    }
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert grads.keys() == pairs.keys()
    for name, want_g in pairs.items():
        assert _rel(grads[name], want_g) <= 1e-5, name


@pytest.mark.parametrize(
    "option",
    [
        dict(aux_loss="global_batch"),
        dict(aux_loss="sequence"),
        dict(router_bias_rate=1e-3),
        dict(z_loss_coeff=1e-3),
        dict(router_force_balance=True),
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_router_options_route_beside_a_whole_shared_expert(option):
    """Under each router option the block is the routed experts' output (the same block without the
    shared expert) plus the gated shared expert over every token, and both get gradients."""
    torch.manual_seed(0)
    cfg = MoEConfig(E, K, F, grouped_gemm="loop", shared_expert_intermediate_size=FS, **option)
    block = MoEBlock(D, cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    for b in block.buffers():  # an expert bias that moves the choices
        b.normal_(std=0.5) if b.is_floating_point() else None
    x = torch.randn(2, 11, D)
    y, _ = block(x)
    y.square().sum().backward()
    shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    keep = block.shared_expert, block.shared_expert_gate
    block.shared_expert = block.shared_expert_gate = None
    with torch.no_grad():
        routed, _ = block(x)
    block.shared_expert, block.shared_expert_gate = keep
    assert _rel(y.detach() - shared.detach(), routed) <= 1e-6
    assert block.shared_expert.down_proj.weight.grad.abs().sum() > 0
    assert block.experts.down_proj.grad.abs().sum() > 0


def _tiny_with_shared() -> VLMConfig:
    """The tiny preset with the shared expert, gated attention, rotary on half of each head and
    zero-centred norms."""
    cfg = VLMConfig.preset("tiny")
    cfg.moe.shared_expert_intermediate_size = FS
    cfg.text.attn_output_gate, cfg.text.partial_rotary_factor = True, 0.5
    cfg.text.norm_zero_centered = True
    cfg.text.mrope_section = (2, 1, 1)  # half of the rotary dims (16 x 0.5)
    return cfg.validate()


def _hf_text_config(**kw):
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
    rope.update(mrope_section=[4, 2, 2], mrope_interleaved=True)
    return Qwen3_5MoeTextConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_parameters=rope,
        **kw,
    )


def test_gated_attention_with_partial_rotary_equals_the_reference():
    pytest.importorskip("transformers.models.qwen3_5_moe")
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeAttention,
        Qwen3_5MoeTextRotaryEmbedding,
    )

    from moevlm.model.attention import doc_mask
    from moevlm.model.decoder import TextAttention
    from moevlm.model.rope import mrope

    hf_cfg = _hf_text_config()
    hf_cfg._attn_implementation = "sdpa"
    ref = Qwen3_5MoeAttention(hf_cfg, 0)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    cfg = VLMConfig.preset("tiny")
    t = cfg.text
    t.hidden_size, t.num_heads, t.num_kv_heads, t.head_dim = 64, 4, 2, 32
    t.attn_output_gate, t.partial_rotary_factor, t.mrope_section = True, 0.5, (4, 2, 2)
    t.norm_zero_centered = True
    t.rope_theta = 10000.0
    cfg.validate()
    ours = TextAttention(cfg)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(ours, name).weight.copy_(getattr(ref, name).weight)
        for name in ("q_norm", "k_norm"):  # zero-centred as the reference's: scale 1 + w
            getattr(ours, name).weight.copy_(getattr(ref, name).weight)
    B, S = 2, 13
    pos = torch.randint(0, 40, (3, B, S))
    x = torch.randn(B, S, 64)
    cos, sin = Qwen3_5MoeTextRotaryEmbedding(hf_cfg)(x, pos)
    ours_cos, ours_sin = mrope(pos, t.rotary_dim, t.rope_theta, t.mrope_section, True)
    assert ours_cos.shape == (B, S, 16)
    assert _rel(ours_cos, cos) <= 1e-6 and _rel(ours_sin, sin) <= 1e-6
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = ref(xr, (cos, sin), None)[0]
    got = ours(xo, (ours_cos, ours_sin), doc_mask(B, S, None, causal=True, backend="sdpa"))
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    assert _rel(got, want) <= 1e-5 and _rel(xo.grad, xr.grad) <= 1e-5
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
        assert _rel(getattr(ours, name).weight.grad, getattr(ref, name).weight.grad) <= 1e-5, name


def test_parameters_and_flops_count_them():
    from moevlm.model.flops import layer_forward_parts
    from moevlm.model.params import parameter_counts

    cfg = _tiny_with_shared()
    with torch.device("meta"):
        model = Qwen3VLMoe(cfg)
    assert sum(parameter_counts(cfg).values()) == sum(p.numel() for p in model.parameters())
    plain = layer_forward_parts(VLMConfig.preset("tiny"), 0, [100])
    ours = layer_forward_parts(cfg, 0, [100])
    hd, q = cfg.text.hidden_size, cfg.text.num_heads * cfg.text.head_dim
    # SwiGLU: 3 matmuls of 2 T D Fs each; the gate: 2 T D
    assert ours["moe"] - plain["moe"] == 6 * 100 * hd * FS + 2 * 100 * hd
    assert ours["attn_proj"] - plain["attn_proj"] == 2 * 100 * hd * q  # q_proj's gate rows


def _ranks(rank: int) -> None:
    import os

    from moevlm.dispatch import DispatcherSpec
    from moevlm.parallel import (
        ParallelDims,
        build_model,
        full_grads,
        init_parameters_,
        materialize_,
    )
    from moevlm.parallel.build import BuildOptions

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    cfg = _tiny_with_shared()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (1, 48), generator=g)
    batch = dict(input_ids=ids, labels=ids.clone())
    ref = Qwen3VLMoe(cfg)
    init_parameters_(ref, 7)
    ref_out = ref(**batch)
    ref_out.loss.backward()
    # text only: the vision tower has no gradient
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert sum("shared_expert" in n for n in ref_grads) == 4 * cfg.text.num_layers
    for dims, spec in (
        (ParallelDims(2, tp=2), DispatcherSpec("local")),
        (ParallelDims(2, tp=2, ep=2), DispatcherSpec("alltoall")),
    ):
        model, ctx = build_model(cfg, dims, BuildOptions(dp_mode="fsdp", dispatcher=spec))
        materialize_(model, "cpu", ctx)
        init_parameters_(model, 7, ctx)
        out = model(**batch)
        out.loss.backward()
        ctx.finish_gradients()
        assert _rel(out.loss.detach(), ref_out.loss.detach()) <= 1e-6, dims
        grads = full_grads(model)
        assert ref_grads.keys() <= grads.keys()
        for n, want in ref_grads.items():
            assert _rel(grads[n], want) <= 1e-5, (dims, n, _rel(grads[n], want))


@pytest.mark.slow
def test_tp2_and_tp2_ep2_match_one_process(tmp_path):
    run_ranks(_ranks, 2, tmp_path, timeout_s=300)


def test_vision_tower_without_deepstack_equals_the_reference():
    pytest.importorskip("transformers.models.qwen3_5_moe")
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    from hf_ref import as_ours

    from moevlm.model.config import VisionConfig
    from moevlm.model.vision import VisionEncoder

    dims = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4)
    dims.update(out_hidden_size=24, num_position_embeddings=16)
    hf_cfg = Qwen3_5MoeVisionConfig(**dims)
    hf_cfg._attn_implementation = "sdpa"
    ref = Qwen3_5MoeVisionModel(hf_cfg)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = VisionEncoder(VisionConfig(**dims, deepstack_visual_indexes=()), attn_backend="sdpa")

    def mine(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        ours_name, t = as_ours("model.visual." + name, t)
        return ours_name.removeprefix("vision."), t

    ours.load_state_dict(dict(mine(n, t) for n, t in ref.state_dict().items()), strict=True)
    grid = torch.tensor([[1, 4, 6], [2, 2, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), ours.cfg.patch_dim)
    pr, po = pixels.clone().requires_grad_(), pixels.clone().requires_grad_()
    want = ref(pr, grid_thw=grid).pooler_output
    got, deepstack = ours(po, grid)
    assert deepstack == [] and got.shape == want.shape == (int(grid.prod(-1).sum()) // 4, 24)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    assert _rel(got, want) <= 1e-5 and _rel(po.grad, pr.grad) <= 1e-5
    grads = {n: p.grad for n, p in ours.named_parameters()}
    for name, p in ref.named_parameters():
        ours_name, want_g = mine(name, p.grad)
        assert _rel(grads[ours_name], want_g) <= 1e-5, name


def test_zero_centred_rmsnorm_equals_the_reference_and_starts_at_zero():
    pytest.importorskip("transformers.models.qwen3_5_moe")
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

    from moevlm.model.decoder import RMSNorm

    ref, ours = Qwen3_5MoeRMSNorm(24, eps=1e-6), RMSNorm(24, 1e-6, zero_centered=True)
    with torch.no_grad():
        ref.weight.normal_(std=0.3)
        ours.weight.copy_(ref.weight)
    x = torch.randn(3, 5, 24) * 4
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = ref(xr), ours(xo)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    assert _rel(got, want) <= 1e-6 and _rel(xo.grad, xr.grad) <= 1e-6
    assert _rel(ours.weight.grad, ref.weight.grad) <= 1e-6
    xb = x.bfloat16()
    assert torch.equal(ours.bfloat16()(xb), ref.bfloat16()(xb))  # the same ops: fp32, then the cast
    cfg = VLMConfig.preset("tiny")
    cfg.text.norm_zero_centered = True
    model = Qwen3VLMoe(cfg)
    model.init_weights()
    norms = [m for m in model.text.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.zero_centered and not m.weight.any() for m in norms)
