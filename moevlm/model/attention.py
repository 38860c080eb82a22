"""Variable-length (document-masked) attention behind one function, over several backends.

Legend: B batch, S sequence, H query heads, K key/value heads, hd head dim.

    mask = doc_mask(B, S, cu_seqlens, causal=True, backend="auto", device=..., dtype=...)
    out_BSHD = attention(q_BSHD, k_BSKD, v_BSKD, mask)        # every layer reuses `mask`

Tokens attend only within their document; `cu_seqlens` are int32 boundaries over the flattened
B*S tokens (None: one document per row).  Backends: `sdpa` (boolean document mask), `sdpa_per_doc`
(one call per document), `flex` (FlexAttention), `flash` (flash-attn varlen), `varlen` (torch's
varlen_attn) and `auto`, which picks one per device and the dtype attention runs in (autocast's where
it is on: `moevlm.model.autocast.compute_dtype`; `resolve_backend`).  `static=True`
(under torch.compile) keeps host values out of what the layers see.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from moevlm.model.autocast import compute_dtype
from moevlm.model.region import run_region


@dataclass
class DocMask:
    backend: str
    causal: bool
    bounds: list[int]  # document boundaries over the flattened B*S tokens (host)
    prepared: Any = None  # what the backend precomputed: bool mask, block mask, int32 bounds
    # the packed rows' document starts as given, for layers that read documents, not a mask (Gated DeltaNet)
    cu_seqlens: torch.Tensor | None = None


def doc_mask(
    B: int,
    S: int,
    cu_seqlens: torch.Tensor | None,
    *,
    causal: bool,
    backend: str = "auto",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    static: bool = False,
) -> DocMask:
    # the dtype attention runs in (q, k and v come out of autocast's linears in its dtype, whatever
    # the weights' and the residual stream's)
    attn_dtype = compute_dtype(torch.device(device).type, dtype)
    backend = resolve_backend(backend, torch.device(device), attn_dtype, static)
    if backend in VARLEN_KERNELS and (static or backend == "varlen"):
        return DocMask(
            backend, causal, [], (static_bounds(B, S, cu_seqlens, device), S), cu_seqlens
        )
    # the fixed-size masks read no host bounds: only sdpa_per_doc loops over them
    bounds = [] if static and backend != "sdpa_per_doc" else doc_bounds(B, S, cu_seqlens)
    mask = DocMask(backend, causal, bounds, cu_seqlens=cu_seqlens)
    mask.prepared = _PREPARE[backend](B, S, cu_seqlens, causal, mask.bounds, device)
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocMask) -> torch.Tensor:
    return _BACKENDS[mask.backend](q, k, v, mask)


class CoreAttention(nn.Module):
    """The attention kernel alone (q, k, v, mask -> out), a module so a build step can reach it:
    recompute installs its region here (`region`)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocMask
    ) -> torch.Tensor:
        return run_region(self, "region", attention, q, k, v, mask)


def resolve_backend(
    backend: str, device: torch.device, dtype: torch.dtype, static: bool = False
) -> str:
    if backend == "auto":
        if device.type != "cuda":
            return "sdpa" if static else "sdpa_per_doc"
        if dtype not in (torch.float16, torch.bfloat16):
            return "sdpa"
        return next(
            name
            for name, ok in (
                ("flash", _flash_varlen() is not None),
                ("varlen", varlen_available()),
                ("flex", flex_available()),
                ("sdpa", True),
            )
            if ok
        )
    if backend == "flash" and _flash_varlen() is None:
        raise RuntimeError(
            "attn_backend='flash' needs the optional package 'flash-attn' "
            "(pip install flash-attn); use attn_backend='sdpa' or 'auto' without it"
        )
    if backend == "varlen" and (not varlen_available() or device.type != "cuda"):
        raise RuntimeError(
            f"attn_backend='varlen' needs {varlen_missing() or 'CUDA tensors'} "
            f"(the tensors are on {device.type}); use attn_backend='auto'"
        )
    if backend not in _BACKENDS:
        raise ValueError(f"attn_backend={backend!r}; choose one of {sorted(_BACKENDS) + ['auto']}")
    return backend


def doc_bounds(B: int, S: int, cu_seqlens: torch.Tensor | None) -> list[int]:
    """Document boundaries over the flattened B*S tokens (host list), row ends included."""
    rows = set(range(0, B * S + 1, S))
    if cu_seqlens is not None:
        rows |= set(int(c) for c in cu_seqlens.tolist())
    return sorted(rows)


def static_bounds(B: int, S: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """int32 boundaries over the flattened B*S tokens with a length fixed by the inputs' shapes (no host
    sync): `cu_seqlens` and the B+1 row ends merged and sorted; repeats are empty documents."""
    rows = torch.arange(0, B * S + 1, S, dtype=torch.int32, device=device)
    if cu_seqlens is None:
        return rows
    return torch.sort(
        torch.cat([cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True), rows])
    ).values


