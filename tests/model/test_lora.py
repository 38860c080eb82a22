"""LoRA adapters in one process (moevlm.model.lora): zero-initialised adapters change nothing, merging
equals the unmerged model after training, only adapters train, and PEFT loads the export."""

from __future__ import annotations

import copy

import pytest
import torch

from moevlm.config.sections import OptimConfig
from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model.lora import merge_lora, save_peft_adapter
from moevlm.train.optim import build_optimizer

ALL = ("attn", "mlp", "experts")


def lora_cfg(preset: str, modules=ALL, rank: int = 8) -> VLMConfig:
    cfg = VLMConfig.preset(preset)
    cfg.attn_backend = "sdpa"
    cfg.moe.grouped_gemm = "loop" if "experts" not in modules else cfg.moe.grouped_gemm
    cfg.lora.rank, cfg.lora.modules = rank, tuple(modules)
    return cfg.validate()


def batch(cfg: VLMConfig, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.text.vocab_size, (2, 12), generator=g)
    return ids, ids.clone()


def pair(preset: str, modules=ALL):
    """(base model, the same base with fresh adapters)."""
    torch.manual_seed(0)
    base = Qwen3VLMoe(lora_cfg(preset, modules, rank=0)).eval()
    torch.manual_seed(1)
    lora = Qwen3VLMoe(lora_cfg(preset, modules)).eval()
    missing, unexpected = lora.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(".lora." in k for k in missing) and missing
    return base, lora


@pytest.mark.parametrize("preset", ["tiny", "qwen3_5_tiny"])
def test_zero_adapters_equal_the_base_bit_for_bit(preset):
    base, lora = pair(preset)
    ids, _ = batch(base.config)
    with torch.no_grad():
        assert torch.equal(base(ids).logits, lora(ids).logits)


def train_steps(model, steps: int = 3):
    opt = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.0))
    model.train()
    for step in range(steps):
        ids, labels = batch(model.config, seed=step)
        model(ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


@pytest.mark.parametrize("preset", ["tiny", "qwen3_5_tiny"])
def test_merged_equals_unmerged_after_training(preset):
    _, model = pair(preset)
    train_steps(model)
    model.eval()
    ids, _ = batch(model.config, seed=9)
    with torch.no_grad():
        before = model(ids).logits
        assert merge_lora(model) > 0
        after = model(ids).logits
    assert not any(".lora." in n for n, _ in model.named_parameters())
    err = ((after - before).norm() / before.norm()).item()
    print(f"{preset}: merged vs unmerged logits, relative error {err:.2e}")
    assert err <= 1e-5


def test_vision_adapters_zero_then_merged_with_images():
    from hf_ref import sample

    modules = ("attn", "vision")
    base, lora = pair("tiny", modules)
    ids, pixels, grid = sample(base.config, [(1, 4, 4)])
    with torch.no_grad():
        assert torch.equal(base(ids, pixels, grid).logits, lora(ids, pixels, grid).logits)
        for n, p in lora.named_parameters():
            if ".lora." in n:
                p.normal_(0.0, 0.05)
        assert any(".lora." in n for n, _ in lora.vision.named_parameters())
        before = lora(ids, pixels, grid).logits
        merge_lora(lora)
        after = lora(ids, pixels, grid).logits
    assert ((after - before).norm() / before.norm()).item() <= 1e-5


def test_only_adapters_train_and_hold_optimizer_state():
    _, model = pair("tiny")
    opt = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.0))
    ids, labels = batch(model.config)
    model(ids, labels=labels).loss.backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora." in n for n in trainable)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    print(f"trainable parameters: {n_train} of {n_all} ({100 * n_train / n_all:.1f}%)")
    for n, p in model.named_parameters():
        assert (p.grad is not None) == (n in trainable), n
    opt.step()
    stated = {id(p) for p in opt.state}
    assert stated == {id(p) for n, p in model.named_parameters() if n in trainable}
    lora_b = model.text.layers[0].mlp.experts.lora.gate_up_B
    assert lora_b.abs().sum() > 0  # expert adapters got gradients through the grouped GEMM


def test_router_trained_when_asked():
    cfg = lora_cfg("tiny")
    cfg.lora.router = "trained"
    model = Qwen3VLMoe(cfg)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(n.endswith("router.weight") for n in trainable)


@pytest.mark.parametrize(
    "bad",
    [
        {"rank": -1},
        {"modules": ("attn", "lm_head")},
        {"router": "x"},
        {"alpha": 0.0},
        {"dropout": 1.0},
        {"rank": 4},  # expert adapters through torch._grouped_mm: a multiple of 8
    ],
)
def test_config_errors(bad):
    cfg = VLMConfig.preset("tiny")
    cfg.moe.grouped_gemm = "torch"
    cfg.lora.rank, cfg.lora.modules = 8, ALL
    for k, v in bad.items():
        setattr(cfg.lora, k, v)
    with pytest.raises(ValueError, match="lora"):
        cfg.validate()


