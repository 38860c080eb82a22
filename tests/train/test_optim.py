"""Parameter groups and learning-rate schedules (pure functions, no processes)."""

import math

import pytest
import torch

from moevlm.config import OptimConfig
from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.train.optim import LRSchedule, build_optimizer, build_scheduler, param_groups


def opt_cfg(**kw) -> OptimConfig:
    return OptimConfig(**kw)


def test_no_decay_on_norms_biases_and_embeddings():
    model = Qwen3VLMoe(VLMConfig.preset("tiny"))
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = param_groups(model, opt_cfg())
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    exempt = {names[id(p)] for p in no_decay["params"]}
    assert "text.embed_tokens.weight" in exempt and "vision.pos_embed.weight" in exempt
    assert "text.norm.weight" in exempt and "vision.patch_embed.bias" in exempt
    decayed = {names[id(p)] for p in decay["params"]}
    assert "lm_head.weight" in decayed and "text.layers.0.mlp.experts.gate_up_proj" in decayed
    assert "text.layers.0.mlp.router.weight" in decayed
    (everything,) = param_groups(model, opt_cfg(decay_norms_biases_embeddings=True))
    assert len(everything["params"]) == len(list(model.parameters()))
    model.vision.requires_grad_(False)
    assert not any(
        names[id(p)].startswith("vision.")
        for g in param_groups(model, opt_cfg())
        for p in g["params"]
    )


@pytest.mark.parametrize("impl", ["auto", "fused", "foreach", "for_loop"])
def test_every_adamw_implementation_makes_the_same_update(impl):
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 4)
    model = torch.nn.Linear(8, 4)
    model.load_state_dict(ref.state_dict())
    outs = []
    for m, kind in ((ref, "for_loop"), (model, impl)):
        opt = build_optimizer(m, opt_cfg(implementation=kind, lr=1e-2))
        m(torch.ones(2, 8)).sum().backward()
        opt.step()
        outs.append(m.weight.detach())
    torch.testing.assert_close(outs[0], outs[1])


def lrs(steps, **kw):
    f = LRSchedule(opt_cfg(**kw), steps)
    return [f(s) for s in range(steps)]


def test_cosine_with_warmup():
    x = lrs(10, schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    assert x[:2] == [0.5, 1.0]
    assert x[2] == 1.0 and x[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(x[2:], x[3:]))
    assert x[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 7)))


@pytest.mark.parametrize("shape", ["linear", "cosine", "sqrt"])
def test_wsd_holds_then_decays(shape):
    x = lrs(
        20, schedule="wsd", warmup_steps=2, decay_fraction=0.25, decay_shape=shape, min_lr_ratio=0.0
    )
    assert x[:2] == [0.5, 1.0] and x[2:15] == [1.0] * 13
    assert 0 < x[15] < 1 and x[-1] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(x[15:], x[16:]))


def test_constant_and_scheduler_state_round_trip():
    assert lrs(5, schedule="constant", warmup_steps=1) == [1.0] * 5
    model = torch.nn.Linear(2, 2)
    o = opt_cfg(lr=1.0, schedule="cosine", warmup_steps=0)
    opt = build_optimizer(model, o)
    sched = build_scheduler(opt, o, 10)
    for _ in range(3):
        opt.step()
        sched.step()
    fresh = build_scheduler(build_optimizer(model, o), o, 10)
    fresh.load_state_dict(sched.state_dict())
    assert fresh.get_last_lr() == sched.get_last_lr() and fresh.last_epoch == 3
