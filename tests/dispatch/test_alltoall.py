"""The all-to-all dispatcher: its index logic on hand-worked cases (no processes),
EP size 1 against `local`, and one 4-rank gloo launch comparing EP=4 (default
group) and EP=2 (two subgroups) with an unsharded `local` reference: forward,
gradients w.r.t. x, router weights and expert weights, with idle experts, an idle
rank and a rank that sends nothing."""

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from moevlm.kernels.grouped_gemm import grouped_mm_loop

from moevlm.dispatch import DISPATCHERS, LocalDispatcher, build_dispatcher
from moevlm.dispatch.alltoall import (
    AllToAllDispatcher,
    divisibility_reason,
    invert_permutation,
    rank_splits,
    regroup_by_local_expert,
    sort_rows_by_expert,
)

# ------------------------------------------------------- index logic, by hand

# 2 ranks x 2 local experts (E=4), 3 tokens each, top-2.  Token t of rank r is
# labelled 100r + t.
ROUTING = {
    0: torch.tensor([[2, 0], [3, 2], [1, 2]]),
    1: torch.tensor([[1, 3], [0, 1], [3, 1]]),
}


def test_sort_rows_by_expert_and_rank_splits():
    order = sort_rows_by_expert(ROUTING[0])  # flat ids [2, 0, 3, 2, 1, 2]
    assert order.tolist() == [1, 4, 0, 3, 5, 2]  # e0: row 1; e1: row 4; e2: rows 0, 3, 5; e3: row 2
    assert (order // 2).tolist() == [0, 2, 0, 1, 2, 1]  # source tokens
    assert rank_splits([1, 1, 3, 1], ep_size=2) == [2, 4]
    assert rank_splits([1, 3, 0, 2], ep_size=2) == [4, 2]
    assert rank_splits([0, 0, 5, 0, 1, 2], ep_size=3) == [0, 5, 3]


def test_regroup_received_blocks_expert_major():
    # Received from source 0: 3 rows for local expert 0, 1 for expert 1; from source 1: 2, 0.
    perm = regroup_by_local_expert(torch.tensor([[3, 1], [2, 0]]))
    assert perm.tolist() == [0, 1, 2, 4, 5, 3]  # e0: s0 rows 0-2, s1 rows 4-5; e1: s0 row 3
    assert invert_permutation(perm).tolist() == [0, 1, 2, 5, 3, 4]
    # 3 sources, source 1 sends nothing: e0 <- s0 row 0, s2 rows 3-4; e1 <- s0 rows 1-2, s2 row 5.
    perm = regroup_by_local_expert(torch.tensor([[1, 2], [0, 0], [2, 1]]), num_rows=6)
    assert perm.tolist() == [0, 3, 4, 1, 2, 5]
    assert regroup_by_local_expert(torch.zeros(2, 2, dtype=torch.long)).tolist() == []


def test_etp_gathered_blocks_regroup_expert_major():
    """Under ETP the rows of Q=2 ETP peers (each already holding P=2 EP-source blocks of L=2 local experts)
    are concatenated peer-major; the same regroup over Q*P blocks puts every expert's rows together,
    peer 0's before peer 1's, and the per-peer row counts are the ETP exchange splits."""
    # peer 0 received (s0: e0 1, e1 2), (s1: e0 0, e1 1); peer 1 received (s0: e0 2, e1 0), (s1: e0 1, e1 1)
    blocks = torch.tensor([[1, 2], [0, 1], [2, 0], [1, 1]])
    assert rank_splits(blocks.reshape(-1).tolist(), 2) == [4, 4]  # rows per ETP peer
    perm = regroup_by_local_expert(blocks, num_rows=8)
    # rows: peer0 [0: s0e0, 1-2: s0e1, 3: s1e1], peer1 [4-5: s0e0, 6: s1e0, 7: s1e1]
    assert perm.tolist() == [0, 4, 5, 6, 1, 2, 3, 7]
    assert blocks.sum(0).tolist() == [4, 4]  # tokens per local expert after the gather


def test_two_rank_exchange_simulated_by_hand():
    """The whole dispatch plan of both ranks with the collectives done by slicing."""
    sent, splits, counts = {}, {}, {}
    for r, idx in ROUTING.items():
        labels = 100 * r + sort_rows_by_expert(idx) // 2
        counts[r] = torch.bincount(idx.reshape(-1), minlength=4)
        splits[r] = rank_splits(counts[r].tolist(), 2)
        sent[r] = labels.split(splits[r])
    got = {}
    for p in range(2):
        received = torch.cat([sent[src][p] for src in range(2)])
        recv_counts_PL = torch.stack([counts[src].view(2, 2)[p] for src in range(2)])
        got[p] = (
            received[regroup_by_local_expert(recv_counts_PL)].tolist(),
            recv_counts_PL.sum(0).tolist(),
        )
    assert got[0] == ([0, 101, 2, 100, 101, 102], [2, 4])  # e0: t0, r1t1; e1: t2, r1t0, r1t1, r1t2
    assert got[1] == ([0, 1, 2, 1, 100, 102], [3, 3])  # e2: t0, t1, t2; e3: t1, r1t0, r1t2


def test_divisibility_reason_names_both_numbers():
    assert divisibility_reason(8, 4) is None
    reason = divisibility_reason(6, 4)
    assert "6" in reason and "4" in reason and "divid" in reason
    # no process group: EP 1
    assert AllToAllDispatcher.unavailable_reason(num_experts=6, top_k=2) is None


# ------------------------------------------------------- EP size 1 is local


def test_ep_size_one_is_local_exactly():
    assert DISPATCHERS["alltoall"] is AllToAllDispatcher
    a2a = build_dispatcher("alltoall", num_experts=4, top_k=2)
    assert a2a.ep_size == 1 and a2a.num_local_experts == 4
    outs = []
    for d in (LocalDispatcher(4, 2), a2a):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1)).requires_grad_()
        w = torch.rand(5, 2, generator=torch.Generator().manual_seed(2)).requires_grad_()
        idx = torch.tensor([[1, 3], [0, 1], [3, 2], [1, 0], [2, 3]])
        ex, counts, h = d.dispatch(x, idx, w)
        y = d.combine(ex * torch.arange(1.0, 5.0).repeat_interleave(counts)[:, None], h)
        y.pow(2).sum().backward()
        outs.append((ex, counts, y, x.grad, w.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# ------------------------------------------------------- 4 ranks, one launch

E, K, D = 8, 2, 6
SEEDS = {"random": 1, "idle": 2, "silent": 3}


def _routing(gen, T, allowed):
    allowed = torch.tensor(allowed)
    picks = [allowed[torch.randperm(len(allowed), generator=gen)[:K]] for _ in range(T)]
    idx = torch.stack(picks) if picks else torch.zeros(0, K, dtype=torch.long)
    w = torch.rand(T, K, generator=gen) + 0.1
    return idx, w / w.sum(1, keepdim=True)


def _scenario(name, rank, ep_rank, L):
    """Per-rank inputs: x_TD, topk idx/w, output cotangent."""
    gen = torch.Generator().manual_seed(100 * SEEDS[name] + rank)
    T, allowed = 4 + rank, list(range(E))
    if name == "idle":  # EP rank 0 receives nothing; the last expert receives nothing
        allowed = list(range(L, E - 1))
    if name == "silent" and ep_rank == 1:  # sends nothing
        T = 0
    idx, w = _routing(gen, T, allowed)
    return torch.randn(T, D, generator=gen), idx, w, torch.randn(T, D, generator=gen)


def _grad(t):
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _moe(d, x, idx, w, W_LDD):
    ex, counts, h = d.dispatch(x, idx, w)
    return d.combine(grouped_mm_loop(ex, W_LDD, counts), h), counts


def _check_scenario(name, d, group, W_EDD):
    P, r, L = dist.get_world_size(group), dist.get_rank(group), E // dist.get_world_size(group)
    x0, idx, w0, g = _scenario(name, dist.get_rank(), r, L)
    mine = slice(r * L, (r + 1) * L)

    x, w, W = (
        x0.clone().requires_grad_(),
        w0.clone().requires_grad_(),
        W_EDD[mine].clone().requires_grad_(),
    )
    y, counts_L = _moe(d, x, idx, w, W)
    (y * g).sum().backward()

    xr, wr, Wr = (
        x0.clone().requires_grad_(),
        w0.clone().requires_grad_(),
        W_EDD.clone().requires_grad_(),
    )
    y_ref, counts_E = _moe(LocalDispatcher(E, K), xr, idx, wr, Wr)
    (y_ref * g).sum().backward()
    W_grad_ref = _grad(Wr)
    dist.all_reduce(W_grad_ref, group=group)  # each expert's grad sums every rank's tokens
    dist.all_reduce(counts_E, group=group)

    where = f"{name} EP={P} rank {dist.get_rank()}"
    assert counts_L.tolist() == counts_E[mine].tolist(), where
    tol = dict(rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(_grad(x), _grad(xr), **tol)
    torch.testing.assert_close(_grad(w), _grad(wr), **tol)
    torch.testing.assert_close(_grad(W), W_grad_ref[mine], **tol)
    return counts_L


def _four_rank_checks(rank):
    W_EDD = torch.randn(E, D, D, generator=torch.Generator().manual_seed(7)) / D**0.5
    subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    setups = [("EP=4", None), ("EP=2", subgroups[rank // 2])]
    for label, group in setups:
        d = build_dispatcher("alltoall", num_experts=E, top_k=K, ep_group=group)
        group = group or dist.group.WORLD
        assert d.ep_size == dist.get_world_size(group), label
        for name in ("random", "idle", "silent"):
            counts_L = _check_scenario(name, d, group, W_EDD)
            if name == "idle" and d.ep_rank == 0:
                assert counts_L.sum() == 0, label
    # The availability gate: 6 experts over 4 ranks.
    assert "6" in AllToAllDispatcher.unavailable_reason(num_experts=6, top_k=K)
    with pytest.raises(RuntimeError, match="num_experts=6"):
        build_dispatcher("alltoall", num_experts=6, top_k=K)
    assert (
        AllToAllDispatcher.unavailable_reason(num_experts=6, top_k=K, ep_group=subgroups[rank // 2])
        is None
    )
    _four_rank_checks_etp(rank)


def _check_etp(rank, W1_EDF, W2_EFD):
    """EP=2 x ETP=2 (rank = 2*ep + etp): every expert's hidden F split over the ETP pair; the dispatcher
    all-gathers rows over ETP and reduce-scatters the partial outputs; equal to local with whole experts."""
    ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    etp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ep_i, etp_i = divmod(rank, 2)
    d = AllToAllDispatcher(E, K, ep_group=ep_groups[etp_i], etp_group=etp_groups[ep_i])
    L, Fh = E // 2, W1_EDF.shape[2] // 2
    x0, idx, w0, g = _scenario("random", rank, ep_i, L)
    mine, half = slice(ep_i * L, (ep_i + 1) * L), slice(etp_i * Fh, (etp_i + 1) * Fh)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    W1, W2 = (
        W1_EDF[mine, :, half].clone().requires_grad_(),
        W2_EFD[mine, half].clone().requires_grad_(),
    )
    ex, counts, h = d.dispatch(x, idx, w)
    y = d.combine(grouped_mm_loop(torch.tanh(grouped_mm_loop(ex, W1, counts)), W2, counts), h)
    (y * g).sum().backward()

    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    W1r, W2r = W1_EDF.clone().requires_grad_(), W2_EFD.clone().requires_grad_()
    loc = LocalDispatcher(E, K)
    ex, counts_E, h = loc.dispatch(xr, idx, wr)
    y_ref = loc.combine(
        grouped_mm_loop(torch.tanh(grouped_mm_loop(ex, W1r, counts_E)), W2r, counts_E), h
    )
    (y_ref * g).sum().backward()
    g1, g2 = _grad(W1r), _grad(W2r)
    for t in (g1, g2, counts_E):
        dist.all_reduce(t)  # every rank's tokens reach every expert
    tol = dict(rtol=1e-5, atol=1e-6, msg=lambda m: f"ETP rank {rank}: {m}")
    assert counts.tolist() == counts_E[mine].tolist()
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(_grad(x), _grad(xr), **tol)
    torch.testing.assert_close(_grad(w), _grad(wr), **tol)
    torch.testing.assert_close(_grad(W1), g1[mine, :, half], **tol)
    torch.testing.assert_close(_grad(W2), g2[mine, half], **tol)


def _check_exchange_over_one_rank(rank, W_EDD):
    """`always_exchange` over a group of one runs the whole exchange path and equals local."""
    solo = [dist.new_group([r]) for r in range(4)]
    d = AllToAllDispatcher(E, K, ep_group=solo[rank], always_exchange=True)
    x0, idx, w0, g = _scenario("random", rank, 0, E)
    x = x0.clone().requires_grad_()
    y, _ = _moe(d, x, idx, w0, W_EDD)
    xr = x0.clone().requires_grad_()
    y_ref, _ = _moe(LocalDispatcher(E, K), xr, idx, w0, W_EDD)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, xr.grad)


def _four_rank_checks_etp(rank):
    gen = torch.Generator().manual_seed(11)
    _check_etp(
        rank,
        torch.randn(E, D, 6, generator=gen) / D**0.5,
        torch.randn(E, 6, D, generator=gen) / 6**0.5,
    )
    _check_exchange_over_one_rank(rank, torch.randn(E, D, D, generator=gen) / D**0.5)


@pytest.mark.slow
def test_four_ranks_ep4_and_ep2_match_local(tmp_path):
    run_ranks(_four_rank_checks, 4, tmp_path)
