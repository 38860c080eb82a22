"""The router's balancing options against formulas written out here (one process, fp32, tiny shapes):
the sequence-wise loss, the z-loss, the global-batch frequencies and loss, the expert bias (choice
only, and its update), forced-balanced routing; the defaults unchanged; config errors; the bias kept
out of Hugging Face files."""

from __future__ import annotations

import pytest
import torch

from moevlm.config import compose_job, validate
from moevlm.errors import ConfigError
from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model.decoder import document_index
from moevlm.model.hf import export_state_dict
from moevlm.model.moe import (
    Router,
    global_balance_loss,
    load_balancing_loss,
    update_router_bias_,
)
from moevlm.parallel.balance import StepFrequencies

E, K = 8, 2


def tiny(**moe) -> Qwen3VLMoe:
    cfg = VLMConfig.preset("tiny")
    for k, v in moe.items():
        setattr(cfg.moe, k, v)
    torch.manual_seed(0)
    return Qwen3VLMoe(cfg)


def routed(model, ids, **kw):
    """The model's output and, per MoE layer, the router's (top-k experts, probabilities, logits)."""
    seen = []
    hooks = [
        r.register_forward_hook(lambda m, a, out: seen.append((out[0], out[2], out[3])))
        for r in model.modules()
        if isinstance(r, Router)
    ]
    out = model(ids, labels=ids, **kw)
    for h in hooks:
        h.remove()
    return out, seen


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 900, (2, 16), generator=g)
    # row 0: documents of 5 and 11 tokens; row 1: 9 tokens, then 7 of padding (masked)
    cu = torch.tensor([0, 5, 16, 25, 32], dtype=torch.int32)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 9:] = False
    return ids, cu, mask


def test_sequence_loss_is_the_mean_over_layers_and_documents():
    ids, cu, mask = batch()
    out, seen = routed(tiny(aux_loss="sequence"), ids, cu_seqlens=cu, token_mask=mask)
    docs = [range(5), range(5, 16), range(16, 25)]  # the padding segment has no real token
    per_layer = []
    for idx_TK, probs_TE, _ in seen:
        losses = []
        for d in docs:
            t = torch.tensor(list(d))
            n = len(t)
            counts = torch.zeros(E).index_add_(0, idx_TK[t].reshape(-1), torch.ones(n * K))
            losses.append(E * ((counts / n) * (probs_TE[t].sum(0) / n)).sum())
        per_layer.append(torch.stack(losses).mean())
    want = torch.stack(per_layer).mean()
    torch.testing.assert_close(out.aux_loss, want, rtol=1e-6, atol=0)


def test_document_index():
    doc, n = document_index(torch.tensor([0, 3, 3, 8], dtype=torch.int32), 2, 4, "cpu")
    assert n == 3 and doc.tolist() == [[0, 0, 0, 2], [2, 2, 2, 2]]
    doc, n = document_index(None, 2, 3, "cpu")
    assert n == 2 and doc.tolist() == [[0, 0, 0], [1, 1, 1]]


def test_z_loss_is_the_sum_over_layers_of_the_mean_squared_logsumexp():
    ids, cu, mask = batch()
    model = tiny(z_loss_coeff=0.1)
    out, seen = routed(model, ids, cu_seqlens=cu, token_mask=mask)
    keep = mask.reshape(-1)
    want = sum(logits.logsumexp(-1)[keep].square().mean() for _, _, logits in seen)
    torch.testing.assert_close(out.z_loss, want, rtol=1e-6, atol=0)
    base = out.lm_loss + 0.001 * out.aux_loss
    torch.testing.assert_close(out.loss, base + 0.1 * want, rtol=1e-6, atol=0)


def test_defaults_leave_the_loss_as_it_was():
    """micro_batch, no z-loss, no bias: the reference's loss, bit for bit, and no new state."""
    ids, cu, mask = batch()
    model = tiny()
    out, seen = routed(model, ids, cu_seqlens=cu, token_mask=mask)
    assert out.z_loss is None and out.router_totals is None
    assert not [k for k in model.state_dict() if "expert_bias" in k]
    keep = mask.reshape(-1)
    counts = sum(
        torch.zeros(E).index_add_(0, i[keep].reshape(-1), torch.ones(int(keep.sum()) * K))
        for i, _, _ in seen
    )
    probs = sum(p[keep].sum(0) for _, p, _ in seen)
    n = int(keep.sum()) * len(seen)
    torch.testing.assert_close(
        out.aux_loss, E * ((counts / n) * (probs / n)).sum(), rtol=1e-6, atol=0
    )


