"""The `hybridep` dispatcher (moevlm/dispatch/hybridep.py) against the `alltoall` dispatcher, on CPU gloo ranks.

The real HybridEP cannot run here: `deep_ep` is the TEST EMULATOR in hybrid_ep_emulator/ (its README says
which upstream semantics it follows: 2-byte rows, unwritten rows past the used count (NaN), the token-count
alignment, a buffer that grows itself), put first on sys.path.  One 4-rank launch checks HybridEP groups of 4
(the world) and of 2 (two subgroups), with fp32 rows (as without FSDP's bf16 compute):
- dropless: outputs and gradients w.r.t. x, router weights and expert weights equal to alltoall's (to
  bf16's precision: rows cross HybridEP in bf16) with uneven token counts, an idle expert and a rank nothing is routed to, and a rank
  with no tokens; the same with each expert's rows padded to 4 (FP8's pad_multiple); the same under
  selective recompute (HybridEP's dispatch not run again); the handle store empties;
- capacity mode (static num_permuted_tokens): equal to dropless when nothing overflows; with forced
  overflow the dropped rows are exactly the ones counted by hand (per rank), the overflow flag is set where
  they were dropped, `OverflowCounter` reports both, and the result equals alltoall with those choices'
  router weights set to zero, the last expert's weight gradients finite (the unused tail HybridEP never
  writes is masked); the whole path runs on the meta device with every host read refused, and
  torch.compile (aot_eager) traces it with the hybridep ops inside its graphs, equal to eager;
- a larger token count reuses the group's buffer (HybridEP grows it itself);
- a training step of the tiny model under DDP in fp32 (EP 4 and EP 2) equals the alltoall dispatcher's;
- a group of one is refused.
Index logic and the gate's words are checked without processes.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks, write_max_over_ranks
from moevlm.kernels.grouped_gemm import grouped_mm_loop

# the same scenarios and measure as deepep's
from test_deepep import REL, D, E, K, _model_step, _rel, _scenario
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from moevlm.dispatch import DISPATCHERS, build_dispatcher
from moevlm.dispatch.handles import HANDLES
from moevlm.dispatch.hybridep import HybridEPDispatcher, dropped_rows, fit_counts, permuted_budget
from moevlm.parallel.recompute import save_communication

EMULATOR = Path(__file__).parent / "hybrid_ep_emulator"


# ------------------------------------------------------------ no processes
def test_index_logic_by_hand():
    # 3 local experts with 3, 4, 2 rows; a budget of 6: 3 + 3 kept, the rest of the GEMM rows go nowhere
    assert fit_counts(torch.tensor([3, 4, 2]), 6).tolist() == [3, 3, 0]
    assert fit_counts(torch.tensor([1, 1, 1]), 6).tolist() == [
        1,
        1,
        4,
    ]  # 3 unused rows: the last expert's
    assert fit_counts(torch.tensor([5]), 3).tolist() == [3]
    assert dropped_rows(torch.tensor([3, 4, 2]), 6).item() == 3  # rows 6..8
    # padded to 4: blocks at 0, 4, 8; expert 1's rows 4..7 lose 6, 7, expert 2's rows 8, 9 both
    assert dropped_rows(torch.tensor([3, 4, 2]), 6, pad_multiple=4).item() == 4
    assert dropped_rows(torch.tensor([1, 1]), 8, pad_multiple=4).item() == 0
    # E*C rows (C = ceil(1.0 * 10 * 2 / 8) = 3), then 2 experts x 3 padding rows, to a multiple of 4
    assert (
        permuted_budget(1.0, 10, 2, 8, 2) == 24
        and permuted_budget(1.0, 10, 2, 8, 2, pad_multiple=4) == 32
    )


def test_registered_and_importable_without_deep_ep(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "deep_ep" else real(n, *a)
    )
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    assert DISPATCHERS["hybridep"] is HybridEPDispatcher and "deep_ep" not in sys.modules
    reason = HybridEPDispatcher.unavailable_reason(num_experts=E, top_k=K)
    assert reason.startswith(
        "the deep_ep package is not installed (HybridEP is DeepEP's hybrid-ep branch"
    )
    with pytest.raises(
        RuntimeError, match="dispatcher 'hybridep' cannot run: the deep_ep package is not installed"
    ):
        build_dispatcher("hybridep", num_experts=E, top_k=K)


# ------------------------------------------------------------ 4 ranks, one launch
def _moe(d, x, idx, w, W):
    ex, counts, h = d.dispatch(x, idx, w)
    return d.combine(grouped_mm_loop(torch.tanh(ex), W, counts), h), counts


def _recomputed_moe(d, x, idx, w, W):
    """The same under selective recompute with moevlm's policy (the hybridep ops' outputs saved)."""
    context = functools.partial(create_selective_checkpoint_contexts, save_communication)
    return checkpoint(_moe, d, x, idx, w, W, use_reentrant=False, context_fn=context)


def _run(d, x0, idx, w0, W0, g, recompute=False, keep=None):
    """y and the gradients w.r.t. x, router weights, expert weights; `keep`: router weights of the other
    choices multiplied by 0 (the reference for dropped choices)."""
    x, w, W = (t.clone().requires_grad_() for t in (x0, w0, W0))
    y, counts = (_recomputed_moe if recompute else _moe)(
        d, x, idx, w if keep is None else w * keep, W
    )
    (y * g).sum().backward()
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (x, w, W)]
    return [y.detach(), *grads], counts


def _compare(where, got, want, worst, prefix=""):
    for label, a, b in zip(("y", "dx", "dw", "dW"), got, want):
        err = _rel(a, b)
        worst[prefix + label] = max(worst.get(prefix + label, 0.0), err)
        assert err <= REL, f"{where}: {prefix}{label} relative error {err:.2e}"


def _count_layout_dispatches(buffer) -> list[int]:
    """Counts this buffer's dispatches with a fresh layout (not the cached ones of combine's backward)."""
    calls, real = [0], buffer.dispatch_with_permute

    def counted(**kw):
        calls[0] += kw.get("handle") is None
        return real(**kw)

    buffer.dispatch_with_permute = counted
    return calls


def _dropless(name, group, W_EDD, worst):
    from moevlm.dispatch.hybridep import _BUFFERS

    P, r = dist.get_world_size(group), dist.get_rank(group)
    L = E // P
    x0, idx, w0, g = _scenario(name, dist.get_rank(), r, L)
    W0 = W_EDD[r * L : (r + 1) * L]
    where = f"{name} EP={P} rank {dist.get_rank()}"
    ref = build_dispatcher("alltoall", num_experts=E, top_k=K, ep_group=group)
    want, counts_ref = _run(ref, x0, idx, w0, W0, g)
    hyb = build_dispatcher("hybridep", num_experts=E, top_k=K, ep_group=group)
    got, counts = _run(hyb, x0, idx, w0, W0, g)
    assert counts.tolist() == counts_ref.tolist(), where
    if name == "idle":  # rank 0 gets nothing, the last expert nothing
        assert counts.sum() == 0 or r != 0, where
        assert counts[-1] == 0 or r != P - 1, where
    _compare(where, got, want, worst)
    hyb.pad_multiple = 4  # FP8's padding: HybridEP pads every expert's block with zero rows
    padded, counts = _run(hyb, x0, idx, w0, W0, g)
    assert counts.tolist() == [-(-c // 4) * 4 for c in counts_ref.tolist()], where
    _compare(where, padded, want, worst, "pad4 ")
    hyb.pad_multiple = 1
    calls = _count_layout_dispatches(_BUFFERS[group.group_name][0])
    recomputed, _ = _run(hyb, x0, idx, w0, W0, g, recompute=True)
    # its outputs were saved
    assert calls == [1], f"{where}: recompute ran HybridEP's dispatch again ({calls})"
    _compare(where, recomputed, want, worst, "recompute ")
    with torch.no_grad():  # nothing needs backward: the handle goes at once
        ex, _, h = hyb.dispatch(x0, idx, w0)
        hyb.combine(ex, h)


def _kept_by_hand(idx, group, budget, pad):
    """Which of this rank's (token, choice) pairs HybridEP keeps, and how many rows each rank drops: every
    rank's permuted order (local expert, then group token) cut at `budget`."""
    P, r, T = dist.get_world_size(group), dist.get_rank(group), idx.shape[0]
    L = E // P
    every = [torch.empty_like(idx) for _ in range(P)]
    dist.all_gather(every, idx, group=group)
    group_idx = torch.cat(every).tolist()
    keep, dropped = torch.ones(P * T, K), [0] * P
    for q in range(P):
        position = 0
        for e in range(q * L, (q + 1) * L):
            block = [(t, row.index(e)) for t, row in enumerate(group_idx) if e in row]
            for i, (t, k) in enumerate(block):
                if position + i >= budget:
                    keep[t, k], dropped[q] = 0.0, dropped[q] + 1
            position += -(-len(block) // pad) * pad
    return keep[r * T : (r + 1) * T], dropped


def _capacity(name, group, W_EDD, worst):
    from moevlm.dispatch.capacity import OverflowCounter

    P, r = dist.get_world_size(group), dist.get_rank(group)
    L = E // P
    x0, idx, w0, g = _scenario(name, dist.get_rank(), r, L, equal_tokens=True)
    W0, T = W_EDD[r * L : (r + 1) * L], x0.shape[0]
    where = f"capacity {name} EP={P} rank {dist.get_rank()}"
    ref = build_dispatcher("alltoall", num_experts=E, top_k=K, ep_group=group)
    want, _ = _run(ref, x0, idx, w0, W0, g)
    roomy = build_dispatcher(
        "hybridep", num_experts=E, top_k=K, ep_group=group, capacity_factor=E / K
    )
    got, counts = _run(roomy, x0, idx, w0, W0, g)  # C = T: nothing can overflow
    # the budget's unused tail went to the last expert as zero rows: nothing unwritten reached its weights
    assert got[3].isfinite().all(), where
    _compare(where, got, want, worst, "roomy ")
    assert counts.sum() == permuted_budget(E / K, T, K, E, L), where  # the GEMM sees all M rows
    assert roomy.dropped.item() == 0 and roomy.flagged.item() == 0 and roomy.routed == T * K, where
    for pad in (1, 4):
        tight = build_dispatcher(
            "hybridep", num_experts=E, top_k=K, ep_group=group, capacity_factor=0.5
        )
        tight.pad_multiple = pad
        budget = permuted_budget(0.5, T, K, E, L, pad)
        keep, dropped = _kept_by_hand(idx, group, budget, pad)
        got, _ = _run(tight, x0, idx, w0, W0, g)
        want, _ = _run(ref, x0, idx, w0, W0, g, keep=keep)
        assert got[3].isfinite().all(), where
        _compare(f"{where} pad {pad}", got, want, worst, f"overflow pad{pad} ")
        assert tight.dropped.item() == dropped[r], (
            f"{where} pad {pad}: {tight.dropped.item()} != {dropped[r]}"
        )
        # (padding alone can overflow)
        assert tight.flagged.item() == (dropped[r] > 0) or pad > 1, where
        if name == "idle" and pad == 1:
            # rank 0 receives nothing, drops nothing
            assert sum(dropped) > 0 and dropped[0] == 0, where

        class Layer(torch.nn.Module):
            dispatcher = tight

        counter = OverflowCounter(torch.nn.Sequential(Layer()), [group], 0.5, "drop")
        rec = counter.record(torch.device("cpu"))
        assert rec["moe_dropped_tokens"] == sum(dropped) and rec["moe_dropped_fraction"] == sum(
            dropped
        ) / (P * T * K)
        assert rec["moe_overflowed_dispatches"] >= (sum(dropped) > 0)


def _grows_itself(rank):
    """A token count past the buffer's first size reuses it: HybridEP grows its own buffer."""
    from deep_ep import BUILT

    d = build_dispatcher("hybridep", num_experts=E, top_k=K)
    x0, idx, w0, _ = _scenario("random", rank, rank, E // 4, equal_tokens=True)
    with torch.no_grad():
        ex, _, h = d.dispatch(x0, idx, w0)
        d.combine(ex, h)
        built = BUILT[0]
        ex, _, h = d.dispatch(*(torch.cat([t] * 20) for t in (x0, idx, w0)))
        d.combine(ex, h)
    assert BUILT[0] == built, "a larger token count built a new HybridEP buffer"


def _meta_no_host_reads(group):
    """The capacity path on the meta device (fakes stand for HybridEP) with every host read refused."""
    from test_capacity import no_host_reads

    d = build_dispatcher("hybridep", num_experts=E, top_k=K, ep_group=group, capacity_factor=0.5)
    T = 6
    x = torch.empty(T, D, device="meta", requires_grad=True)
    idx, w = (
        torch.empty(T, K, dtype=torch.long, device="meta"),
        torch.empty(T, K, device="meta", requires_grad=True),
    )
    with no_host_reads():
        ex, counts, h = d.dispatch(x, idx, w)
        y = d.combine(ex * 2, h)
        y.sum().backward()
    P = dist.get_world_size(group)
    assert ex.shape == (permuted_budget(0.5, T, K, E, E // P), D) and y.shape == (T, D)
    assert x.grad.shape == (T, D) and w.grad.shape == (T, K) and counts.shape == (E // P,)


def _compiled_capacity(group, W_EDD, worst):
    """torch.compile (aot_eager: dynamo, the fakes, AOT autograd) traces the capacity path with the hybridep
    ops inside its graphs (no graph break at them) and gives eager's outputs and gradients."""
    from torch._dynamo.utils import counters

    P, r = dist.get_world_size(group), dist.get_rank(group)
    L = E // P
    x0, idx, w0, g = _scenario("random", dist.get_rank(), r, L, equal_tokens=True)
    W0 = W_EDD[r * L : (r + 1) * L]
    d = build_dispatcher("hybridep", num_experts=E, top_k=K, ep_group=group, capacity_factor=1.0)
    want, _ = _run(d, x0, idx, w0, W0, g)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_moe, backend="aot_eager")
    x, w, W = (t.clone().requires_grad_() for t in (x0, w0, W0))
    y, _ = compiled(d, x, idx, w, W)
    (y * g).sum().backward()
    breaks = " ".join(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] > 0 and "moevlm_hybridep" not in breaks, breaks
    _compare(
        f"compiled EP={P} rank {dist.get_rank()}",
        [y.detach(), x.grad, w.grad, W.grad],
        want,
        worst,
        "compiled ",
    )
    torch._dynamo.reset()


def _four_ranks(rank, emulator, out):
    sys.path.insert(0, emulator)
    import deep_ep

    assert deep_ep.EMULATOR
    W_EDD = torch.randn(E, D, D, generator=torch.Generator().manual_seed(7)) / D**0.5
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    solo = [dist.new_group([p]) for p in range(4)]
    worst = {}
    for group in (dist.group.WORLD, pairs[rank // 2]):
        for name in ("random", "idle", "silent"):
            _dropless(name, group, W_EDD, worst)
        for name in ("random", "idle"):
            _capacity(name, group, W_EDD, worst)
    _grows_itself(rank)
    for ep in (4, 2):
        worst[f"model step ep{ep} grads"] = _model_step(rank, "hybridep", ep)
    _meta_no_host_reads(pairs[rank // 2])
    _compiled_capacity(pairs[rank // 2], W_EDD, worst)
    gc.collect()
    assert not HANDLES, f"handles left: {sorted(HANDLES)}"
    with pytest.raises(
        RuntimeError, match="HybridEP needs an expert-parallel group of at least 2 ranks"
    ):
        build_dispatcher("hybridep", num_experts=E, top_k=K, ep_group=solo[rank])
    write_max_over_ranks(worst, out)


@pytest.mark.slow
def test_hybridep_equals_alltoall_on_4_and_2_ranks(tmp_path):
    out = tmp_path / "errors.json"
    run_ranks(_four_ranks, 4, tmp_path, str(EMULATOR), str(out))
    errors = json.loads(out.read_text())
    print("hybridep vs alltoall, max relative error over ranks and scenarios:", errors)
    assert max(errors.values()) <= REL
