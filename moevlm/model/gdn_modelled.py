"""flash-linear-attention's chunked gated delta rule as a plan models it: the tensors its kernels
allocate, in their order, sizes and dtypes, and what it keeps for the backward; no values.

Legend: T tokens, H value heads, Kd key head dim, Vd value head dim, L = 64 the kernel's chunk, NT
its chunks (at most T // L + documents).

    o_THV = modelled_fla_chunk(q_THK, k_THK, v_THV, g_TH, beta_TH, bounds)   # fake tensors only

Forward: l2-normed q and k (with fp32 row norms), the chunk-local cumsum of g (fp32), A (T, H, L),
w, u, the chunk states h (NT, H, Kd, Vd) and the new values, then o; w, u, h and the new values are
freed, the rest kept.  Backward: w, u, h and the new values again, dv, dh (NT, H, Kd, Vd), dq, dk,
dw, dg (per key block, fp32), the WY backward's dk, dv, db, dg, the reverse cumsum, the l2-norm
backward.  Sources: fla-org/flash-linear-attention bc3b101, fla/ops/gated_delta_rule/chunk.py and
the kernels it calls (chunk_fwd.py, wy_fast.py, common/chunk_delta_h.py, common/chunk_o.py).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

CHUNK = 64  # fla's chunk for this kernel
KEY_BLOCK = 64  # chunk_bwd_dqkwg's key tile: dg has one fp32 slice per block of Kd


def modelled_fla_chunk(q, k, v, g, beta, bounds) -> torch.Tensor:
    """o (T, H, Vd) in v's dtype from fla's kernel as modelled; q, k by key head are repeated to the
    value heads as `moevlm.model.gated_deltanet` hands them to fla."""
    if not all(is_fake(t) for t in (q, k, v)):
        raise RuntimeError(
            "the modelled fla kernel runs in a plan only (fake tensors): it has no values"
        )
    H, low = v.shape[1], torch.bfloat16 if v.dtype == torch.float32 else v.dtype
    q, k = (x.repeat_interleave(H // x.shape[1], dim=1).to(low) for x in (q, k))
    chunks = q.shape[0] // CHUNK + bounds.numel() - 1
    return _Modelled.apply(q, k, v.to(low), g.float(), beta.to(low), chunks).to(v.dtype)


def _states(k: torch.Tensor, v: torch.Tensor, chunks: int) -> torch.Tensor:
    return k.new_empty(chunks, k.shape[1], k.shape[2], v.shape[2])


class _Modelled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, chunks: int):
        qn, kn = torch.empty_like(q), torch.empty_like(k)  # l2norm_fwd
        rstd = [x.new_empty(x.shape[0] * x.shape[1], dtype=torch.float32) for x in (q, k)]
        g_cum = torch.empty_like(g)  # chunk_local_cumsum
        A = k.new_empty(*k.shape[:2], CHUNK)  # the solved (I + A)^-1, kept
        w, u = torch.empty_like(kn), torch.empty_like(v)  # recompute_w_u_fwd
        h, v_new = _states(kn, v, chunks), torch.empty_like(u)  # chunk_gated_delta_rule_fwd_h
        o = torch.empty_like(v_new)  # chunk_fwd_o
        del w, u, h, v_new
        ctx.chunks = chunks
        ctx.save_for_backward(qn, kn, *rstd, v, g_cum, beta, A)
        return o

    @staticmethod
    def backward(ctx, do):
        qn, kn, _, _, v, g_cum, beta, _ = ctx.saved_tensors
        w, u = torch.empty_like(kn), torch.empty_like(v)  # recompute_w_u_fwd
        h, v_new = _states(kn, v, ctx.chunks), torch.empty_like(u)
        dv = torch.empty_like(do)  # chunk_bwd_dv_local
        dh, dv = _states(qn, v, ctx.chunks), torch.empty_like(dv)  # chunk_gated_delta_rule_bwd_dhu
        blocks = -(-kn.shape[2] // KEY_BLOCK)
        dq, dk, dw = torch.empty_like(qn), torch.empty_like(kn), torch.empty_like(w)
        dg = g_cum.new_empty(blocks, *g_cum.shape).sum(0)  # chunk_bwd_dqkwg
        del h, v_new, dh, w, u
        dk2, dv, db, dg2 = (
            torch.empty_like(kn),
            torch.empty_like(v),
            torch.empty_like(beta),
            torch.empty_like(g_cum),
        )
        del dk2, dg2, dw  # dk2 and dg2 added into dk and dg in place
        dg = torch.empty_like(dg)  # the reverse cumsum
        dq, dk = torch.empty_like(dq), torch.empty_like(dk)  # l2norm_bwd
        return dq, dk, dv, dg, db, None
