"""The `deepep` dispatcher (moevlm/dispatch/deepep.py) against the `alltoall` dispatcher, on CPU gloo ranks.

The real DeepEP cannot run here: `deep_ep` is the TEST EMULATOR in deep_ep_emulator/ (its README says
which upstream V1 and V2 semantics it follows: bf16 rows only, the deterministic-mode assertion, V2's SM
estimate failing across nodes, the leak of an undestroyed V2 buffer), put first on sys.path.  One 4-rank
launch checks both APIs (api="v1": `Buffer`, api="v2": `ElasticBuffer`) on DeepEP groups of 4 (the world)
and of 2 (two subgroups), with fp32 rows (as without FSDP's bf16 compute): outputs and gradients w.r.t. x,
router weights and expert weights equal to alltoall's to bf16's precision (rows cross DeepEP in bf16), with
an idle expert and a rank nothing is routed to, and a rank that sends nothing; the same under selective
recompute (the deepep ops' outputs saved: DeepEP's dispatch is not run again) and under torch's
deterministic algorithms; V2 across "nodes" (LOCAL_WORLD_SIZE=2) where its SM estimate fails; a V2 buffer
outgrown is destroyed; the handle cache empties; api="auto" takes V2; a group of one is refused; and a
training step of the tiny model under DDP in fp32 (EP 4 and EP 2) equals the alltoall dispatcher's in loss
and gradients.  Index logic, the choice of API on packages with one of the two (the fakes in
fake_deep_ep/), the gate's words and the device of a missing gradient are checked without processes.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks, write_max_over_ranks
from moevlm.kernels.grouped_gemm import grouped_mm_loop
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from moevlm.dispatch import DISPATCHERS, DispatcherSpec, build_dispatcher
from moevlm.dispatch.deepep import DeepEPDispatcher, local_rows_plan, resolve_api
from moevlm.dispatch.handles import HANDLES, lookup
from moevlm.parallel.build import BuildOptions
from moevlm.parallel.recompute import save_communication

EMULATOR = Path(__file__).parent / "deep_ep_emulator"
FAKES = Path(__file__).parent / "fake_deep_ep"
E, K, D = 8, 2, 6
# rows cross DeepEP / HybridEP in bf16 (8 significant bits): the adapters against fp32 alltoall
REL = 3e-2


@pytest.fixture
def emulated_deep_ep(monkeypatch):
    monkeypatch.syspath_prepend(str(EMULATOR))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    yield
    sys.modules.pop("deep_ep", None)


# ------------------------------------------------------------ no processes
def test_local_rows_plan_by_hand():
    # 4 received rows, top-2 as local ids (L=2), -1 = not on this rank (weight 0, as DeepEP sends it)
    idx = torch.tensor([[1, -1], [0, 1], [-1, 0], [1, 0]])
    w = torch.tensor([[0.6, 0.0], [0.3, 0.7], [0.0, 0.5], [0.2, 0.8]])
    row, weight, counts = local_rows_plan(idx, w, 2, num_rows=6)
    assert row.tolist() == [1, 2, 3, 0, 1, 3]  # e0: rows 1, 2, 3; e1: rows 0, 1, 3 (row order kept)
    assert weight.tolist() == pytest.approx([0.3, 0.5, 0.8, 0.6, 0.7, 0.2])
    assert counts.tolist() == [3, 3]
    row, weight, counts = local_rows_plan(torch.full((2, 2), -1), torch.zeros(2, 2), 2, num_rows=0)
    assert row.numel() == 0 and counts.tolist() == [0, 0]


def test_registered_and_importable_without_deep_ep(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "deep_ep" else real(n, *a)
    )
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    assert DISPATCHERS["deepep"] is DeepEPDispatcher and "deep_ep" not in sys.modules
    reason = DeepEPDispatcher.unavailable_reason(num_experts=E, top_k=K)
    assert reason.startswith(
        "the deep_ep package is not installed (DeepEP is built from source against CUDA"
    )
    assert "adapter" not in reason
    with pytest.raises(
        RuntimeError, match="dispatcher 'deepep' cannot run: the deep_ep package is not installed"
    ):
        build_dispatcher("deepep", num_experts=E, top_k=K)


def test_api_v2_without_elastic_buffer_fails_clearly(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKES / "v1_only"))  # a deep_ep from before V2: Buffer alone
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    try:
        with pytest.raises(
            RuntimeError,
            match=r"^dispatcher 'deepep' cannot run: the installed deep_ep package has "
            r"no ElasticBuffer \(the deepep dispatcher's api='v2' drives it; "
            r"api='auto' takes whichever of ElasticBuffer or Buffer is there\)",
        ):
            build_dispatcher("deepep", num_experts=E, top_k=K, api="v2")
        with pytest.raises(
            RuntimeError,
            match=r"^deepep dispatcher api='v2' cannot run: the installed deep_ep "
            r"package has no ElasticBuffer",
        ):
            resolve_api("v2")  # what a dispatcher built directly meets at its first dispatch
        assert resolve_api("auto") == "v1"
        with pytest.raises(
            RuntimeError,
            match=r"cannot run: moevlm's deepep adapter takes api='auto', 'v2' or "
            r"'v1' \(api='v3'\)",
        ):
            build_dispatcher("deepep", num_experts=E, top_k=K, api="v3")
    finally:
        sys.modules.pop("deep_ep", None)


def test_auto_takes_v2_where_there(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKES / "v2_only"))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    try:
        assert resolve_api("auto") == "v2" and resolve_api("v2") == "v2"
        with pytest.raises(
            RuntimeError,
            match=r"^deepep dispatcher api='v1' cannot run: the installed deep_ep "
            r"package has no Buffer",
        ):
            resolve_api("v1")
    finally:
        sys.modules.pop("deep_ep", None)


class _Ctx:
    """Stands for autograd's context object (the CPU build cannot run backward on fake CUDA tensors)."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_missing_gradient_is_zeros_on_the_rows_device(backend, monkeypatch):
    """An output backward leaves out (here the rows: only the router weights are used) becomes zeros on the
    rows' device, not the CPU's: with fake CUDA tensors (the ops' fakes run, no GPU needed) the backward op
    must see CUDA tensors only."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from moevlm.dispatch import deepep, hybridep

    module, seen = (deepep if backend == "deepep" else hybridep), []
    real = getattr(module, f"{backend}_dispatch_backward")

    def spy(grad_x, grad_w, *args):
        seen.append((grad_x.device.type, grad_w.device.type))
        return real(grad_x, grad_w, *args)

    monkeypatch.setattr(module, f"{backend}_dispatch_backward", spy)
    with FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.empty(4, D, device="cuda", dtype=torch.bfloat16)
        if backend == "deepep":
            idx, w = (
                torch.empty(4, K, device="cuda", dtype=torch.long),
                torch.empty(4, K, device="cuda"),
            )
            layout = (
                torch.empty(2, device="cuda"),
                None,
                torch.empty(4, 2, device="cuda", dtype=torch.bool),
            )
            inputs = (x, idx, w, *layout, torch.empty(E, device="cuda"), "g")
            grads = (None, None, torch.empty(4, K, device="cuda"), None, None)
        else:
            routing = torch.empty(4, E, device="cuda", dtype=torch.bool)
            inputs = (x, routing, torch.empty(4, E, device="cuda"), "g", E // 2, 8, 1)
            grads = (None, torch.empty(8, device="cuda"), None, None, None)
        ctx = _Ctx()
        module._dispatch_setup(ctx, inputs, getattr(module, f"{backend}_dispatch")(*inputs))
        module._dispatch_grad(ctx, *grads)
    assert seen == [("cuda", "cuda")]


def test_one_rank_is_refused(emulated_deep_ep):
    assert DeepEPDispatcher.unavailable_reason(num_experts=E, top_k=K) == (
        "DeepEP needs an expert-parallel group of at least 2 ranks (parallel.ep=1); it never runs on one"
    )


# ------------------------------------------------------------ 4 ranks, one launch
def _scenario(name, rank, ep_rank, L, equal_tokens=False):
    """(x, top-k ids, weights, output gradient) of one rank: `rank` + 4 tokens (6 everywhere with
    `equal_tokens`); "idle": EP rank 0's experts and the last expert get nothing; "silent": EP rank 1 has
    no tokens.  Also test_hybridep's."""
    gen = torch.Generator().manual_seed(1000 * len(name) + rank)
    T, allowed = (6 if equal_tokens else 4 + rank), list(range(E))
    if name == "idle":  # EP rank 0 receives nothing; the last expert receives nothing
        allowed = list(range(L, E - 1))
    if name == "silent" and ep_rank == 1:  # sends nothing
        T = 0
    picks = [
        torch.tensor(allowed)[torch.randperm(len(allowed), generator=gen)[:K]] for _ in range(T)
    ]
    idx = torch.stack(picks) if picks else torch.zeros(0, K, dtype=torch.long)
    w = torch.rand(T, K, generator=gen) + 0.1
    return (
        torch.randn(T, D, generator=gen),
        idx,
        w / w.sum(1, keepdim=True),
        torch.randn(T, D, generator=gen),
    )