def test_global_batch_frequencies_and_loss():
    """Micro-batch g sees the selections of micro-batches 0..g; with one micro-batch the loss is the
    micro-batch loss bit for bit."""
    freqs = StepFrequencies(None)
    freqs.begin_step()
    g = torch.Generator().manual_seed(2)
    counts = [torch.randint(0, 20, (E,), generator=g).float() for _ in range(3)]
    tokens = [30, 40, 10]
    for m in range(3):
        got = freqs(counts[m], torch.tensor(tokens[m]))
        want = sum(counts[: m + 1]) / sum(tokens[: m + 1])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    prob_sum = torch.rand(E, generator=g)
    torch.testing.assert_close(
        global_balance_loss(prob_sum, 10, got, E), E * (want * prob_sum / 10).sum()
    )

    ids, cu, mask = batch()
    ref = tiny()(ids, labels=ids, cu_seqlens=cu, token_mask=mask)
    out = tiny(aux_loss="global_batch")(ids, labels=ids, cu_seqlens=cu, token_mask=mask)
    t = out.router_totals
    freqs.begin_step()
    aux = global_balance_loss(t.prob_sum_E, t.num_tokens, freqs(t.counts_E, t.num_tokens), E)
    assert torch.equal(aux, ref.aux_loss)
    assert torch.equal(
        ref.aux_loss, load_balancing_loss([t], E)
    )  # the pooled totals are the reference's statistics


def test_bias_chooses_but_does_not_weigh():
    torch.manual_seed(3)
    router = Router(16, E, K, bias=True)
    router.weight.data.normal_()
    x = torch.randn(10, 16)
    router.expert_bias.copy_(torch.tensor([0, 0, 0, 5.0, 0, 0, 5.0, 0]))
    idx, w, _, logits = router(x)
    assert set(idx.reshape(-1).tolist()) == {3, 6}
    p = logits.softmax(-1).gather(1, idx)
    torch.testing.assert_close(w, p / p.sum(-1, keepdim=True), rtol=0, atol=0)
    router.expert_bias.zero_()
    plain = Router(16, E, K)
    plain.weight.data.copy_(router.weight.data)
    for a, b in zip(router(x), plain(x)):
        assert torch.equal(a, b)


def test_bias_update():
    routers = [Router(4, 4, 1, bias=True) for _ in range(2)]
    routers[1].expert_bias.fill_(0.5)
    load = torch.tensor([[4.0, 0, 2, 2], [1, 1, 1, 5]])
    update_router_bias_(routers, load, 0.1)
    # mean 2 per layer: overloaded down, underloaded up, at the mean unchanged
    assert routers[0].expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0, 0])
    assert routers[1].expert_bias.tolist() == pytest.approx([0.6, 0.6, 0.6, 0.4])


def test_force_balance_routes_evenly_and_weighs_by_the_router():
    torch.manual_seed(4)
    router = Router(16, E, K, force_balance=True)
    router.weight.data.normal_()
    idx, w, probs, _ = router(torch.randn(12, 16))
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    assert counts.tolist() == [12 * K // E] * E
    assert idx[0].tolist() == [0, 1] and idx[5].tolist() == [2, 3]
    p = probs.gather(1, idx)
    torch.testing.assert_close(w, p / p.sum(-1, keepdim=True), rtol=0, atol=0)
    # tokens 6..11 of the sequence, routed where they are (a rank's shard): the same experts
    x = torch.randn(12, 16)
    whole, shard = router(x)[0], router(x[6:], torch.arange(6, 12))[0]
    assert torch.equal(shard, whole[6:]) and not torch.equal(router(x[6:])[0], whole[6:])


def test_bias_is_kept_out_of_hugging_face_files():
    model = tiny(router_bias_rate=0.01)
    assert any(k.endswith("router.expert_bias") for k in model.state_dict())
    assert not any("bias" in k and "mlp.gate" in k for k in export_state_dict(model))


@pytest.mark.parametrize(
    "override,words",
    [
        ("model.moe_aux_loss=per_token", "model.moe_aux_loss='per_token'; choose one of"),
        (
            "model.moe_router_bias_rate=-1",
            "model.moe_router_bias_rate=-1.0 must be a finite number",
        ),
        ("model.moe_z_loss_coeff=nan", "model.moe_z_loss_coeff=nan must be a finite number >= 0"),
    ],
)
def test_config_errors(override, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
        validate(compose_job([override]), 1)
