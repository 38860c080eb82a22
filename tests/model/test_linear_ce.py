"""The LM head's loss over token chunks (moevlm.model.linear_ce) equals the whole-logits path: the summed
loss and dh, dW of the function against F.cross_entropy over F.linear, then the whole model's loss and
every gradient (image, packed documents, ignored labels, tied head) with `loss_chunk_tokens` against 0,
each to 1e-6 relative in fp32; chunk sizes that do not divide the tokens, larger than them, of one.
The same comparison rides gloo launches under tp2 (tests/parallel/test_vocab_parallel.py,
test_layouts.py), pp2 and pp2 x tp2 (test_pipeline.py), cp2 and cp2 x tp2 (test_context_parallel.py)."""

import pytest
import torch
import torch.nn.functional as F
from hf_ref import sample

from moevlm.config import compose_job, validate
from moevlm.errors import ConfigError
from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model.linear_ce import IGNORE_INDEX, linear_cross_entropy

TOL = 1e-6


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def whole_logits(h, w, target):
    """Today's path: the logits, promoted to fp32, summed cross-entropy."""
    logits = F.linear(h, w)
    return F.cross_entropy(
        logits.to(torch.promote_types(logits.dtype, torch.float32)),
        target,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def loss_and_grads(fn, h, w, target, **kw):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, target, **kw)
    (loss * 0.37).backward()
    return loss.detach(), h.grad, w.grad


def inputs(T=37, D=16, V=50, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) * 0.3).to(dtype)
    target = torch.randint(0, V, (T,), generator=g)
    target[::5] = IGNORE_INDEX
    return h, w, target


@pytest.mark.parametrize("chunk", [1, 7, 16, 37, 100, 0])
def test_chunks_equal_whole_logits(chunk):
    h, w, target = inputs()
    ref = loss_and_grads(whole_logits, h, w, target)
    got = loss_and_grads(linear_cross_entropy, h, w, target, chunk=chunk)
    assert got[0].dtype == torch.float32 and got[0].ndim == 0
    for name, a, b in zip(("loss", "dh", "dW"), got, ref):
        assert rel(a, b) <= TOL, (name, rel(a, b))


def test_ignored_tokens_give_zero_loss_and_gradient():
    h, w, target = inputs(T=9)
    target[:] = IGNORE_INDEX
    loss, dh, dw = loss_and_grads(linear_cross_entropy, h, w, target, chunk=4)
    assert loss.item() == 0.0 and not dh.any() and not dw.any()
    target[3] = 7  # one counted token: only its row of dh
    loss, dh, dw = loss_and_grads(linear_cross_entropy, h, w, target, chunk=4)
    ref = loss_and_grads(whole_logits, h, w, target)
    assert rel(loss, ref[0]) <= TOL and rel(dh, ref[1]) <= TOL and rel(dw, ref[2]) <= TOL
    assert dh[3].any() and not dh[torch.arange(9) != 3].any()


def test_only_the_weight_or_only_the_input_needs_a_gradient():
    h, w, target = inputs()
    frozen_w = linear_cross_entropy(h.clone().requires_grad_(), w, target, 8)
    frozen_w.backward()
    h2 = h.clone().requires_grad_()
    whole_logits(h2, w, target).backward()
    w2 = w.clone().requires_grad_()
    linear_cross_entropy(h, w2, target, 8).backward()
    w3 = w.clone().requires_grad_()
    whole_logits(h, w3, target).backward()
    assert rel(w2.grad, w3.grad) <= TOL
    with torch.no_grad():  # forward only (validation)
        assert rel(linear_cross_entropy(h, w, target, 8), whole_logits(h, w, target)) <= TOL


def test_bf16_logits_are_the_whole_paths_promoted_to_fp32():
    """bf16 inputs: each chunk's logits are the bf16 GEMM's, promoted as the whole path promotes them,
    so the loss agrees to fp32 summation order; the gradients to bf16 rounding."""
    h, w, target = inputs(T=23, dtype=torch.bfloat16)
    ref = loss_and_grads(whole_logits, h, w, target)
    got = loss_and_grads(linear_cross_entropy, h, w, target, chunk=6)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    assert rel(got[0], ref[0]) <= TOL
    assert rel(got[1], ref[1]) <= 1e-2 and rel(got[2], ref[2]) <= 1e-2