def _moe(d, x, idx, w, W):
    ex, counts, h = d.dispatch(x, idx, w)
    return d.combine(grouped_mm_loop(torch.tanh(ex), W, counts), h), counts, h, ex


def _recomputed_moe(d, x, idx, w, W):
    """The same under selective recompute with moevlm's policy (the deepep ops' outputs saved)."""
    context = functools.partial(create_selective_checkpoint_contexts, save_communication)
    y, counts = checkpoint(
        lambda *a: _moe(*a)[:2], d, x, idx, w, W, use_reentrant=False, context_fn=context
    )
    return y, counts, None, None


def _run(d, x0, idx, w0, W0, g, recompute=False):
    x, w, W = (t.clone().requires_grad_() for t in (x0, w0, W0))
    y, counts, h, ex = (_recomputed_moe if recompute else _moe)(d, x, idx, w, W)
    # the handle outlives its Python object while backward needs it
    if isinstance(d, DeepEPDispatcher) and not recompute:
        hid = int(h.handle_id)
        del h, ex
        gc.collect()
        assert hid in HANDLES
    (y * g).sum().backward()
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (x, w, W)]
    return [y, *grads], counts


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


def _count_layout_dispatches(buffer) -> list[int]:
    """Counts this buffer's dispatches with a fresh layout (not the cached ones of combine's backward)."""
    calls, real = [0], buffer.dispatch

    def counted(x, handle=None, **kw):
        calls[0] += handle is None
        return real(x, handle=handle, **kw)

    buffer.dispatch = counted
    return calls


