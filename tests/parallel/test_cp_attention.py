"""cp_attention equals full-row document-masked attention: output, dQ, dK, dV (CPU, gloo, fp32).

One launch per cp (2 and 4) checks every case x causal x comm; the ring's block math (online softmax,
fully masked rows, the block backward) and the group-of-one path are checked without processes.
"""

import pytest
import torch
from gloo_ranks import run_ranks

from moevlm.model.attention import attention, doc_mask, document_ids
from moevlm.parallel.cp_attention import (
    COMMS,
    _block,
    _block_grads,
    _merge,
    allowed_mask,
    cp_attention,
)
from moevlm.parallel.cp_layout import take_seq, zigzag_positions

B, S, H, K, HD = 2, 48, 4, 2, 8
TOL = 1e-5


def _random_bounds(seed: int, lo: int, hi: int) -> torch.Tensor:
    """cu_seqlens over the flattened B*S tokens with document lengths in [lo, hi] (seeded)."""
    g = torch.Generator().manual_seed(seed)
    bounds = [0]
    while bounds[-1] < B * S:
        bounds.append(min(B * S, bounds[-1] + int(torch.randint(lo, hi + 1, (), generator=g))))
    return torch.tensor(bounds, dtype=torch.int32)


CASES = {
    "short_docs": _random_bounds(1, 1, 5),  # shorter than a chunk (12 at cp=2, 6 at cp=4)
    "long_docs": _random_bounds(2, 14, 40),  # each spans several chunks
    # row 0: one document over positions 5..42 (every chunk boundary inside it); row 1: documents
    # ending exactly on the cp=2 chunk boundaries 12 and 36, one across the cp=4 boundaries between
    "chunk_boundaries": torch.tensor([0, 5, 43, 48, 60, 84, 96], dtype=torch.int32),
    "one_doc_per_row": None,
    # [30,48), [89,96) pad
    "trailing_padding": torch.tensor([0, 10, 30, 48, 68, 89, 96], dtype=torch.int32),
}


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, n, HD, generator=g).requires_grad_() for n in (H, K, K))
    return q, k, v, torch.randn(B, S, H, HD, generator=g)  # last: the upstream gradient's weight


def _reference(cu, causal):
    q, k, v, w = _inputs()
    out = attention(q, k, v, doc_mask(B, S, cu, causal=causal, backend="sdpa"))
    (out * w).sum().backward()
    return out.detach(), (q.grad, k.grad, v.grad), (q, k, v, w)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _errors(rank: int, cp: int, group, cu, causal: bool, comm: str) -> dict[str, float]:
    """Relative errors of this rank's output and dQ/dK/dV slices against the full-row reference."""
    out, grads, full = _reference(cu, causal)
    idx = zigzag_positions(S, cp, rank)
    q, k, v, w = (take_seq(t.detach(), idx).requires_grad_() for t in full)
    pos = idx.expand(B, -1)
    doc = take_seq(document_ids(B, S, cu, "cpu"), idx)
    mine = cp_attention(q, k, v, pos, doc, group=group, comm=comm, causal=causal)
    (mine * w).sum().backward()
    got = {"out": mine.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    want = dict(zip(got, (take_seq(t, idx) for t in (out, *grads))))
    return {name: _rel(got[name], want[name]) for name in got}


def _checks(rank: int, cp: int) -> None:
    group = torch.distributed.group.WORLD
    for name, cu in CASES.items():
        for causal in (True, False):
            for comm in COMMS:
                errs = _errors(rank, cp, group, cu, causal, comm)
                assert max(errs.values()) <= TOL, (name, causal, comm, rank, errs)


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_matches_full_row_attention_on_gloo_ranks(tmp_path, cp):
    run_ranks(_checks, cp, tmp_path, cp)


@pytest.mark.parametrize("causal", [True, False])
def test_group_of_one_is_plain_masked_attention(causal):
    for name, cu in CASES.items():
        errs = _errors(0, 1, None, cu, causal, "ring")
        assert max(errs.values()) <= TOL, (name, errs)


def _split_keys_case():
    """Random q/k/v, with document + causal mask over 3 key blocks; some queries see no key of a block."""
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(B, 12, n, HD, generator=g) for n in (H, K, K, H))
    doc = document_ids(B, 12, torch.tensor([0, 3, 9, 12, 13, 24], dtype=torch.int32), "cpu")
    pos = torch.arange(12).expand(B, -1)
    return q, k, v, dout, allowed_mask(pos, doc, pos, doc, causal=True)


def test_ring_blocks_merge_to_one_softmax_and_their_grads_match_autograd():
    q, k, v, dout, allowed = _split_keys_case()
    scale = 0.3
    ref_out, _ = _block(q, k, v, allowed, scale)
    out = torch.zeros(B, 12, H, HD)
    lse = torch.full((B, H, 12), float("-inf"))
    for keys in torch.arange(12).chunk(3):  # block 2's keys are all masked for the first queries
        out_b, lse_b = _block(q, k[:, keys], v[:, keys], allowed[..., keys], scale)
        assert (
            not out_b.isnan().any()
            and out_b[torch.isneginf(lse_b).transpose(1, 2)].abs().max() == 0
        )
        out, lse = _merge(out, lse, out_b, lse_b)
    assert _rel(out, ref_out) <= TOL

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    torch.autograd.backward(_block(qg, kg, vg, allowed, scale)[0], dout)
    delta = (dout * out).sum(-1).transpose(1, 2)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for keys in torch.arange(12).chunk(3):
        dq, dk, dv = _block_grads(
            q, k[:, keys], v[:, keys], allowed[..., keys], scale, dout, lse, delta
        )
        grads[0] += dq
        grads[1][:, keys] += dk
        grads[2][:, keys] += dv
    for got, want in zip(grads, (qg.grad, kg.grad, vg.grad)):
        assert _rel(got, want) <= TOL


def test_bad_arguments_are_refused_with_readable_messages():
    q, k, v = torch.zeros(B, 6, H, HD), torch.zeros(B, 6, K, HD), torch.zeros(B, 6, K, HD)
    ids = torch.zeros(B, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="comm='tree'; choose one of"):
        cp_attention(q, k, v, ids, ids, group=None, comm="tree")
    with pytest.raises(ValueError, match="H must be a multiple of K"):
        cp_attention(q, torch.zeros(B, 6, 3, HD), torch.zeros(B, 6, 3, HD), ids, ids, group=None)
    with pytest.raises(ValueError, match="of one shape"):
        cp_attention(q, k, v[..., :4], ids, ids, group=None)
    with pytest.raises(ValueError, match="differ in batch, sequence or head dim"):
        cp_attention(q, k[:, :4], v[:, :4], ids, ids, group=None)
    with pytest.raises(
        ValueError, match=r"pos_Bs must be integer ids of shape \(B, s\) = \(2, 6\)"
    ):
        cp_attention(q, k, v, ids[:, :5], ids, group=None)
    with pytest.raises(ValueError, match="doc_Bs must be integer ids"):
        cp_attention(q, k, v, ids, ids.float(), group=None)
