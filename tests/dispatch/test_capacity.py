"""The capacity all-to-all (moevlm.dispatch.capacity): its index logic by hand; no host sync on its
dispatch/combine path (meta device, and patched host reads on 2 gloo ranks, where the dropless path
does read); one 2-rank launch checking, against the unsharded `local` reference and the dropless
all-to-all, that a capacity nothing overflows changes nothing (outputs and gradients w.r.t. x, router
weights and expert weights; an idle expert, a rank that receives nothing and a rank whose tokens all go
elsewhere), and that a small capacity drops exactly the (token, choice) pairs counted by hand; with a
shared expert (Qwen3.5's), in one process and on the 2 ranks, the MoE block adds the gated shared
expert to every token, dropped ones included (a token whose choices are all dropped gets exactly it),
against the block with `local` dispatch and the dropped choices' weights zeroed; the trainer's
metrics.jsonl and its config errors."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from moevlm.kernels.grouped_gemm import grouped_mm_loop

from moevlm.config import compose_job, validate
from moevlm.dispatch import LocalDispatcher, build_dispatcher
from moevlm.dispatch.alltoall import AllToAllDispatcher
from moevlm.dispatch.capacity import (
    CapacityOverflowError,
    capacity_slots,
    expert_capacity,
    slot_sources,
)
from moevlm.errors import ConfigError
from moevlm.model.config import MoEConfig
from moevlm.model.moe import MoEBlock
from moevlm.model.strategies import Strategies

E, K, D, T = 8, 2, 6, 6

# ------------------------------------------------------- index logic, by hand


def test_capacity_and_slots_by_hand():
    # ceil(1.5), ceil(0.75)
    assert expert_capacity(1.0, 6, 2, 8) == 2 and expert_capacity(0.5, 6, 2, 8) == 1
    assert expert_capacity(4.0, 6, 2, 8) == 6 and expert_capacity(1.0, 0, 2, 8) == 0
    # Rows sorted by expert, E=3, C=2: expert 0 has 3 rows (the third dropped), expert 1 none, expert 2 two.
    slot, keep = capacity_slots(torch.tensor([3, 0, 2]), num_rows=5, capacity=2)
    assert slot.tolist() == [0, 1, 6, 4, 5] and keep.tolist() == [True, True, False, True, True]
    src = slot_sources(slot, torch.tensor([0, 2, 3, 1, 3]), num_slots=6, num_tokens=4)
    assert src.tolist() == [0, 2, 4, 4, 1, 3]  # slots 2, 3 (expert 1) empty: the zero row (token 4)


# ------------------------------------------------------- no host sync


class HostRead(AssertionError):
    pass


@contextmanager
def no_host_reads():
    """Every Python-level way to read a tensor on the host raises (CPU has no sync-debug mode)."""
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(name):
        def f(self, *args, **kwargs):
            raise HostRead(f"host read: Tensor.{name}")

        return f

    try:
        for n in names:
            setattr(torch.Tensor, n, refuse(n))
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def test_capacity_path_runs_on_meta_without_data_dependent_shapes():
    """On the meta device any value read or data-dependent shape (nonzero, repeat_interleave without its
    size, boolean masks) raises: dispatch and combine of the capacity mode need none."""
    d = AllToAllDispatcher(E, K, capacity_factor=0.5)
    x = torch.empty(T, D, device="meta", requires_grad=True)
    idx, w = torch.empty(T, K, dtype=torch.long, device="meta"), torch.empty(T, K, device="meta")
    with no_host_reads():
        ex, counts, h = d.dispatch(x, idx, w)
        y = d.combine(ex * 2, h)
        y.sum().backward()
    assert (
        ex.shape == (E * expert_capacity(0.5, T, K, E), D)
        and y.shape == (T, D)
        and x.grad.shape == (T, D)
    )


# ------------------------------------------------------- the shared expert beside dropped tokens

FS, F_EXPERT, T_SHARED = 5, 4, 12  # shared expert hidden, expert hidden, tokens per rank


def _shared_expert_case(rank: int, ep: int) -> dict[str, float]:
    """The capacity block (factor 0.5: 2 slots per expert for 24 choices; this rank's E/ep experts)
    against the `local` block holding every expert with the dropped choices' weights zeroed; both with
    one seeded set of weights and the gated shared expert.  Returns the relative errors."""
    cfg = MoEConfig(E, K, F_EXPERT, grouped_gemm="loop", shared_expert_intermediate_size=FS)
    torch.manual_seed(5)
    ref = MoEBlock(D, cfg)
    with torch.no_grad():  # (experts are created empty: the model's init fills them)
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape) / D**0.5)
    dispatch = AllToAllDispatcher(E, K, capacity_factor=0.5)
    block = MoEBlock(D, cfg, strategies=Strategies(dispatcher=lambda i, c: dispatch))
    L = E // ep
    block.load_state_dict(ref.state_dict())
    for name in ("gate_up_proj", "down_proj"):  # this rank's experts
        mine = getattr(ref.experts, name).detach()[rank * L : (rank + 1) * L]
        setattr(block.experts, name, torch.nn.Parameter(mine.clone()))
    gen = torch.Generator().manual_seed(50 + rank)
    x0, g = torch.randn(1, T_SHARED, D, generator=gen), torch.randn(1, T_SHARED, D, generator=gen)
    idx = ref.router(x0[0])[0]
    keep = _dropped_by_hand(idx, expert_capacity(0.5, T_SHARED, K, E))
    gone = ~keep.any(1)  # tokens whose choices are all dropped
    assert gone.any() and not gone.all(), keep

    def masked_local(x):
        x_TD = x.reshape(-1, D)
        _, w, *_ = ref.router(x_TD)
        y = ref.runner(x_TD, idx, w * keep, ref.dispatcher, ref.experts).view_as(x)
        return y + torch.sigmoid(ref.shared_expert_gate(x)) * ref.shared_expert(x), None

    got, want = (_block_run(b, x0, g) for b in (block, masked_local))
    assert dispatch.dropped.item() == (~keep).sum().item()
    shared = torch.sigmoid(ref.shared_expert_gate(x0)) * ref.shared_expert(x0)
    errors = {
        "y": _rel(got["y"], want["y"]),
        "y of all-dropped tokens - shared": _rel(got["y"][0, gone], shared[0, gone].detach()),
        "grad x": _rel(got["x"], want["x"]),
    }
    assert shared[0, gone].abs().min() > 0
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for n, p in block.named_parameters():
        want_g = grads[n]
        if ".experts." in f".{n}":  # the reference's experts saw every rank's tokens
            if ep > 1:
                dist.all_reduce(want_g)
            want_g = want_g[rank * L : (rank + 1) * L]
        errors[f"grad {n}"] = _rel(p.grad, want_g)
    assert "grad shared_expert.down_proj.weight" in errors
    bad = {k: v for k, v in errors.items() if not v <= 1e-6}
    assert not bad, bad
    return {f"shared expert ep{ep} {k}": v for k, v in errors.items()}


def _block_run(block, x0, g) -> dict:
    x = x0.clone().requires_grad_()
    y = block(x)[0]
    (y * g).sum().backward()
    return {"y": y.detach(), "x": x.grad}


def test_shared_expert_reaches_every_token_dropped_ones_included():
    _shared_expert_case(0, 1)  # asserts each error <= 1e-6


# ------------------------------------------------------- 2 ranks, one launch


def _scenario(name, rank, L):
    gen = torch.Generator().manual_seed(1000 * len(name) + rank)
    allowed = list(range(E))
    # rank 0's experts and the last expert receive nothing: every rank sends all to rank 1
    if name == "idle":
        allowed = list(range(L, E - 1))
    idx = torch.stack(
        [torch.tensor(allowed)[torch.randperm(len(allowed), generator=gen)[:K]] for _ in range(T)]
    )
    w = torch.rand(T, K, generator=gen) + 0.1
    return (
        torch.randn(T, D, generator=gen),
        idx,
        w / w.sum(1, keepdim=True),
        torch.randn(T, D, generator=gen),
    )


def _run(d, x0, idx, w0, W0, g):
    x, w, W = (t.clone().requires_grad_() for t in (x0, w0, W0))
    ex, counts, h = d.dispatch(x, idx, w)
    y = d.combine(grouped_mm_loop(ex, W, counts), h)
    (y * g).sum().backward()
    return [y.detach()] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in (x, w, W)]


def _reference(x0, idx, w0, W_EDD, g, mine):
    """Unsharded local: every rank's own tokens through all experts, expert gradients summed over ranks."""
    y, gx, gw, gW = _run(LocalDispatcher(E, K), x0, idx, w0, W_EDD, g)
    dist.all_reduce(gW)
    return [y, gx, gw, gW[mine]]


def _dropped_by_hand(idx, C):
    """(token, choice) pairs over capacity, walking tokens in order with one counter per expert."""
    seen, keep = [0] * E, torch.ones(idx.shape, dtype=torch.bool)
    for t, row in enumerate(idx.tolist()):
        for k, e in enumerate(row):
            keep[t, k] = seen[e] < C
            seen[e] += 1
    return keep


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _two_rank_checks(rank, out_dir):
    L = E // dist.get_world_size()
    mine = slice(rank * L, (rank + 1) * L)
    W_EDD = torch.randn(E, D, D, generator=torch.Generator().manual_seed(7)) / D**0.5
    errors, names = {}, ("x_out", "grad_x", "grad_router_w", "grad_expert_w")
    for name in ("random", "idle"):
        x0, idx, w0, g = _scenario(name, rank, L)
        ref = _reference(x0, idx, w0, W_EDD, g, mine)
        dropless = _run(
            build_dispatcher("alltoall", num_experts=E, top_k=K), x0, idx, w0, W_EDD[mine], g
        )
        # 1. capacity E/K (C = T: nothing can overflow) equals dropless
        big = AllToAllDispatcher(E, K, capacity_factor=E / K)
        got = _run(big, x0, idx, w0, W_EDD[mine], g)
        for what, a, b, c in zip(names, got, ref, dropless):
            errors[f"{name} no-overflow vs local {what}"] = _rel(a, b)
            errors[f"{name} no-overflow vs dropless {what}"] = _rel(a, c)
            assert _rel(a, b) <= 1e-6 and _rel(a, c) <= 1e-6, (name, what, _rel(a, b), _rel(a, c))
        assert big.dropped.item() == 0 and big.routed == T * K
        # 2. factor 0.5 (C = 1): the dropped count and output are the hand-counted drops
        small = AllToAllDispatcher(E, K, capacity_factor=0.5)
        C = expert_capacity(0.5, T, K, E)
        keep = _dropped_by_hand(idx, C)
        got = _run(small, x0, idx, w0, W_EDD[mine], g)
        ref = _reference(x0, idx, w0 * keep, W_EDD, g, mine)
        ref[2] = ref[2] * keep  # (the masked reference's w gradient: d/dw of w*keep)
        assert small.dropped.item() == (~keep).sum().item() > 0, name
        for what, a, b in zip(names, got, ref):
            errors[f"{name} overflow vs masked local {what}"] = _rel(a, b)
            assert _rel(a, b) <= 1e-6, (name, what, _rel(a, b))
    # 3. no host read on the capacity path (forward and backward), where the dropless path reads its splits
    x0, idx, w0, g = _scenario("random", rank, L)
    d, x = AllToAllDispatcher(E, K, capacity_factor=1.0), x0.clone().requires_grad_()
    with no_host_reads():
        ex, counts, h = d.dispatch(x, idx, w0)
    ey = grouped_mm_loop(ex, W_EDD[mine], counts)  # (the reference expert loop reads its counts)
    with no_host_reads():
        (d.combine(ey, h) * g).sum().backward()  # the backward: the same exchanges reversed
        with pytest.raises(HostRead, match="tolist"):
            build_dispatcher("alltoall", num_experts=E, top_k=K).dispatch(x0, idx, w0)
    assert x.grad is not None
    # 4. the MoE block with the shared expert over ep 2 (capacity 0.5)
    errors |= _shared_expert_case(rank, dist.get_world_size())
    Path(out_dir, f"errors_rank{rank}.json").write_text(json.dumps(errors))


@pytest.mark.slow
def test_two_ranks_capacity_matches_dropless_and_drops_exactly(tmp_path):
    run_ranks(_two_rank_checks, 2, tmp_path, str(tmp_path))
    worst = {}
    for r in range(2):
        for k, v in json.loads((tmp_path / f"errors_rank{r}.json").read_text()).items():
            worst[k] = max(worst.get(k, 0.0), v)
    print("\n".join(f"{k}: {v:.2e}" for k, v in sorted(worst.items())))


# ------------------------------------------------------- trainer and config

FAST = [
    "data.num_workers=1",
    "data.streams=1",
    "train.tensorboard=false",
    "train.checkpoint_at_end=false",
    "model.dispatcher=alltoall",
]


@pytest.mark.slow
def test_trainer_logs_dropped_tokens_and_error_mode_fails(tmp_path):
    from moevlm.train.trainer import Trainer

    job = compose_job(
        FAST
        + ["train.steps=2", f"train.run_dir={tmp_path / 'drop'}", "model.moe_capacity_factor=0.5"]
    )
    tr = Trainer(job)
    assert tr.run() == 0
    recs = [
        json.loads(line) for line in (tmp_path / "drop" / "metrics.jsonl").read_text().splitlines()
    ]
    layers = sum(tr.plan.model.moe.is_moe_layer(i) for i in range(tr.plan.model.text.num_layers))
    # per step (padding routed too)
    tokens = tr.plan.grad_accum * job.train.micro_batch_size * job.data.pack.seq_len
    routed = tokens * tr.plan.model.moe.top_k * layers
    assert [r["step"] for r in recs] == [1, 2]
    for rec in recs:
        assert rec["steps_in_window"] == 1
        assert isinstance(rec["moe_dropped_tokens"], int) and 0 < rec["moe_dropped_tokens"] < routed
        assert rec["moe_dropped_fraction"] == pytest.approx(rec["moe_dropped_tokens"] / routed)
        # the dispatches that dropped
        assert 0 < rec["moe_overflowed_dispatches"] <= layers * tr.plan.grad_accum

    job = compose_job(
        FAST
        + [
            "train.steps=2",
            f"train.run_dir={tmp_path / 'error'}",
            "model.moe_capacity_factor=0.5",
            "model.moe_capacity_overflow=error",
        ]
    )
    with pytest.raises(CapacityOverflowError, match="step 1: .* raise model.moe_capacity_factor"):
        Trainer(job).run()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_bad_capacity_factors_are_refused(value):
    with pytest.raises(
        ConfigError, match=f"model.moe_capacity_factor={value}.* must be a finite number > 0"
    ):
        validate(
            compose_job([f"model.moe_capacity_factor={value}", "model.dispatcher=alltoall"]), 1
        )


def test_capacity_needs_alltoall_without_etp():
    with pytest.raises(
        ConfigError,
        match="mode of the alltoall and hybridep dispatchers but the dispatcher is 'local'",
    ):
        validate(compose_job(["model.moe_capacity_factor=1.25"]), 1)  # auto at ep 1: local
    with pytest.raises(ConfigError, match="moe_capacity_overflow='never'"):
        validate(
            compose_job(["model.moe_capacity_factor=1.25", "model.moe_capacity_overflow=never"]), 1
        )
    with pytest.raises(ConfigError, match="not built with parallel.etp=2"):
        validate(
            compose_job(["model.moe_capacity_factor=1.25", "parallel.tp=2", "parallel.etp=2"]), 2
        )
    plan = validate(
        compose_job(
            ["model.moe_capacity_factor=1.25", "parallel.ep=2", "train.global_batch_size=2"]
        ),
        2,
    )
    assert plan.dispatcher.name == "alltoall" and plan.model.moe.capacity_factor == 1.25
    assert not math.isnan(plan.model.moe.capacity_factor)
