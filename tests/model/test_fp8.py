"""FP8 training pieces (moevlm.model.fp8, fp8_targets) on the CPU, in fp32.

- The autograd rule against the recipe written out by hand: operands quantized with the torch
  reference quantizers (kernels/fp8_quant_ref.py), dequantized, multiplied in fp64.  Forward, input
  gradient and weight gradient; dense and grouped (uneven experts, one empty, boundaries off the
  128-row blocks); blockwise and MXFP8 through the emulation, blockwise through our Triton kernels
  (interpreter).  The emulation is the same arithmetic: 1e-6; Triton accumulates in fp32: 1e-5.
- Weights are quantized once per optimizer step with the cache on, at every call without it, and a
  step's new weights are never served stale codes.
- The router stays fp32, under bf16 autocast too, and no FP8 GEMM ever sees its weight.
- Which modules each `fp8_modules` entry marks; padded expert rows give the unpadded result.
- Refusals: auto on the CPU, MXFP8 through triton, torch without its probe, unknown modules, and the
  trainer's combinations (compile, CUDA graphs, padding with expert parallelism).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moevlm.kernels import fp8_quant_ref as Q

from moevlm.errors import ConfigError
from moevlm.model import fp8 as fp8_mod
from moevlm.model.config import Fp8Config, VLMConfig
from moevlm.model.fp8 import Fp8Unavailable, fp8_mm, install_weight_cache, resolve_fp8
from moevlm.model.fp8_targets import apply_fp8
from moevlm.model.moe import MoEBlock, Router
from moevlm.model.vlm import Qwen3VLMoe
from moevlm.parallel.weights import init_parameters_

COUNTS = [
    100,
    0,
    150,
    50,
]  # an empty expert; expert boundaries at 100 and 250, inside 128-row blocks
M, K, N = sum(COUNTS), 192, 160  # ragged: neither K nor N a multiple of 128


def _deq(codes, scales, tile):
    s = scales.float()
    for dim, b in enumerate(tile):
        s = s.repeat_interleave(b, dim)[
            tuple(slice(0, n) if d == dim else slice(None) for d, n in enumerate(codes.shape))
        ]
    return codes.double() * s.double()


def _by_hand(recipe, x, w_EKN, dy, counts):
    """(out, dx, dw) of the recipe from the reference quantizers: fp64 products of dequantized operands."""
    B = 128 if recipe == "blockwise" else 32
    if recipe == "blockwise":
        xq = _deq(*Q.quant_blockwise_act_torch(x), (1, B))
        dyq = _deq(*Q.quant_blockwise_act_torch(dy), (1, B))
        xtq = _deq(*Q.quant_blockwise_act_t_torch(x), (1, B))  # (K, M)
        dytq = _deq(*Q.quant_blockwise_act_t_torch(dy), (1, B))
        w_fwd = w_dgrad = torch.stack(
            [_deq(*Q.quant_blockwise_weight_torch(w), (B, B)) for w in w_EKN]
        )
    else:
        xq, dyq = _deq(*Q.quant_mxfp8_torch(x), (1, B)), _deq(*Q.quant_mxfp8_torch(dy), (1, B))
        xtq, dytq = (
            _deq(*Q.quant_mxfp8_torch(x.t()), (1, B)),
            _deq(*Q.quant_mxfp8_torch(dy.t()), (1, B)),
        )
        # 32x1 along K
        w_fwd = torch.stack([_deq(*Q.quant_mxfp8_torch(w, dim=0), (B, 1)) for w in w_EKN])
        # 1x32 along N
        w_dgrad = torch.stack([_deq(*Q.quant_mxfp8_torch(w), (1, B)) for w in w_EKN])
    rows = [slice(a, a + c) for a, c in zip([0, *torch.tensor(counts).cumsum(0).tolist()], counts)]
    out = torch.cat([xq[r] @ w_fwd[e] for e, r in enumerate(rows)])
    dx = torch.cat([dyq[r] @ w_dgrad[e].T for e, r in enumerate(rows)])
    dw = torch.stack([xtq[:, r] @ dytq[:, r].T for r in rows])
    return out, dx, dw


def _rel(a, b):
    return float((a.detach().double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(
    "recipe,backend",
    [
        ("blockwise", "emulate"),
        ("mxfp8", "emulate"),
        # Triton's interpreter: seconds a case
        pytest.param("blockwise", "triton", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "dense"])
def test_fp8_mm_is_the_recipe_by_hand(recipe, backend, grouped):
    g = torch.Generator().manual_seed(7)
    counts = COUNTS if grouped else [M]
    x = torch.randn(M, K, generator=g)
    x[:, 5] *= 50  # an outlier channel
    w = torch.randn(len(counts), K, N, generator=g) / K**0.5
    dy = torch.randn(M, N, generator=g)
    want = _by_hand(recipe, x, w, dy, counts)
    plan = resolve_fp8(Fp8Config(recipe=recipe, backend=backend), "cpu")
    xg, wg = x.clone().requires_grad_(), (w if grouped else w[0]).clone().requires_grad_()
    out = fp8_mm(xg, wg, torch.tensor(counts) if grouped else None, plan)
    out.backward(dy)
    got = (out, xg.grad, wg.grad if grouped else wg.grad[None])
    tol = 1e-6 if backend == "emulate" else 1e-5
    errors = {name: _rel(a, b) for name, a, b in zip(("out", "dx", "dw"), got, want)}
    assert all(e <= tol for e in errors.values()), errors
    assert not wg.grad[1].any() if grouped else True  # the empty expert: exact zeros
    # and it is a quantization of the fp32 GEMM, not something else: a few percent off
    exact = torch.cat([xe @ w[e] for e, xe in enumerate(x.split(counts))])
    assert 5e-3 < _rel(out, exact) < 0.08


def _tiny(fp8: Fp8Config | None = None, num_layers: int = 2) -> Qwen3VLMoe:
    cfg = VLMConfig.preset("tiny")
    cfg.text.num_layers = num_layers
    cfg.vision.deepstack_visual_indexes = ()
    model = Qwen3VLMoe(cfg)
    init_parameters_(model, 0)
    if fp8 is not None:
        apply_fp8(model, resolve_fp8(fp8, "cpu"), fp8.modules)
    return model


def _loss(model, seed=0):
    ids = torch.randint(0, 500, (2, 48), generator=torch.Generator().manual_seed(seed))
    return model(input_ids=ids, labels=ids).lm_loss


def test_weights_are_quantized_once_per_step_and_never_served_stale(monkeypatch):
    calls = []
    real = fp8_mod._quant_weight
    monkeypatch.setattr(
        fp8_mod,
        "_quant_weight",
        lambda w, plan, grouped: calls.append(w.shape) or real(w, plan, grouped),
    )
    monkeypatch.setattr(fp8_mod, "_hooked", False)  # no hook from another test
    cfg = Fp8Config(recipe="blockwise", backend="emulate")
    model = _tiny(cfg)
    # 2 layers of q, k, v, o and the experts' two weights (the tiny model's are MoE)
    weights = 2 * (4 + 2)
    _loss(model).backward()
    _loss(model, 1).backward()
    assert len(calls) == 2 * weights  # no optimizer hook: quantized at every use (two forwards)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    install_weight_cache(opt)
    calls.clear()
    for step in range(2):
        for mb in range(3):  # micro-batches, each forward and backward
            _loss(model, mb).backward()
        assert len(calls) == (step + 1) * weights, step  # once per weight per step
        opt.step()
        opt.zero_grad()
    # after the step the model computes with the new weights: equal to a fresh, uncached copy
    fresh = _tiny(None)
    fresh.load_state_dict(model.state_dict())
    apply_fp8(
        fresh,
        resolve_fp8(Fp8Config(recipe="blockwise", backend="emulate", cache_weights=False), "cpu"),
        cfg.modules,
    )
    assert torch.equal(_loss(model, 5).detach(), _loss(fresh, 5).detach())


def test_router_stays_fp32_under_bf16_autocast(monkeypatch):
    model = _tiny(Fp8Config(recipe="mxfp8", backend="emulate"))
    seen, fp8_weights = [], []
    real = fp8_mod._Fp8Mm.apply
    monkeypatch.setattr(
        fp8_mod._Fp8Mm, "apply", lambda x, w, *a: fp8_weights.append(w) or real(x, w, *a)
    )

    def check(router, inputs, outputs):
        # inputs: the rows, and the tokens' positions (None here: no forced routing)
        (x_TD, _), (_, topk_w, probs, _) = inputs, outputs
        with torch.autocast("cpu", enabled=False):
            want = F.linear(x_TD.float(), router.weight.float()).softmax(-1)
        # (the hook is inside)
        autocast_bf16 = F.linear(x_TD.float(), router.weight.float()).float().softmax(-1)
        seen.append(
            (probs.dtype, topk_w.dtype, torch.equal(probs, want), torch.equal(probs, autocast_bf16))
        )

    for m in model.modules():
        if isinstance(m, Router):
            m.register_forward_hook(check)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _loss(model)
    loss.backward()
    assert seen and all(s == (torch.float32, torch.float32, True, False) for s in seen), seen
    routers = {id(m.weight) for m in model.modules() if isinstance(m, Router)}
    assert fp8_weights and not any(id(w) in routers for w in fp8_weights)
    assert all(
        m.weight.grad is not None and m.weight.grad.dtype == torch.float32
        for m in model.modules()
        if isinstance(m, Router)
    )


def test_qwen35_attn_and_mlp_mark_gdn_projections_and_the_shared_expert_not_their_gates():
    """`attn` marks a GDN layer's in_proj_qkv, in_proj_z, out_proj (not its per-head gates a, b); `mlp`
    the shared expert (not its gate); the model then trains a step in FP8 near its fp32 loss."""
    cfg = VLMConfig.preset("qwen3_5_tiny")
    model = Qwen3VLMoe(cfg)
    init_parameters_(model, 0)
    base = _loss(model).item()
    plan = resolve_fp8(Fp8Config(recipe="blockwise", backend="emulate"), "cpu")
    gdn = sum(t == "linear_attention" for t in cfg.text.layer_types)
    full = cfg.text.num_layers - gdn
    assert apply_fp8(model, plan, ("attn",)) == 3 * gdn + 4 * full
    assert apply_fp8(model, plan, ("mlp",)) == 3 * cfg.text.num_layers  # the shared experts
    apply_fp8(model, plan, ("experts", "attn", "mlp"))
    marked = {name for name, m in model.named_modules() if m.__dict__.get("fp8") is not None}
    assert any(n.endswith("linear_attn.in_proj_qkv") for n in marked)
    assert not any(n.endswith(("in_proj_a", "in_proj_b", "shared_expert_gate")) for n in marked)
    loss = _loss(model)
    loss.backward()
    assert 0 < abs(loss.item() - base) / base < 0.05


def test_which_modules_each_entry_marks():
    cfg = VLMConfig.preset("tiny")
    model = Qwen3VLMoe(cfg)
    plan = resolve_fp8(Fp8Config(recipe="blockwise", backend="emulate"), "cpu")
    L, blocks = cfg.text.num_layers, cfg.vision.depth
    mergers = 1 + len(cfg.vision.deepstack_visual_indexes)
    expected = {("experts",): L, ("attn",): 4 * L, ("vision",): 4 * blocks + 2 * mergers}
    for modules, n in expected.items():
        assert apply_fp8(model, plan, modules) == n, modules
    marked = {name for name, m in model.named_modules() if m.__dict__.get("fp8") is not None}
    assert not any("patch_embed" in n or "lm_head" in n or "router" in n for n in marked)
    apply_fp8(model, None, ())
    assert not any(m.__dict__.get("fp8") for m in model.modules())
    with pytest.raises(ValueError, match="router"):
        apply_fp8(model, plan, ("router",))
    with pytest.raises(ConfigError, match=r"fp8.modules \(model.fp8_modules\) has \['router'\]"):
        VLMConfig.preset("tiny").replace(
            fp8=Fp8Config(recipe="blockwise", modules=("router",))
        ).validate()


def test_padded_expert_rows_give_the_unpadded_result():
    cfg = VLMConfig.preset("tiny")
    torch.manual_seed(0)
    block = MoEBlock(cfg.text.hidden_size, cfg.moe)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 37, cfg.text.hidden_size)
    want, _ = block(x)
    block.dispatcher.pad_multiple = 32
    seen = []
    block.experts.register_forward_hook(lambda m, args, out: seen.append(args[1].clone()))
    got, _ = block(x)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert (seen[0] % 32 == 0).all() and int(seen[0].sum()) > 2 * 37 * cfg.moe.top_k


def test_refusals_name_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(Fp8Unavailable, match="fp8_backend=emulate"):
        resolve_fp8(Fp8Config(recipe="blockwise"), "cpu")  # auto never slips into emulation
    with pytest.raises(Fp8Unavailable, match="blockwise recipe only"):
        resolve_fp8(Fp8Config(recipe="mxfp8", backend="triton"), "cpu")
    with pytest.raises(Fp8Unavailable, match="scaled_mm_mxfp8"):
        resolve_fp8(Fp8Config(recipe="mxfp8", backend="torch"), "cpu")
    with pytest.raises(Fp8Unavailable, match="scaled_mm_mxfp8"):
        resolve_fp8(Fp8Config(recipe="mxfp8"), "cpu")
    assert resolve_fp8(Fp8Config(), "cpu") is None
    plan = resolve_fp8(Fp8Config(recipe="mxfp8", backend="emulate"), "cpu")
    assert (plan.dense, plan.grouped, plan.quant, plan.block) == ("emulate", "emulate", "torch", 32)
    with pytest.raises(ConfigError, match="pow2_scales is a blockwise option"):
        VLMConfig.preset("tiny").replace(fp8=Fp8Config(recipe="mxfp8", pow2_scales=True)).validate()


def test_the_trainer_refuses_what_fp8_cannot_run_with(monkeypatch):
    from moevlm.config import compose_job, validate

    def problems(*overrides, world=1):
        with pytest.raises(ConfigError) as err:
            validate(compose_job(["model.fp8=blockwise", *overrides]), world_size=world)
        return str(err.value)

    assert "train.compile=true is not supported yet" in problems(
        "model.fp8_backend=emulate", "train.compile=true"
    )
    assert "fp8_pad_experts" in problems(
        "model.fp8_backend=emulate", "model.fp8_pad_experts=true", "parallel.ep=2", world=2
    )
    # the tiny model's 64-wide linears
    assert "not multiples of 128" in problems("model.fp8_backend=torch")
    assert "model.fp8_modules) has ['router']" in problems("model.fp8_modules=[router]")
    assert "model.fp8='int8'" in problems("model.fp8=int8")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "set model.fp8_backend=emulate" in problems()  # auto on the CPU
    validate(
        compose_job(
            ["model.fp8=mxfp8", "model.fp8_backend=emulate", "model.fp8_modules=[experts,vision]"]
        )
    )