def document_ids(B: int, S: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """(B, S) id of the document each token belongs to; masks compare ids within a row."""
    flat = torch.arange(B * S, device=device)
    if cu_seqlens is None:
        return (flat // S).view(B, S)
    starts = cu_seqlens[1:-1].to(device=device, dtype=torch.long, non_blocking=True)
    return torch.bucketize(flat, starts, right=True).view(B, S)


# ------------------------------------------------------------------ prepare
def _prepare_sdpa(B, S, cu_seqlens, causal, bounds, device):
    if cu_seqlens is None:
        return None  # SDPA's own is_causal
    doc = document_ids(B, S, cu_seqlens, device)
    allowed = doc[:, :, None] == doc[:, None, :]
    if causal:
        allowed &= torch.ones(S, S, dtype=torch.bool, device=device).tril()
    return allowed[:, None]  # (B, 1, S, S)


def _prepare_flex(B, S, cu_seqlens, causal, bounds, device):
    from torch.nn.attention.flex_attention import create_block_mask

    doc = document_ids(B, S, cu_seqlens, device)

    def mask_mod(b, h, qi, ki):
        same = doc[b, qi] == doc[b, ki]
        return same & (qi >= ki) if causal else same

    return create_block_mask(mask_mod, B, None, S, S, device=device)


def _prepare_flash(B, S, cu_seqlens, causal, bounds, device):
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.tensor(bounds, dtype=torch.int32, device=device), max(lengths)


_PREPARE = {
    "sdpa": _prepare_sdpa,
    "sdpa_per_doc": lambda *a: None,
    "flex": _prepare_flex,
    "flash": _prepare_flash,
}


# ------------------------------------------------------------------ kernels
def _sdpa(q, k, v, mask: DocMask):
    gqa = q.shape[2] != k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if mask.prepared is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=mask.causal, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.prepared, enable_gqa=gqa)
    return out.transpose(1, 2)


def _sdpa_per_doc(q, k, v, mask: DocMask):
    B, S, H, _ = q.shape
    gqa = H != k.shape[2]
    qf, kf, vf = (t.reshape(B * S, t.shape[2], t.shape[3]) for t in (q, k, v))
    outs = []
    for a, b in zip(mask.bounds[:-1], mask.bounds[1:]):
        qd, kd, vd = (t[a:b].transpose(0, 1)[None] for t in (qf, kf, vf))
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=mask.causal, enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs).view(B, S, H, -1)


def _autocast_inputs(q, k, v):
    """q, k, v in autocast's dtype where autocast is on, as autocast casts them for SDPA.  The kernels
    below are not on autocast's lists, and under bf16 autocast with fp32 weights q and k leave their
    RMSNorms in fp32 while v leaves its linear in bf16: flash-attention takes neither fp32 nor a mix."""
    if not torch.is_autocast_enabled(q.device.type):
        return q, k, v
    dtype = compute_dtype(q.device.type, q.dtype)
    return (t.to(dtype) for t in (q, k, v))


def _flex(q, k, v, mask: DocMask):
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = _autocast_inputs(q, k, v)
    kernel = _compiled_flex() if q.is_cuda else flex_attention  # eager flex materializes the scores
    out = kernel(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        block_mask=mask.prepared,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _flash(q, k, v, mask: DocMask):
    q, k, v = _autocast_inputs(q, k, v)
    B, S, H, hd = q.shape
    bounds, max_len = mask.prepared
    out = _flash_varlen()(
        q.reshape(B * S, H, hd),
        k.reshape(B * S, -1, hd),
        v.reshape(B * S, -1, hd),
        bounds,
        bounds,
        max_len,
        max_len,
        causal=mask.causal,
    )
    return out.view(B, S, H, hd)


def _varlen(q, k, v, mask: DocMask):
    q, k, v = _autocast_inputs(q, k, v)
    B, S, H, hd = q.shape
    bounds, max_len = mask.prepared
    fn, has_window, has_gqa = _varlen_api()
    q, k, v = (t.reshape(B * S, t.shape[2], hd) for t in (q, k, v))
    kwargs = {}
    if k.shape[1] != H:
        if has_gqa:
            kwargs["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
    if mask.causal:
        kwargs.update(window_size=(-1, 0)) if has_window else kwargs.update(is_causal=True)
    return fn(q, k, v, bounds, bounds, max_len, max_len, **kwargs).view(B, S, H, hd)


@functools.cache
def _varlen_api():
    """(varlen_attn, has window_size, has enable_gqa), or None where this torch has no varlen_attn."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "window_size" in params, "enable_gqa" in params


def varlen_missing() -> str | None:
    """Why `varlen` cannot run here, or None."""
    if _varlen_api() is None:
        return "torch.nn.attention.varlen.varlen_attn, which this torch does not have"
    if not torch.cuda.is_available():
        return "a CUDA device (torch's varlen_attn is a flash-attention kernel)"
    return None


def varlen_available() -> bool:
    return varlen_missing() is None


@functools.cache
def flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


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


_BACKENDS = {
    "sdpa": _sdpa,
    "sdpa_per_doc": _sdpa_per_doc,
    "flex": _flex,
    "flash": _flash,
    "varlen": _varlen,
}
VARLEN_KERNELS = ("flash", "varlen")  # backends that take cu_seqlens + max_seqlen
