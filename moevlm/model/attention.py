"""Variable-length (document-masked) attention behind one function.

Legend: B batch, S sequence, H query heads, K key/value heads, hd head dim.

`attention(q_BSHD, k_BSKD, v_BSKD, causal, cu_seqlens, backend)`: tokens attend
only within their document.  `cu_seqlens` are int32 boundaries over the
flattened B*S tokens (flash-attn's convention); row ends are always boundaries.
`None` means one document per row.  GQA is native in every backend (no
repeat_kv copies).

Backends:
- `sdpa`: one `scaled_dot_product_attention` call with a boolean document mask.
  Works everywhere with forward and backward (CPU tests), no host sync; the
  mask is O(S^2), fine for CPU and short sequences.
- `sdpa_per_doc`: one SDPA call per document (host loop, like the reference's
  vision tower).  Does exactly the useful FLOPs; used by the FLOP-counter tests.
- `flex`: FlexAttention with a document block mask, compiled on CUDA; eager on
  CPU, where it has no backward (FACTS).
- `flash`: flash-attn's varlen kernel (optional package, CUDA, fp16/bf16).
- `auto`: `flash` when importable and the tensors are on CUDA in half
  precision, else `sdpa`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              cu_seqlens: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    backend = resolve_backend(backend, q)
    return _BACKENDS[backend](q, k, v, causal, cu_seqlens)


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    if backend == "auto":
        half = q.dtype in (torch.float16, torch.bfloat16)
        return "flash" if q.is_cuda and half and _flash_varlen() is not None else "sdpa"
    if backend == "flash" and _flash_varlen() is None:
        raise RuntimeError("attn_backend='flash' needs the optional package 'flash-attn' "
                           "(pip install flash-attn); use attn_backend='sdpa' or 'auto' without it")
    if backend not in _BACKENDS:
        raise ValueError(f"attn_backend={backend!r}; choose one of {sorted(_BACKENDS) + ['auto']}")
    return backend


def document_ids(B: int, S: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """(B, S) id of the document each token belongs to; masks compare ids within a row."""
    flat = torch.arange(B * S, device=device)
    if cu_seqlens is None:
        return (flat // S).view(B, S)
    starts = cu_seqlens[1:-1].to(device=device, dtype=torch.long)
    return torch.bucketize(flat, starts, right=True).view(B, S)


def _sdpa(q, k, v, causal, cu_seqlens):
    B, S, H, _ = q.shape
    gqa = H != k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if cu_seqlens is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    else:
        doc = document_ids(B, S, cu_seqlens, q.device)
        mask = doc[:, :, None] == doc[:, None, :]
        if causal:
            mask &= torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)
    return out.transpose(1, 2)


def _sdpa_per_doc(q, k, v, causal, cu_seqlens):
    B, S, H, _ = q.shape
    gqa = H != k.shape[2]
    bounds = doc_bounds(B, S, cu_seqlens)
    qf, kf, vf = (t.reshape(B * S, t.shape[2], t.shape[3]) for t in (q, k, v))
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qd, kd, vd = (t[a:b].transpose(0, 1)[None] for t in (qf, kf, vf))
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, enable_gqa=gqa)[0].transpose(0, 1))
    return torch.cat(outs).view(B, S, H, -1)


def _flex(q, k, v, causal, cu_seqlens):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, S, H, _ = q.shape
    doc = document_ids(B, S, cu_seqlens, q.device)

    def mask_mod(b, h, qi, ki):
        same = doc[b, qi] == doc[b, ki]
        return same & (qi >= ki) if causal else same

    block_mask = create_block_mask(mask_mod, B, None, S, S, device=q.device)
    kernel = _compiled_flex() if q.is_cuda else flex_attention  # eager flex materialises the scores
    out = kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                         enable_gqa=H != k.shape[2])
    return out.transpose(1, 2)


def _flash(q, k, v, causal, cu_seqlens):
    B, S, H, hd = q.shape
    bounds = torch.tensor(doc_bounds(B, S, cu_seqlens), dtype=torch.int32, device=q.device)
    max_len = int((bounds[1:] - bounds[:-1]).max())
    out = _flash_varlen()(q.reshape(B * S, H, hd), k.reshape(B * S, -1, hd), v.reshape(B * S, -1, hd),
                          bounds, bounds, max_len, max_len, causal=causal)
    return out.view(B, S, H, hd)


def doc_bounds(B: int, S: int, cu_seqlens: torch.Tensor | None) -> list[int]:
    """Document boundaries over the flattened B*S tokens (host list), row ends included."""
    rows = set(range(0, B * S + 1, S))
    if cu_seqlens is not None:
        rows |= set(int(c) for c in cu_seqlens.tolist())
    return sorted(rows)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


_BACKENDS = {"sdpa": _sdpa, "sdpa_per_doc": _sdpa_per_doc, "flex": _flex, "flash": _flash}