def _check(api, name, group, W_EDD, worst):
    P, r = dist.get_world_size(group), dist.get_rank(group)
    L = E // P
    x0, idx, w0, g = _scenario(name, dist.get_rank(), r, L)
    W0 = W_EDD[r * L : (r + 1) * L]
    deep = build_dispatcher("deepep", num_experts=E, top_k=K, ep_group=group, api=api)
    ref = build_dispatcher("alltoall", num_experts=E, top_k=K, ep_group=group)
    got, counts = _run(deep, x0, idx, w0, W0, g)
    want, counts_ref = _run(ref, x0, idx, w0, W0, g)
    where = f"{api} {name} EP={P} rank {dist.get_rank()}"
    assert deep.resolved_api == api, where
    assert counts.tolist() == counts_ref.tolist(), where
    if name == "idle":  # rank 0 gets nothing, the last expert nothing
        assert counts.sum() == 0 or r != 0, where
        assert counts[-1] == 0 or r != P - 1, where
    calls = _count_layout_dispatches(deep.buffer)
    recomputed, _ = _run(deep, x0, idx, w0, W0, g, recompute=True)
    # its outputs were saved
    assert calls == [1], f"{where}: recompute ran DeepEP's dispatch again ({calls})"
    for label, a, b in [
        *zip((f"{api} y", f"{api} dx", f"{api} dw", f"{api} dW"), got, want),
        *zip(
            (
                f"{api} recompute y",
                f"{api} recompute dx",
                f"{api} recompute dw",
                f"{api} recompute dW",
            ),
            recomputed,
            want,
        ),
    ]:
        err = _rel(a, b)
        worst[label] = max(worst.get(label, 0.0), err)
        assert err <= REL, f"{where}: {label} relative error {err:.2e}"
    with torch.no_grad():  # nothing needs backward: the handle goes at once
        ex, _, h = deep.dispatch(x0, idx, w0)
        deep.combine(ex, h)


def _deterministic(api, group, W_EDD, worst):
    """Under torch's deterministic algorithms (DeepEP asserts unless fill_uninitialized_memory is off):
    the same result, and the flag as it was after."""
    from torch.utils import deterministic

    torch.use_deterministic_algorithms(True)
    try:
        _check(api, "random", group, W_EDD, worst)
        assert deterministic.fill_uninitialized_memory
    finally:
        torch.use_deterministic_algorithms(False)


