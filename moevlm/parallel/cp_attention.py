"""Context-parallel attention: local queries against the whole packed row, forward and backward.

Legend: B batch, S sequence (the packed row), s = S/cp local sequence, H query heads, K kv heads, G
= H/K query heads per kv head, hd head dim, cp the context-parallel size (ranks of `group`).

    out_BsHD = cp_attention(q_BsHD, k_BsKD, v_BsKD, pos_Bs, doc_Bs, group=cp_group, comm="ring")

Query i may attend key j iff doc_i == doc_j and (not causal or pos_j <= pos_i), from global
positions and document ids, so any split of the row works.  `allgather`: K/V and ids all-gathered,
SDPA with a boolean mask, dK/dV reduce-scattered in backward.  `ring`: K/V blocks passed around the
ring and merged by an online softmax (fp32 lse), dK/dV travelling back with them.  A group of one is
plain masked SDPA.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moevlm.comm import all_gather_flat, reduce_scatter_sum

COMMS = ("allgather", "ring")
_TAG_KV, _TAG_DKV = 0, 1


def cp_attention(
    q_BsHD: torch.Tensor,
    k_BsKD: torch.Tensor,
    v_BsKD: torch.Tensor,
    pos_Bs: torch.Tensor,
    doc_Bs: torch.Tensor,
    *,
    group,
    comm: str = "allgather",
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """(B, s, H, hd) attention of this rank's queries to the keys of every rank of `group` (like q)."""
    _check_inputs(q_BsHD, k_BsKD, v_BsKD, pos_Bs, doc_Bs, comm)
    scale = q_BsHD.shape[-1] ** -0.5 if scale is None else scale
    if group is None or dist.get_world_size(group) == 1:
        allowed = allowed_mask(pos_Bs, doc_Bs, pos_Bs, doc_Bs, causal)
        return _sdpa(q_BsHD, k_BsKD, v_BsKD, allowed, scale)
    fn = _AllGatherAttention if comm == "allgather" else _RingAttention
    return fn.apply(q_BsHD, k_BsKD, v_BsKD, pos_Bs, doc_Bs, group, causal, scale)


def _check_inputs(q, k, v, pos, doc, comm: str) -> None:
    if comm not in COMMS:
        raise ValueError(f"cp_attention comm={comm!r}; choose one of {list(COMMS)}")
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"cp_attention expects q (B, s, H, hd) and k, v (B, s, K, hd) of one shape; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    (B, s, H, hd), K = q.shape, k.shape[2]
    if k.shape[:2] != (B, s) or k.shape[3] != hd:
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} differ in batch, sequence or head dim"
        )
    if H % K:
        raise ValueError(
            f"{H} query heads cannot share {K} kv heads: H must be a multiple of K (GQA)"
        )
    for name, ids in (("pos", pos), ("doc", doc)):
        if ids.shape != (B, s) or ids.is_floating_point():
            raise ValueError(
                f"cp_attention {name}_Bs must be integer ids of shape (B, s) = {(B, s)} (each "
                f"local token's global position / document id); got {ids.dtype} {tuple(ids.shape)}"
            )


def allowed_mask(
    pos_q: torch.Tensor, doc_q: torch.Tensor, pos_k: torch.Tensor, doc_k: torch.Tensor, causal: bool
) -> torch.Tensor:
    """(B, sq, sk) bool: same document and, when causal, key position <= query position."""
    allowed = doc_q[:, :, None] == doc_k[:, None, :]
    if causal:
        allowed &= pos_k[:, None, :] <= pos_q[:, :, None]
    return allowed


def _sdpa(q, k, v, allowed, scale):
    """SDPA in the (B, s, H, hd) layout with a (B, sq, sk) boolean mask; GQA native."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=allowed[:, None],
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _rank_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _gather_ids(pos, doc, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(cp, B, s) positions and document ids of every rank's tokens, in rank order."""
    ids = all_gather_flat(torch.stack([pos, doc]).long()[None], group)  # (cp, 2, B, s)
    return ids[:, 0], ids[:, 1]


def _row(x_cB: torch.Tensor) -> torch.Tensor:
    """(cp, B, s, ...) per-rank blocks -> (B, cp*s, ...) keys in rank order."""
    return x_cB.movedim(0, 1).flatten(1, 2)


