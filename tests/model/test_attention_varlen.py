"""The `varlen` backend (torch.nn.attention.varlen.varlen_attn): `auto`'s resolution order with
availability monkeypatched, the static (compile-safe) boundaries, the call plumbing against a stand-in
kernel on the CPU (both torch signatures), the refusal on the CPU, and on a GPU the real kernel vs SDPA."""

import pytest
import torch
import torch.nn.functional as F

import moevlm.model.attention as A
from moevlm.config import compose_job, validate
from moevlm.errors import ConfigError
from moevlm.model.attention import attention, doc_mask, resolve_backend, static_bounds
from moevlm.model.autocast import compute_dtype

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(
    "flash,varlen,flex,expect",
    [
        (True, True, True, "flash"),
        (False, True, True, "varlen"),
        (False, False, True, "flex"),
        (False, False, False, "sdpa"),
    ],
)
def test_auto_order_on_cuda_half(monkeypatch, flash, varlen, flex, expect):
    monkeypatch.setattr(A, "_flash_varlen", lambda: object() if flash else None)
    monkeypatch.setattr(A, "varlen_available", lambda: varlen)
    monkeypatch.setattr(A, "flex_available", lambda: flex)
    assert resolve_backend("auto", CUDA, torch.bfloat16) == expect
    # the fused kernels need half precision
    assert resolve_backend("auto", CUDA, torch.float32) == "sdpa"
    # flex has no CPU backward; exact FLOPs
    assert resolve_backend("auto", CPU, torch.bfloat16) == "sdpa_per_doc"
    # torch.compile: no host loop
    assert resolve_backend("auto", CPU, torch.float32, static=True) == "sdpa"


def test_auto_chooses_by_the_dtype_attention_runs_in(monkeypatch):
    """fp32 weights under bf16 autocast (train.precision=bf16's default): q, k and v come out of the
    autocast linears in bf16, so `auto` chooses as for bf16 (an H200 run of h100_1gpu chose the
    boolean-mask sdpa, because the residual stream's dtype, fp32, was asked)."""
    seen = []
    monkeypatch.setattr(
        A, "resolve_backend", lambda b, device, dtype, static=False: seen.append(dtype) or "sdpa"
    )
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    doc_mask(1, 8, cu, causal=True, device="cpu", dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        doc_mask(1, 8, cu, causal=True, device="cpu", dtype=torch.float32)
        assert compute_dtype("cpu", torch.float32) == torch.bfloat16
        assert compute_dtype("cuda", torch.float32) == torch.float32  # not on for cuda
    assert seen == [torch.float32, torch.bfloat16]


def test_varlen_refused_on_cpu():
    with pytest.raises(RuntimeError, match="attn_backend='varlen' needs"):
        resolve_backend("varlen", CPU, torch.bfloat16)
    with pytest.raises(
        ConfigError,
        match="model.attn_backend=varlen needs a CUDA device .* runs on the CPU; use "
        "model.attn_backend=auto",
    ):
        validate(compose_job(["model.attn_backend=varlen", "train.device=cpu"]))


def test_static_bounds_fixed_length_with_empty_documents():
    # packer style: trailing repeats
    cu = torch.tensor([0, 5, 24, 30, 31, 48, 48], dtype=torch.int32)
    b = static_bounds(2, 24, cu, "cpu")
    assert b.tolist() == [
        0,
        0,
        5,
        24,
        24,
        30,
        31,
        48,
        48,
        48,
    ]  # the row ends merged in, repeats kept
    assert b.dtype == torch.int32 and static_bounds(2, 24, None, "cpu").tolist() == [0, 24, 48]


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    """What varlen_attn computes, per document with SDPA (GQA by repeating K/V heads)."""
    assert max_q >= int((cu_q[1:] - cu_q[:-1]).max())
    rep = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        if b > a:
            qd, kd, vd = (
                t[a:b].transpose(0, 1)
                for t in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
            )
            out[a:b] = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal).transpose(0, 1)
    return out


# torch 2.13
def _new_api(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
    assert enable_gqa == (q.shape[1] != k.shape[1])
    return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size == (-1, 0))


# an older torch: no window, no GQA
def _old_api(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False):
    assert q.shape[1] == k.shape[1], "K/V heads must have been repeated"
    return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, is_causal)


@pytest.mark.parametrize("api", [_new_api, _old_api])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_plumbing_matches_sdpa(monkeypatch, api, causal):
    import inspect

    params = inspect.signature(api).parameters
    monkeypatch.setattr(
        A, "_varlen_api", lambda: (api, "window_size" in params, "enable_gqa" in params)
    )
    monkeypatch.setattr(A, "resolve_backend", lambda backend, device, dtype, static=False: backend)
    q, k, v = torch.randn(2, 24, 4, 8), torch.randn(2, 24, 2, 8), torch.randn(2, 24, 2, 8)
    cu = torch.tensor([0, 5, 24, 30, 31, 48, 48], dtype=torch.int32)
    mask = doc_mask(2, 24, cu, causal=causal, backend="varlen")
    assert mask.bounds == [] and mask.prepared[1] == 24  # static: no host list, max_seqlen = S
    ref = attention(q, k, v, doc_mask(2, 24, cu, causal=causal, backend="sdpa"))
    torch.testing.assert_close(attention(q, k, v, mask), ref, atol=1e-5, rtol=1e-5)


def test_varlen_takes_autocast_dtype(monkeypatch):
    """fp32 weights under bf16 autocast hand attention fp32 q and k (out of their RMSNorms) and bf16
    v: the flash-attention kernels get all three in bf16, as SDPA does under autocast."""
    seen = []

    def api(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
        seen.append((q.dtype, k.dtype, v.dtype))
        return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size == (-1, 0))

    monkeypatch.setattr(A, "_varlen_api", lambda: (api, True, True))
    monkeypatch.setattr(A, "resolve_backend", lambda backend, device, dtype, static=False: backend)
    q, k, v = torch.randn(1, 16, 4, 8), torch.randn(1, 16, 2, 8), torch.randn(1, 16, 2, 8)
    cu = torch.tensor([0, 7, 16], dtype=torch.int32)
    mask = doc_mask(1, 16, cu, causal=True, backend="varlen")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(q, k, v.bfloat16(), mask)
        ref = attention(q, k, v.bfloat16(), doc_mask(1, 16, cu, causal=True, backend="sdpa"))
    attention(q, k, v, mask)  # no autocast: as given
    assert seen == [(torch.bfloat16,) * 3, (torch.float32,) * 3]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_varlen_matches_sdpa_on_gpu_bf16_gqa_packed():
    if not A.varlen_available():
        pytest.skip(f"varlen needs {A.varlen_missing()}")
    torch.manual_seed(0)
    B, S, H, K, hd = 2, 256, 8, 2, 64
    cu = torch.tensor([0, 37, 200, 256, 300, 301, 512, 512], dtype=torch.int32, device="cuda")
    qkv = [
        torch.randn(B, S, n, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for n in (H, K, K)
    ]
    outs, grads = [], []
    for backend in ("varlen", "sdpa"):
        out = attention(
            *qkv,
            doc_mask(B, S, cu, causal=True, backend=backend, device="cuda", dtype=torch.bfloat16),
        )
        outs.append(out.float())
        grads.append(torch.autograd.grad(out.float().square().sum(), qkv))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
    for g_varlen, g_sdpa in zip(*grads):
        torch.testing.assert_close(g_varlen.float(), g_sdpa.float(), atol=5e-2, rtol=5e-2)
