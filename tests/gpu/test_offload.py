"""Activation offload on one GPU (moevlm/parallel/offload.py): the copies run on the side stream while
the compute stream works, the step's peak memory falls by what left the device, and the numbers stay
those of the run without offload.  Skipped without CUDA (tests/conftest.py).

Overlap is read from CUDA events (`OffloadState.timing`): per scope call, `exit` (its forward ended,
compute stream), `d2h` (its copy to host, side stream), `need` (backward first needs its tensors,
compute stream), `h2d` (its copy back, side stream).  Always: each copy to host starts after its
scope's forward ended (it waits for the producer) and the copies start while the forward still
runs, not after it; every scope but the last is prefetched.  Where the copies are light next to the
compute (full recompute, `layer_input`): most copy-to-host time lies inside the forward, and for most
scopes the copy back starts and ends before backward needs it (hidden under the later scope's
backward).  Events order the two streams' work; no wall-clock threshold is used.

The model is the tiny preset widened so activations dominate (hidden 512, 8 layers, 2 x 2048 tokens),
fp32 with the loop grouped GEMM (torch._grouped_mm takes bf16 only on CUDA), sdpa attention.  Under
full recompute the only saved tensors are the layer inputs (8 MiB a layer here), so the peak can show
their offload only where they outweigh what backward allocates as it goes: that case runs 12 layers of
smaller experts (3.4 MB of gradients a layer against 8 MiB of input) on 4 x 1024 tokens (half
the attention's per-layer transient).  With the wide experts, gradients (12.4 MB a layer) grow faster
than the inputs are freed, the step peaks at the last layer's backward, where the offloaded inputs are
gone in both runs, and the peak cannot fall (measured on an H200: 690.0 MB off, 690.5 on).  The peak
falls by at least half of what left the device, except under full recompute: there the forward is
so light that the copies to host trail it, and about half the inputs are still on their way out when
backward starts (on an H200: 45 of 96 MiB, at 12 layers); a quarter is asked there."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.parallel.offload import Offload, apply_offload
from moevlm.parallel.recompute import SavedBytes, apply_recompute

pytestmark = pytest.mark.gpu

WIDE = dict(layers=8, moe_ffn=256, rows=2, seq=2048)
INPUTS_DOMINATE = dict(layers=12, moe_ffn=64, rows=4, seq=1024)  # full recompute's peak: see above


def _model(layers=8, moe_ffn=256, **_) -> Qwen3VLMoe:
    cfg = VLMConfig.preset("tiny")
    cfg.attn_backend = "sdpa"
    cfg.moe.grouped_gemm = "loop"
    cfg.text.hidden_size = 512
    cfg.text.num_layers = layers
    cfg.moe.moe_intermediate_size = moe_ffn
    cfg.text.intermediate_size = 1024
    torch.manual_seed(0)
    return Qwen3VLMoe(cfg).cuda()


def _batch(rows=2, seq=2048, **_):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (rows, seq), generator=g).cuda()
    return dict(input_ids=ids, labels=ids)


def _build(base, recompute, offload):
    model = copy.deepcopy(base)
    apply_recompute(model, *recompute)
    state = apply_offload(model, offload, "cuda", recompute)
    return model, state


def _step(model, batch):
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


def _peak(model, batch) -> int:
    """The step's peak above what was allocated when it started (the models, earlier tests' leftovers)."""
    _step(model, batch)  # warm-up: the caching allocator and the pinned host pool
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    _step(model, batch)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


CASES = [
    (("none", ()), ("core_attn", "moe_act", "moe", "layer_input"), WIDE, 0.5),
    (("full", ()), ("layer_input",), INPUTS_DOMINATE, 0.25),
    (("selective", ("core_attn",)), ("core_attn", "moe"), WIDE, 0.5),
]


@pytest.mark.parametrize("recompute,offload,shape,fall", CASES, ids=lambda c: str(c))
def test_offload_same_numbers_lower_peak(recompute, offload, shape, fall):
    base, batch = _model(**shape), _batch(**shape)
    ref_model, _ = _build(base, recompute, ())
    model, state = _build(base, recompute, offload)
    assert any(isinstance(m, Offload) for m in model.modules())
    ref_loss, ref_grads = _step(ref_model, batch)
    loss, grads = _step(model, batch)
    # the same kernels on the same layouts; atomics (index_add in combine) may reorder sums
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    for n, g in ref_grads.items():
        assert torch.allclose(grads[n], g, rtol=1e-5, atol=1e-7 * g.abs().max().item()), n
    # what left the device (the meter), and the peak falls by at least `fall` of it (the prefetched
    # scope and the copies in flight hold some back)
    with SavedBytes(ref_model) as off:
        ref_model(**batch).loss.backward()
    with SavedBytes(model) as on:
        model(**batch).loss.backward()
    ref_model.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    moved = off.bytes - on.bytes
    assert moved > 0.2 * off.bytes and on.offloaded_bytes > 0, (off.bytes, on.bytes)
    torch.cuda.empty_cache()
    peak_off = _peak(ref_model, batch)
    peak_on = _peak(model, batch)
    print(
        f"{recompute} {offload}: peak fell {(peak_off - peak_on) / moved:.2f} of the {moved} B moved"
    )
    assert peak_off - peak_on >= fall * moved, (peak_off, peak_on, moved, off.bytes)


def _timed(state, model, batch) -> dict:
    state.timing, state.events[:] = True, []
    model(**batch).loss.backward()
    torch.cuda.synchronize()
    state.timing = False
    origin = state.events[0][2]
    by = {}
    for kind, serial, start, end in state.events:
        by.setdefault(kind, {})[serial] = (origin.elapsed_time(start), origin.elapsed_time(end))
    model.zero_grad(set_to_none=True)
    return by


# (recompute, offload, copies light enough to hide): full recompute keeps one (B,S,D) input per layer,
# a few MiB against a layer's recompute and backward; the MoE scope's copies may outlast its compute
TIMED = [(("full", ()), ("layer_input",), True), (CASES[0][0], CASES[0][1], False)]


@pytest.mark.parametrize("recompute,offload,hidden", TIMED, ids=lambda c: str(c))
def test_copies_overlap_compute(recompute, offload, hidden):
    base, batch = _model(), _batch()
    model, state = _build(base, recompute, offload)
    _step(model, batch)  # warm-up
    ev = _timed(state, model, batch)
    calls = sorted(ev["d2h"])
    assert len(calls) >= 8, ev.keys()
    exits, d2h = ev["exit"], ev["d2h"]
    end = max(e for _, e in exits.values())  # the forward's last scope ended
    # forward: each copy waits for its scope (the producer), and they start while the forward still
    # computes, not after it
    assert all(d2h[c][0] >= exits[c][0] for c in calls)
    assert d2h[calls[0]][0] < end and sum(d2h[c][0] < end for c in calls) >= 2
    if hidden:  # most copy time lies inside the forward
        busy = sum(e - s for s, e in d2h.values())
        under = sum(max(0.0, min(e, end) - s) for s, e in d2h.values())
        assert under >= 0.5 * busy, (under, busy)
    # backward: the last scope comes back on demand; every earlier one was issued one scope ahead
    need, h2d = ev["need"], ev["h2d"]
    prefetched = [c for c in calls[:-1] if c in need and c in h2d]
    assert len(prefetched) >= len(calls) - 2, (need.keys(), h2d.keys())
    assert set(h2d) == set(calls)  # every scope copied back, once (one event pair per scope call)
    if hidden:  # started before backward needed it, and back by then (hidden under a later scope)
        ahead = [h2d[c][0] <= need[c][0] for c in prefetched]
        back = [h2d[c][1] <= need[c][0] for c in prefetched]
        assert sum(ahead) >= 0.75 * len(ahead) and sum(back) >= 0.75 * len(back), (h2d, need)
