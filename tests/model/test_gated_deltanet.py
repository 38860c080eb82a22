"""Gated DeltaNet: equal to transformers' Qwen3.5-MoE module (forward and every gradient; in_proj_qkv
and the conv permuted to ours, by key head), packed documents equal to each document alone (and not
without either reset), the chunked delta rule (documents side by side, or chunk by chunk as on CUDA)
equal to a per-token recurrence, the layer split over ranks' key heads summing to the whole."""

from __future__ import annotations

import pytest
import torch

import moevlm.model.gated_deltanet as gdn
from moevlm.model.gated_deltanet import GatedDeltaNet, chunk_gated_delta_rule, qkv_order

# hidden, key heads, value heads, key head dim, value head dim, conv kernel, our chunk
CONFIGS = [(32, 2, 4, 8, 12, 4, 16), (24, 3, 3, 16, 8, 3, 64), (16, 1, 2, 4, 4, 2, 8)]
BY_KEY_HEAD = ("in_proj_qkv.weight", "conv1d.weight")  # ours: rows grouped by key head


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def pair(hidden, hk, hv, kd, vd, kernel, chunk, seed=0):
    """(transformers' module with every parameter random, ours loaded from its state dict)."""
    transformers = pytest.importorskip("transformers")
    hf_gdn = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    cfg = transformers.Qwen3_5MoeTextConfig(
        hidden_size=hidden,
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=kd,
        linear_value_head_dim=vd,
        linear_conv_kernel_dim=kernel,
    )
    torch.manual_seed(seed)
    ref = hf_gdn.Qwen3_5MoeGatedDeltaNet(cfg, 0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn_like(p)
                if name == "norm.weight"
                else 0.3 * torch.randn_like(p)
            )
    ours = GatedDeltaNet(hidden, hk, hv, kd, vd, kernel, cfg.rms_norm_eps, chunk, backend="torch")
    ours.load_state_dict({n: as_ours(n, t, hk, hv, kd, vd) for n, t in ref.state_dict().items()})
    return ref, ours


def as_ours(name: str, t: torch.Tensor, hk: int, hv: int, kd: int, vd: int) -> torch.Tensor:
    """A reference parameter (or gradient) in our layout."""
    return t[qkv_order(hk, hv, kd, vd)] if name in BY_KEY_HEAD else t