def test_under_autocast_the_gemms_run_in_its_dtype():
    """fp32 inputs under bf16 autocast (the trainer's on CUDA): the chunks' logits are autocast's bf16
    GEMM's, as F.linear's would be, so the loss equals the whole path's under autocast to fp32
    summation order; the gradients come back in the inputs' dtype."""
    h, w, target = inputs(T=23)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = loss_and_grads(whole_logits, h, w, target)
        got = loss_and_grads(linear_cross_entropy, h, w, target, chunk=6)
    assert got[1].dtype == got[2].dtype == torch.float32
    assert rel(got[0], ref[0]) <= TOL
    assert rel(got[1], ref[1]) <= 1e-2 and rel(got[2], ref[2]) <= 1e-2
    fp32 = loss_and_grads(whole_logits, h, w, target)
    assert rel(got[0], fp32[0]) > 1e-5  # it did run in bf16


def _model_cfg(tied: bool) -> VLMConfig:
    cfg = VLMConfig.preset("tiny").replace(attn_backend="sdpa", tie_word_embeddings=tied)
    cfg.moe.mlp_only_layers = (1,)
    return cfg


def _run(model, chunk, ids, px, grid, labels, cu):
    model.config.loss_chunk_tokens = chunk
    model.zero_grad(set_to_none=True)
    out = model(ids, px, grid, cu_seqlens=cu, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_model_loss_and_every_gradient_equal_whole_logits(tied):
    """The whole model (an image, two packed documents in each of 2 rows, ignored labels): loss,
    lm_loss, token count and every parameter's gradient with 5-token chunks (not dividing 2 x 16)
    equal the whole-logits path; the logits are not made."""
    torch.manual_seed(0)
    model = Qwen3VLMoe(_model_cfg(tied))
    ids, px, grid = sample(model.config, [(1, 4, 4)], text_len=5, batch=2)
    S = ids.shape[1]
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX
    cu = torch.tensor([0, 12, S, S + 3, 2 * S], dtype=torch.int32)  # around the images
    ref, want = _run(model, 0, ids, px, grid, labels, cu)
    out, got = _run(model, 5, ids, px, grid, labels, cu)
    assert out.logits is None and ref.logits.shape == (*ids.shape, model.config.text.vocab_size)
    assert out.num_loss_tokens == ref.num_loss_tokens
    assert rel(out.lm_loss, ref.lm_loss) <= TOL and rel(out.loss, ref.loss) <= TOL
    assert got.keys() == want.keys() and ("lm_head.weight" in got) != tied
    bad = {k: rel(got[k], want[k]) for k in want if rel(got[k], want[k]) > TOL}
    assert not bad, bad
    # asked for, or without labels, the logits are there
    model.config.loss_chunk_tokens = 5
    with torch.no_grad():
        asked = model(ids, px, grid, cu_seqlens=cu, labels=labels, return_logits=True)
        plain = model(ids, px, grid, cu_seqlens=cu)
    assert torch.equal(asked.logits, ref.logits.detach()) and torch.equal(
        plain.logits, asked.logits
    )
    assert rel(asked.lm_loss, ref.lm_loss) <= TOL


def test_job_option_reaches_the_model_and_refuses_a_negative():
    plan = validate(compose_job(["data.shards=sample"]), world_size=1, environment=False)
    assert plan.model.loss_chunk_tokens == 1024
    plan = validate(
        compose_job(["data.shards=sample", "model.loss_chunk_tokens=0"]),
        world_size=1,
        environment=False,
    )
    assert plan.model.loss_chunk_tokens == 0
    with pytest.raises(ConfigError, match=r"model\.loss_chunk_tokens=-1 must be an integer >= 0"):
        validate(
            compose_job(["data.shards=sample", "model.loss_chunk_tokens=-1"]),
            world_size=1,
            environment=False,
        )