# ------------------------------------------------------------------ all-gather
def _gather_kv(k, v, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, cp*s, K, hd) K and V of every rank (one all-gather)."""
    kv = all_gather_flat(torch.stack([k, v])[None], group)  # (cp, 2, B, s, K, hd)
    return _row(kv[:, 0]), _row(kv[:, 1])


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pos, doc, group, causal, scale):
        pos_all, doc_all = (_row(ids) for ids in _gather_ids(pos, doc, group))
        k_all, v_all = _gather_kv(k, v, group)
        ctx.save_for_backward(q, k, v, pos, doc, pos_all, doc_all)  # ids, not the (B, s, S) mask
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return _sdpa(q, k_all, v_all, allowed_mask(pos, doc, pos_all, doc_all, causal), scale)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, pos, doc, pos_all, doc_all = ctx.saved_tensors
        allowed = allowed_mask(pos, doc, pos_all, doc_all, ctx.causal)
        k_all, v_all = _gather_kv(k, v, ctx.group)
        with torch.enable_grad():
            q, k_all, v_all = (t.detach().requires_grad_() for t in (q, k_all, v_all))
            out = _sdpa(q, k_all, v_all, allowed, ctx.scale)
            dq, dk_all, dv_all = torch.autograd.grad(out, (q, k_all, v_all), dout)
        dk, dv = _reduce_scatter_kv(dk_all, dv_all, ctx.group)
        return dq, dk, dv, None, None, None, None, None


def _reduce_scatter_kv(dk_all, dv_all, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum every rank's (B, cp*s, K, hd) dK/dV and hand each owner its (B, s, K, hd) share."""
    cp = dist.get_world_size(group)
    B, S = dk_all.shape[:2]
    dkv = torch.stack([dk_all, dv_all]).unflatten(2, (cp, S // cp)).movedim(2, 0).contiguous()
    mine = reduce_scatter_sum(dkv, group)  # (1, 2, B, s, K, hd)
    return mine[0, 0], mine[0, 1]


# ------------------------------------------------------------------ ring
def _heads(x_BsHD: torch.Tensor, K: int) -> torch.Tensor:
    """(B, s, H, hd) -> fp32 (B, K, G, s, hd): query head h = kv head h // G, as SDPA's enable_gqa."""
    B, s, H, hd = x_BsHD.shape
    return x_BsHD.float().reshape(B, s, K, H // K, hd).permute(0, 2, 3, 1, 4)


def _unheads(x_BKGsD: torch.Tensor) -> torch.Tensor:
    """fp32 (B, K, G, s, hd) -> (B, s, H, hd)."""
    return x_BKGsD.permute(0, 3, 1, 2, 4).flatten(2, 3)


def _scores(q, k, allowed, scale):
    """fp32 (B, K, G, sq, sk) masked scores (-inf where not allowed)."""
    qh, kh = _heads(q, k.shape[2]), _heads(k, k.shape[2])
    return (qh @ kh.transpose(-1, -2) * scale).masked_fill(~allowed[:, None, None], float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (no allowed key) replaced by 0, so exp(-inf - lse) is 0, never NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _block(q, k, v, allowed, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: fp32 out (B, sq, H, hd) and lse (B, H, sq) of q against k/v under `allowed` (B, sq, sk).
    A query with no allowed key has lse -inf and out 0."""
    K = k.shape[2]
    scores = _scores(q, k, allowed, scale)
    lse = scores.logsumexp(-1)
    out = torch.exp(scores - _finite(lse)[..., None]) @ _heads(v, K)
    return _unheads(out), lse.flatten(1, 2)


def _merge(out, lse, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: (out, lse) of the keys seen so far and of one more block -> of them all."""
    new = torch.logaddexp(lse, lse_b)
    safe = _finite(new)
    w, w_b = (torch.exp(x - safe).transpose(1, 2)[..., None] for x in (lse, lse_b))
    return w * out + w_b * out_b, new


def _block_grads(q, k, v, allowed, scale, dout, lse, delta):
    """fp32 (dq, dk, dv) of one block given the final lse (B, H, sq) and delta = rowsum(dO * out)."""
    K = k.shape[2]
    G = q.shape[2] // K
    p = torch.exp(_scores(q, k, allowed, scale) - _finite(lse).unflatten(1, (K, G))[..., None])
    do = _heads(dout, K)
    dv = (p.transpose(-1, -2) @ do).sum(2)  # (B, K, sk, hd)
    dp = do @ _heads(v, K).transpose(-1, -2)
    ds = p * (dp - delta.unflatten(1, (K, G))[..., None])
    dq = ds @ _heads(k, K) * scale
    dk = (ds.transpose(-1, -2) @ _heads(q, K)).sum(2) * scale
    return _unheads(dq), dk.transpose(1, 2), dv.transpose(1, 2)


def _shift(x: torch.Tensor, group, tag: int) -> tuple[list, torch.Tensor]:
    """Post: send `x` to the next rank, receive the previous rank's into a new buffer (wait on the list)."""
    r, n = _rank_size(group)
    nxt = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x, dist.get_global_rank(group, (r + 1) % n), group, tag),
        dist.P2POp(dist.irecv, nxt, dist.get_global_rank(group, (r - 1) % n), group, tag),
    ]
    return dist.batch_isend_irecv(ops), nxt


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pos, doc, group, causal, scale):
        r, n = _rank_size(group)
        pos_all, doc_all = _gather_ids(pos, doc, group)
        kv = torch.stack([k, v])  # this step's block; block src = (r - t) % n at step t
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), device=q.device)
        for t in range(n):
            src = (r - t) % n
            if t < n - 1:
                works, kv_next = _shift(kv, group, _TAG_KV)  # in flight while this block computes
            allowed = allowed_mask(pos, doc, pos_all[src], doc_all[src], causal)
            out, lse = _merge(out, lse, *_block(q, kv[0], kv[1], allowed, scale))
            if t < n - 1:
                _wait(works)
                kv = kv_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, pos, doc, pos_all, doc_all, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, pos, doc, pos_all, doc_all, out, lse = ctx.saved_tensors
        group = ctx.group
        r, n = _rank_size(group)
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (B, H, s)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv_works, dkv_next = [], torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for t in range(n):
            src = (r - t) % n
            if t < n - 1:
                kv_works, kv_next = _shift(kv, group, _TAG_KV)
            _wait(dkv_works)  # dkv: the gradient of block src summed over the ranks it has visited
            dkv = dkv_next
            allowed = allowed_mask(pos, doc, pos_all[src], doc_all[src], ctx.causal)
            dq_b, dk_b, dv_b = _block_grads(q, kv[0], kv[1], allowed, ctx.scale, dout, lse, delta)
            dq += dq_b
            dkv[0] += dk_b
            dkv[1] += dv_b
            dkv_works, dkv_next = _shift(dkv, group, _TAG_DKV)  # after the last step: to its owner
            if t < n - 1:
                _wait(kv_works)
                kv = kv_next
        _wait(dkv_works)
        return (
            dq.to(q.dtype),
            dkv_next[0].to(k.dtype),
            dkv_next[1].to(v.dtype),
            None,
            None,
            None,
            None,
            None,
        )


__all__ = ["COMMS", "allowed_mask", "cp_attention"]