def forward_backward(module, x, dy, **kw):
    x = x.clone().requires_grad_()
    y = module(x, **kw)
    y.backward(dy)
    grads = {n: p.grad for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_equals_transformers_forward_and_gradients(config):
    ref, ours = pair(*config)
    assert {n: p.shape for n, p in ours.state_dict().items()} == {
        n: p.shape for n, p in ref.state_dict().items()
    }
    x, dy = torch.randn(2, 45, config[0]), torch.randn(2, 45, config[0])
    y_ref, dx_ref, g_ref = forward_backward(ref, x, dy)
    y, dx, g = forward_backward(ours, x, dy)
    assert rel(y, y_ref) <= 1e-5
    assert rel(dx, dx_ref) <= 1e-5
    assert g.keys() == g_ref.keys()
    # A_log's and dt_bias's gradients are sums with heavy cancellation: transformers' own fp32 error
    # against fp64 on them is ~7e-6 (measured), so 1e-5 between two fp32 paths would fail by rounding
    # order on another CPU; 5e-5 still catches a wrong term (O(1) errors)
    for name in g_ref:
        assert rel(g[name], as_ours(name, g_ref[name], *config[1:5])) <= 5e-5, name


def test_qkv_rows_by_key_head_by_hand():
    """2 key heads of dim 1, 4 value heads of dim 1: the reference's [q0 q1 | k0 k1 | v0 v1 v2 v3]
    is ours [q0 k0 v0 v1 | q1 k1 v2 v3]; 3 key heads of dim 2, 3 value heads of dim 1."""
    assert qkv_order(2, 4, 1, 1).tolist() == [0, 2, 4, 5, 1, 3, 6, 7]
    assert qkv_order(3, 3, 2, 1).tolist() == [0, 1, 6, 7, 12, 2, 3, 8, 9, 13, 4, 5, 10, 11, 14]


# a tensor-parallel shard's dim per parameter (moevlm.parallel.tensor_parallel); the norm's stays whole
TP_DIM = {"out_proj.weight": 1, "norm.weight": None}


@pytest.mark.parametrize("tp,cp", [(1, 2), (1, 3), (2, 1), (2, 2)])
def test_ranks_key_heads_sum_to_the_whole_layer(tp, cp):
    """Each of tp x cp ranks (`share` (r cp + c, tp cp)) computes its part of the key heads with their
    value heads, from tp rank r's shard of the weights (or the whole ones without tp), cp rank c's
    slice of it; the outputs summed are the whole's, and so are the weight gradients (summed over cp,
    each tp rank's those of its shard)."""
    config = CONFIGS[1] if cp == 3 else CONFIGS[0] if tp * cp < 4 else (32, 4, 8, 8, 6, 4, 16)
    _, whole = pair(*config)
    x, cu = packed_row([19, 2, 30], config[0])
    dy = torch.randn_like(x)
    y, dx, g = forward_backward(whole, x, dy, cu_seqlens=cu)
    ys, dxs, grads = [], [], {name: 0 for name in g}
    for r in range(tp):
        for c in range(cp):
            mine = GatedDeltaNet(
                *config[:6], whole.norm.eps, config[6], backend="torch", share=(r * cp + c, tp * cp)
            )
            shard = {n: _tp_shard(n, t, r, tp) for n, t in whole.state_dict().items()}
            for name, t in shard.items():  # as tensor parallel places them: local shapes
                module, _, leaf = name.rpartition(".")
                setattr(mine.get_submodule(module), leaf, torch.nn.Parameter(t.clone()))
            y_i, dx_i, g_i = forward_backward(mine, x, dy, cu_seqlens=cu)
            ys.append(y_i)
            dxs.append(dx_i)
            for name, t in g_i.items():  # each tp rank's shard in place
                grads[name] = grads[name] + _tp_unshard(name, t, r, tp, g[name])
    assert rel(sum(ys), y) <= 1e-5
    assert rel(sum(dxs), dx) <= 1e-5
    for name in g:
        assert rel(grads[name], g[name]) <= 1e-5, name


def _tp_shard(name: str, t: torch.Tensor, r: int, tp: int) -> torch.Tensor:
    dim = TP_DIM.get(name, 0)
    return t if dim is None else t.chunk(tp, dim)[r]


def _tp_unshard(name: str, t: torch.Tensor, r: int, tp: int, like: torch.Tensor) -> torch.Tensor:
    """`t` (tp rank r's shard gradient) at its place in a zero tensor of the whole one's shape."""
    dim = TP_DIM.get(name, 0)
    if dim is None:
        return t
    out = torch.zeros_like(like)
    out.narrow(dim, r * like.shape[dim] // tp, like.shape[dim] // tp).copy_(t)
    return out


def packed_row(lengths, hidden, seed=1):
    torch.manual_seed(seed)
    x = torch.randn(1, sum(lengths), hidden)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return x, cu


def test_packed_documents_equal_each_document_alone():
    """Three documents in one row (one shorter than the conv window, one spanning chunks): output
    and input gradient equal the reference module run on each document alone."""
    ref, ours = pair(*CONFIGS[0])
    x, cu = packed_row([19, 2, 30], CONFIGS[0][0])
    dy = torch.randn_like(x)
    y, dx, _ = forward_backward(ours, x, dy, cu_seqlens=cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        y_doc, dx_doc, _ = forward_backward(ref, x[:, a:b], dy[:, a:b])
        assert rel(y[:, a:b], y_doc) <= 1e-5
        assert rel(dx[:, a:b], dx_doc) <= 1e-5


def test_documents_over_rows_and_empty_documents():
    """`cu_seqlens` over the flattened B*S tokens, row ends not listed, one document empty."""
    _, ours = pair(*CONFIGS[2])
    torch.manual_seed(2)
    x = torch.randn(2, 24, CONFIGS[2][0])
    cu = torch.tensor([0, 5, 5, 30, 48], dtype=torch.int32)  # row 1 starts at 24
    y = ours(x, cu_seqlens=cu).detach().reshape(48, -1)
    flat = x.reshape(48, -1)
    for a, b in [(0, 5), (5, 24), (24, 30), (30, 48)]:
        assert rel(y[a:b], ours(flat[None, a:b])[0].detach()) <= 1e-5


@pytest.mark.parametrize("without", ["conv window", "recurrent state"])
def test_packed_differs_without_either_reset(monkeypatch, without):
    """Each reset matters: with one of them taken out, the packed row reads the previous document."""
    _, ours = pair(*CONFIGS[0])
    x, cu = packed_row([19, 2, 30], CONFIGS[0][0])
    alone = torch.cat([ours(x[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    assert rel(ours(x, cu_seqlens=cu), alone) <= 1e-5
    if without == "conv window":
        monkeypatch.setattr(
            gdn, "position_in_document", lambda bounds, B, S: torch.arange(S).expand(B, S)
        )
    else:
        run = gdn.delta_rule_over_chunks
        monkeypatch.setattr(
            gdn,
            "delta_rule_over_chunks",
            lambda *a, waves: run(*a[:-1], torch.arange(a[-1].numel()) == 0),  # chunk by chunk
        )
    y = ours(x, cu_seqlens=cu)
    assert rel(y[:, :19], alone[:, :19]) <= 1e-5  # the first document has nothing before it
    assert rel(y[:, 19:], alone[:, 19:]) > 1e-3


def per_token_recurrence(q, k, v, g, beta, bounds, scale):
    """The delta rule token by token in fp64, the state zeroed at every document start."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    H = v.shape[1]
    q, k = q.repeat_interleave(H // q.shape[1], 1), k.repeat_interleave(H // k.shape[1], 1)
    state = torch.zeros(H, k.shape[-1], v.shape[-1], dtype=torch.float64)
    out = torch.empty_like(v)
    for t in range(v.shape[0]):
        if t in bounds:
            state.zero_()
        state = state * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", state, scale * q[t])
    return out


def _chunk_by_chunk(monkeypatch):
    """The recurrence through every chunk in turn (the CUDA path's loop) on the CPU too."""
    monkeypatch.setattr(gdn, "waves", lambda *a: None)


@pytest.mark.parametrize("loop", ["waves", "chunk by chunk"])
@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
@pytest.mark.parametrize("bounds", [[0, 37], [0, 9, 9, 26, 37]], ids=["one doc", "docs"])
def test_chunked_equals_per_token_recurrence(chunk, bounds, loop, monkeypatch):
    if loop == "chunk by chunk":
        _chunk_by_chunk(monkeypatch)
    torch.manual_seed(3)
    T, Hk, H, Kd, Vd = 37, 2, 4, 8, 6
    q, k = torch.randn(T, Hk, Kd), torch.nn.functional.normalize(torch.randn(T, Hk, Kd), dim=-1)
    v, beta = torch.randn(T, H, Vd), torch.rand(T, H)
    g = -torch.rand(T, H)
    expected = per_token_recurrence(q, k, v, g, beta, bounds, 0.5)
    got = chunk_gated_delta_rule(q, k, v, g, beta, torch.tensor(bounds), chunk, scale=0.5)
    assert got.dtype == torch.float32
    assert rel(got.double(), expected) <= 1e-5


def test_both_loops_give_the_same_gradients(monkeypatch):
    """Documents side by side (waves) and chunk by chunk: the same input gradients."""
    torch.manual_seed(4)
    T, Hk, H, Kd, Vd = 53, 1, 2, 8, 4
    leaves = [torch.randn(T, Hk, Kd), torch.randn(T, Hk, Kd), torch.randn(T, H, Vd)]
    leaves += [-torch.rand(T, H), torch.rand(T, H)]
    bounds, dy = torch.tensor([0, 3, 20, 20, 53]), torch.randn(T, H, Vd)
    grads = []
    for patch in (False, True):
        if patch:
            _chunk_by_chunk(monkeypatch)
        xs = [x.clone().requires_grad_() for x in leaves]
        (chunk_gated_delta_rule(*xs, bounds, 8, qk_l2norm=True) * dy).sum().backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        assert rel(a, b) <= 1e-5


def test_bf16_inputs_accumulate_in_fp32():
    """bf16 in, bf16 out, computed in fp32: equal to the fp32 run on the same bf16 values, rounded."""
    torch.manual_seed(4)
    q, k = torch.randn(40, 2, 8).bfloat16(), torch.randn(40, 2, 8).bfloat16()
    v, g, beta = torch.randn(40, 2, 8).bfloat16(), -torch.rand(40, 2), torch.rand(40, 2).bfloat16()
    got = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, qk_l2norm=True)
    want = chunk_gated_delta_rule(
        q.float(), k.float(), v.float(), g, beta.float(), chunk_size=16, qk_l2norm=True
    )
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.bfloat16())


def test_autocast_leaves_the_delta_rule_in_fp32():
    torch.manual_seed(5)
    q, k, v = torch.randn(40, 2, 8), torch.randn(40, 2, 8), torch.randn(40, 2, 8)
    g, beta = -torch.rand(40, 2), torch.rand(40, 2)
    want = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, qk_l2norm=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, qk_l2norm=True)
    assert torch.equal(got, want)


def test_backend_errors_say_what_to_change():
    with pytest.raises(ValueError, match="choose one of"):
        GatedDeltaNet(16, 1, 2, 4, 4, backend="triton")
    with pytest.raises(ValueError, match="multiple of"):
        GatedDeltaNet(16, 2, 3, 4, 4)
    x = torch.randn(1, 5, 16)
    with pytest.raises(RuntimeError, match="backend='torch'"):
        GatedDeltaNet(16, 1, 2, 4, 4, backend="fla")(x)
    assert GatedDeltaNet(16, 1, 2, 4, 4, backend="auto")(x).shape == x.shape  # CPU: the torch path


def test_modelled_fla_keeps_what_fla_keeps_and_refuses_real_tensors():
    """The plan's model of fla's kernel (moevlm.model.gdn_modelled): real tensors are refused; on fake
    ones the layer's output and every gradient have the torch path's shapes and dtypes, and the kernel
    keeps for the backward what fla's ChunkGatedDeltaRuleFunction saves: l2-normed q and k by value
    head, their fp32 norms, v, the fp32 cumsum of g, beta and A (T, H, 64)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(RuntimeError, match="fake tensors"):
        GatedDeltaNet(16, 1, 2, 4, 4, backend="modelled")(torch.randn(1, 5, 16))
    T, (hk, H, kd, vd) = 200, (2, 4, 8, 12)
    shapes = {}
    with FakeTensorMode():
        q, k = (torch.randn(T, hk, kd, dtype=torch.bfloat16, requires_grad=True) for _ in "qk")
        v = torch.randn(T, H, vd, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(T, H, requires_grad=True)
        beta = torch.rand(T, H, dtype=torch.bfloat16, requires_grad=True)
        bounds = torch.tensor([0, 70, T])
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            o = gdn.gated_delta_rule(q, k, v, g, beta, bounds, backend="modelled")
        o.sum().backward()
        for name, t in dict(o=o, q=q.grad, k=k.grad, v=v.grad, g=g.grad, beta=beta.grad).items():
            shapes[name] = (tuple(t.shape), t.dtype)
    kept = sorted((tuple(t.shape), str(t.dtype)) for t in saved)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert shapes == dict(
        o=((T, H, vd), bf16), q=((T, hk, kd), bf16), k=((T, hk, kd), bf16),
        v=((T, H, vd), bf16), g=((T, H), fp32), beta=((T, H), bf16),
    )  # fmt: skip
    fla_saves = [((T, H, kd), bf16)] * 2 + [((T * H,), fp32)] * 2
    fla_saves += [((T, H, vd), bf16), ((T, H), fp32), ((T, H), bf16), ((T, H, 64), bf16)]
    assert kept == sorted((s, str(d)) for s, d in fla_saves)