def _v2_across_nodes_and_growth(rank):
    """V2 over two "nodes" of 2 (LOCAL_WORLD_SIZE=2): its SM estimate divides by the RDMA bandwidth it
    cannot detect here; the adapter falls back to a fixed count.  Then a token count 8x larger grows the
    buffer: the outgrown one is destroyed (an undestroyed one leaks: the emulator counts it)."""
    from deep_ep.elastic import LEAKED

    from moevlm.dispatch.deepep import FALLBACK_NUM_SMS

    x0, idx, w0, _ = _scenario("random", rank, rank, E // 4)
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        deep = build_dispatcher("deepep", num_experts=E, top_k=K, api="v2")
        with torch.no_grad():
            ex, _, h = deep.dispatch(x0, idx, w0)
            assert lookup(h.handle_id)[2]["num_sms"] == FALLBACK_NUM_SMS
            deep.combine(ex, h)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    big = [torch.cat([t] * 8) for t in (x0, idx, w0)]
    with torch.no_grad():
        ex, _, h = deep.dispatch(*big)
        deep.combine(ex, h)
    del ex, h
    gc.collect()
    assert LEAKED[0] == 0, f"{LEAKED[0]} V2 buffers collected without destroy()"


def _model_step(rank, dispatcher, ep, options=()):
    """One training step of the tiny model under DDP in fp32 (no FSDP: the residual stream stays fp32) with
    `dispatcher` against the same step with alltoall: loss and every gradient (DDP-reduced) to bf16's
    precision.  Also test_hybridep's."""
    from moevlm.model import Qwen3VLMoe, VLMConfig
    from moevlm.parallel import ParallelDims, build_model, copy_full_, full_grads, init_parameters_

    cfg = VLMConfig.preset("tiny")
    cfg.attn_backend = "sdpa"
    for key, value in options:
        setattr(cfg.moe, key, value)
    full = Qwen3VLMoe(cfg)
    init_parameters_(full, seed=3)
    ids = torch.randint(0, 900, (1, 32), generator=torch.Generator().manual_seed(11 + rank))
    results = []
    for name in (dispatcher, "alltoall"):
        model, ctx = build_model(
            cfg,
            ParallelDims(4, ep=ep),
            BuildOptions(dp_mode="ddp", dispatcher=DispatcherSpec(name)),
        )
        model.to_empty(device="cpu")
        for pname, p in model.named_parameters():
            copy_full_(p, dict(full.named_parameters())[pname].detach())
        out = model(ids, labels=ids)
        out.loss.backward()
        ctx.finish_gradients()
        results.append((out.loss.detach(), full_grads(model)))
    (loss, grads), (want_loss, want) = results
    assert abs(loss - want_loss) <= 1e-3 * abs(want_loss), (dispatcher, ep, loss, want_loss)
    errors = {k: _rel(grads[k], want[k]) for k in want}
    assert all(g.isfinite().all() for g in grads.values()), dispatcher
    assert max(errors.values()) <= REL, (dispatcher, ep, max(errors.items(), key=lambda kv: kv[1]))
    return max(errors.values())


def _four_ranks(rank, emulator, out):
    sys.path.insert(0, emulator)
    import deep_ep

    assert deep_ep.EMULATOR
    W_EDD = torch.randn(E, D, D, generator=torch.Generator().manual_seed(7)) / D**0.5
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    solo = [dist.new_group([p]) for p in range(4)]
    worst = {}
    # the emulator offers both
    assert build_dispatcher("deepep", num_experts=E, top_k=K).resolved_api == "v2"
    for api in ("v1", "v2"):
        for group in (dist.group.WORLD, pairs[rank // 2]):
            for name in ("random", "idle", "silent"):
                _check(api, name, group, W_EDD, worst)
        _deterministic(api, pairs[rank // 2], W_EDD, worst)
    _v2_across_nodes_and_growth(rank)
    for api in ("v1", "v2"):
        for ep in (4, 2):
            step = _model_step(rank, "deepep", ep, [("deepep_api", api)])
            worst[f"{api} model step ep{ep} grads"] = step
    gc.collect()
    assert not HANDLES, f"handles left: {sorted(HANDLES)}"
    with pytest.raises(
        RuntimeError, match="DeepEP needs an expert-parallel group of at least 2 ranks"
    ):
        build_dispatcher("deepep", num_experts=E, top_k=K, ep_group=solo[rank])
    write_max_over_ranks(worst, out)


@pytest.mark.slow
def test_deepep_equals_alltoall_on_4_and_2_ranks(tmp_path):
    out = tmp_path / "errors.json"
    run_ranks(_four_ranks, 4, tmp_path, str(EMULATOR), str(out))
    errors = json.loads(out.read_text())
    print("deepep vs alltoall, max relative error over ranks and scenarios:", errors)
    assert max(errors.values()) <= REL