def _fp8_grad_errors(model, plan, ids, labels) -> dict[str, float]:
    """Relative error of each gradient of `model` with FP8 on its base GEMMs vs the same model without."""
    from moevlm.model.fp8_targets import apply_fp8

    exact = copy.deepcopy(model)
    apply_fp8(model, plan, ALL)
    for m in (model, exact):
        m.train()
        m(ids, labels=labels).loss.backward()
    errors = {}
    for (n, p), q in zip(model.named_parameters(), exact.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            errors[n] = ((p.grad - q.grad).norm() / q.grad.norm()).item()
    return errors


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_fp8_base_gemms_with_full_precision_adapters(recipe):
    """FP8 on the base's GEMMs (attention, MLP, experts), the adapters beside them in full precision:
    zero adapters change nothing of the FP8 model; the frozen base gets no gradient (no weight-gradient
    GEMM runs for it); the adapters' gradients are as near their no-FP8 values as full fine-tuning's
    weight gradients are to theirs on the same model (the tiny model's FP8 error: a median of ~0.12
    relative, most of it in the backward's quantized output gradients)."""
    from moevlm.model.config import Fp8Config
    from moevlm.model.fp8 import resolve_fp8
    from moevlm.model.fp8_targets import apply_fp8

    base, lora = pair("tiny")
    plan = resolve_fp8(Fp8Config(recipe=recipe, backend="emulate"), "cpu")
    ids, labels = batch(base.config)
    with torch.no_grad():
        fp8_base, fp8_lora = copy.deepcopy(base), copy.deepcopy(lora)
        assert apply_fp8(fp8_base, plan, ALL) == apply_fp8(fp8_lora, plan, ALL) > 0
        assert torch.equal(fp8_base(ids).logits, fp8_lora(ids).logits)
        for n, p in lora.named_parameters():
            if n.endswith("B"):  # B at zero gives A no gradient: draw it
                p.normal_(0.0, 0.02)
    full = _fp8_grad_errors(base, plan, ids, labels)
    adapters = _fp8_grad_errors(lora, plan, ids, labels)
    assert adapters and all(".lora." in n for n in adapters)
    med = {k: sorted(e.values())[len(e) // 2] for k, e in (("full", full), ("lora", adapters))}
    top = {k: max(e.values()) for k, e in (("full", full), ("lora", adapters))}
    print(
        f"{recipe}: gradient error vs no FP8, median / max: full fine-tuning {med['full']:.3f} / "
        f"{top['full']:.3f}, adapters {med['lora']:.3f} / {top['lora']:.3f}"
    )
    assert med["lora"] <= 1.5 * med["full"] and top["lora"] <= 2 * top["full"], (med, top)


def test_off_by_default_changes_nothing():
    cfg = VLMConfig.preset("tiny")
    assert cfg.lora.rank == 0
    model = Qwen3VLMoe(cfg)
    assert all(p.requires_grad for p in model.parameters())
    assert not any("lora" in n for n in model.state_dict())


def test_from_pretrained_initialises_the_adapters(tmp_path):
    base, _ = pair("tiny")
    base.save_pretrained(tmp_path / "hf")
    loaded = Qwen3VLMoe.from_pretrained(
        tmp_path / "hf", attn_backend="sdpa", lora=lora_cfg("tiny").lora
    )
    A = loaded.text.layers[0].self_attn.q_proj.lora.A  # not read from the checkpoint: drawn, B zero
    assert 0 < A.abs().max() <= 1 / A.shape[1] ** 0.5
    ids, _ = batch(base.config)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, base(ids).logits)


@pytest.mark.parametrize("preset", ["tiny", "qwen3_5_tiny"])
def test_peft_loads_the_export_with_the_same_logits(tmp_path, preset):
    """Adapters on attn, mlp, experts and vision; PEFT wraps transformers' fused expert weights in
    ParamWrapper (target_parameters).  Qwen3.5: the Gated DeltaNet's in_proj_qkv adapter B leaves in
    the reference's [q | k | v] row order, the shared expert's adapters under `mlp`."""
    from hf_ref import hf_forward, sample

    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    _, model = pair(preset, ALL + ("vision",))
    with torch.no_grad():  # adapters away from zero, as after training
        for n, p in model.named_parameters():
            if ".lora." in n:
                p.normal_(0.0, 0.05)
    model.save_pretrained(tmp_path / "hf")
    save_peft_adapter(model, tmp_path / "adapter")
    hf_class = {
        "tiny": transformers.Qwen3VLMoeForConditionalGeneration,
        "qwen3_5_tiny": transformers.Qwen3_5MoeForConditionalGeneration,
    }[preset]
    ref = hf_class.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    ref.set_experts_implementation("eager")
    ref = peft.PeftModel.from_pretrained(ref, tmp_path / "adapter").eval()
    ids, pixels, grid = sample(model.config, [(1, 4, 4)])
    with torch.no_grad():
        ours = model(ids, pixels, grid).logits
        theirs = hf_forward(ref, ids, pixels, grid).logits
        with ref.disable_adapter():
            base = hf_forward(ref, ids, pixels, grid).logits
    wrapped = [n for n, _ in ref.named_modules() if n.endswith("mlp.experts")]
    assert wrapped and all(type(ref.get_submodule(n)).__name__ == "ParamWrapper" for n in wrapped)
    assert any("visual" in n and "lora_A" in n for n, _ in ref.named_parameters())
    assert ((ours - base).norm() / ours.norm()).item() > 1e-2  # the adapters matter
    err = ((ours - theirs).norm() / ours.norm()).item()
    print(f"peft vs moevlm logits with adapters, relative error {err:.2e}")
    assert err <= 1e-5
