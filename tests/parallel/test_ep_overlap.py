"""`parallel.ep_overlap=true` (moevlm/parallel/ep_overlap.py) computes what the plain ep2 alltoall computes.

One 2-rank gloo launch:
- MoE block level: the overlapped block against the plain one (same weights, same ranks), dropless
  over several seeds with odd and unequal token counts (unequal chunks; a rank with one token, whose
  second chunk is empty) and an expert no token picks; and the capacity mode with f = E/K (nothing
  can overflow): output, router statistics, gradients of x, the router and the experts; and that each
  chunk's exchange is first waited for only where it is used (after the other chunk's experts issued),
  and in backward each chunk's gradient exchange is issued before the other chunk's experts run
  backward and waited after them.
- the real Trainer, 2 steps with and without the flag, on ep2 alltoall and on tp2 x ep2 (SPMoEBlock)
  with the MoE block recomputed (overlapped run only): per-step loss, gathered gradients and final
  parameters (the test_layouts machinery); a counter checks the overlapped forward ran.
- informational: one MoE layer's forward+backward timed with and without overlap (printed).
One 4-rank launch: pp2 x ep2 through the Trainer, with and without the flag.
Errors <= 1e-6 relative (AdamW eps 1e-5: see `EPS`).  Plus the pure chunking and the config refusals
(no processes).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from test_layouts import compare, run_job

from moevlm.config import compose_job, validate
from moevlm.data.sample_cache import ensure_sample
from moevlm.dispatch.alltoall import AllToAllDispatcher
from moevlm.errors import ConfigError
from moevlm.model.moe import MoEBlock
from moevlm.model.strategies import ExpertsRunner, Strategies
from moevlm.parallel.ep_overlap import OverlappedRunner, chunk_bounds

TOL = 1e-6
E, K, D, F = 8, 2, 16, 12
IDLE = 5  # the expert no token picks


def test_chunk_bounds():
    assert chunk_bounds(7) == [(0, 4), (4, 7)]
    assert chunk_bounds(8) == [(0, 4), (4, 8)]
    assert chunk_bounds(1) == [(0, 1), (1, 1)]
    assert chunk_bounds(0) == [(0, 0), (0, 0)]


REFUSALS = {  # overrides (world 2) -> the words of the refusal
    ("parallel.tp=2",): "parallel.ep_overlap=true needs expert parallel",
    (
        "parallel.tp=2",
        "parallel.etp=2",
    ): "parallel.ep_overlap=true is not built with expert tensor parallel",
    ("parallel.ep=2", "train.compile=true"): "parallel.ep_overlap=true with train.compile=true",
    ("parallel.ep=2", "model.cuda_graph_scope=[moe_preprocess]"): "parallel.ep_overlap=true with "
    "model.cuda_graph_scope moe_preprocess",
}


@pytest.mark.parametrize("overrides", list(REFUSALS), ids=lambda o: " ".join(o))
def test_config_refuses_what_overlap_cannot_run_with(overrides):
    with pytest.raises(ConfigError) as err:
        validate(
            compose_job(["parallel.ep_overlap=true", "train.global_batch_size=2", *overrides]),
            2,
            environment=False,
        )
    assert REFUSALS[overrides] in str(err.value)


def test_config_accepts_ep2():
    plan = validate(
        compose_job(["parallel.ep_overlap=true", "parallel.ep=2", "train.global_batch_size=2"]),
        2,
        environment=False,
    )
    assert plan.dispatcher.name == "alltoall"


# ------------------------------------------------------------------ 2 ranks


def _blocks(seed: int, capacity_factor: float | None, D: int = D, F: int = F):
    """(plain, overlapped) ep2 blocks holding this rank's experts of one seeded set of weights."""
    from moevlm.model import VLMConfig

    cfg = VLMConfig.preset("tiny").moe
    cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size = E, K, F
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(E, D, generator=gen) / D**0.5
    router[IDLE, 0] = -1e3  # x[:, 0] = 1 below: expert IDLE never wins
    gate_up, down = (
        torch.randn(E, D, 2 * F, generator=gen) / D**0.5,
        torch.randn(E, F, D, generator=gen) / F**0.5,
    )
    r, L = dist.get_rank(), E // 2
    blocks = []
    for runner in (ExpertsRunner, OverlappedRunner):
        strategies = Strategies(
            dispatcher=lambda i, c: AllToAllDispatcher(E, K, capacity_factor=capacity_factor),
            experts_runner=runner,
        )
        b = MoEBlock(D, cfg, strategies=strategies)
        with torch.no_grad():
            b.router.weight.copy_(router)
            b.experts.gate_up_proj = torch.nn.Parameter(gate_up[r * L : (r + 1) * L].clone())
            b.experts.down_proj = torch.nn.Parameter(down[r * L : (r + 1) * L].clone())
        blocks.append(b)
    return blocks


def _run(block, x0, g):
    x = x0.clone().requires_grad_()
    y, stats = block(x)
    (y * g).sum().backward()
    return [
        y,
        stats.prob_sum_E,
        stats.counts_E,
        x.grad,
        block.router.weight.grad,
        block.experts.gate_up_proj.grad,
        block.experts.down_proj.grad,
    ]


def rel(a, b) -> float:
    """Relative L2 error; the max absolute one where the reference is zero (an idle expert's rows)."""
    assert a.shape == b.shape
    a, b = a.detach(), b.detach()
    if not b.any():
        return float((a - b).abs().max()) if a.numel() else 0.0
    return float((a.double() - b.double()).norm() / b.double().norm())


def _block_case(seed: int, tokens: dict[int, int], capacity_factor=None) -> float:
    plain, overlapped = _blocks(seed, capacity_factor)
    gen = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    T = tokens[dist.get_rank()]
    x0 = torch.randn(1, T, D, generator=gen)
    x0[..., 0] = 1.0
    g = torch.randn(1, T, D, generator=gen)
    want, got = _run(plain, x0, g), _run(overlapped, x0, g)
    counts = want[2].clone()
    dist.all_reduce(counts)
    assert counts[IDLE] == 0
    if capacity_factor is not None:
        assert int(plain.dispatcher.dropped) == int(overlapped.dispatcher.dropped) == 0
    names = ["y", "prob_sum", "counts", "dx", "d router", "d gate_up", "d down"]
    err = max(rel(a, b) for a, b in zip(got, want))
    assert err <= TOL, {n: rel(a, b) for n, a, b in zip(names, got, want)}
    return err


TIMED = {"T": 2048, "D": 256, "F": 256}  # the timed layer: tokens per rank, hidden, expert hidden


def _time_layer(reps: int = 5) -> dict[str, float]:
    """Seconds per forward+backward of one ep2 MoE layer (the median of `reps`), plain and overlapped."""
    out = {}
    for name, block in zip(("plain", "overlap"), _blocks(0, None, TIMED["D"], TIMED["F"])):
        x0 = torch.randn(
            1, TIMED["T"], TIMED["D"], generator=torch.Generator().manual_seed(dist.get_rank())
        )
        times = []
        for _ in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            _run(block, x0, x0)
            times.append(time.perf_counter() - t0)
        out[name] = sorted(times[1:])[reps // 2]
    return out


# AdamW's eps for both runs of every layout, added by `_trainer_runs` (test_layouts.py's remedy for
# its "forced" and "lora" entries): the overlapped run sums the experts' outputs in two chunks, so
# its gradients differ from the plain run's by float32 summation-order noise; with job_overrides'
# eps 1e-6 the clipped gradients' smallest elements sit near eps, where AdamW's update is most
# sensitive, and on an AMD EPYC tp2 x ep2's parameters came 1.4e-6 relative apart after 2 steps
# while its gradients agreed to 6.8e-7
EPS = "optim.eps=1e-5"
LAYOUTS = [  # name, the layout both runs share, what only the overlapped run adds
    ("ep2", ["parallel.ep=2", "model.dispatcher=alltoall"], []),
    # the capacity mode where nothing can overflow (f = E/K = 4): per-chunk capacity drops nothing either
    (
        "ep2_capacity",
        ["parallel.ep=2", "model.dispatcher=alltoall", "model.moe_capacity_factor=4"],
        [],
    ),
    # SPMoEBlock (router statistics summed over tp), and the block recomputed in backward
    (
        "tp2_ep2_recompute_moe",
        ["parallel.tp=2", "parallel.ep=2", "model.dispatcher=alltoall"],
        ["model.recompute=selective", "model.recompute_modules=[moe]"],
    ),
]


def _count_overlapped_chunks() -> list[int]:
    """A counter of the overlapped chunks' expert computations run in this process from now on."""
    from moevlm.parallel import ep_overlap

    calls, inner = [0], getattr(ep_overlap._grouped, "__wrapped__", ep_overlap._grouped)

    def counted(*args):
        calls[0] += 1
        return inner(*args)

    counted.__wrapped__ = inner
    ep_overlap._grouped = counted
    return calls


def _trainer_runs(shards: str, tmp: str, layouts) -> dict:
    """Each layout trained plain and overlapped on these ranks: the max relative errors, by name."""
    calls, report = _count_overlapped_chunks(), {}
    for name, layout, extra in layouts:
        layout = [*layout, EPS]
        ref = run_job(shards, os.path.join(tmp, f"plain_{name}"), layout)
        before = calls[0]
        got = run_job(
            shards,
            os.path.join(tmp, f"overlap_{name}"),
            layout + ["parallel.ep_overlap=true", *extra],
        )
        assert calls[0] > before, "the overlapped forward did not run"
        report[name] = compare(got, ref)
        assert all(v <= TOL for v in report[name].values()), (name, report[name])
    return report


def _check_waits_come_late() -> None:
    """Forward: chunk 1's dispatch and chunk 0's combine are not yet waited for when the forward first
    needs them (nothing waited on them while the other chunk's experts ran).  Backward, the mirror: chunk
    0's combine gradient is issued before chunk 1's experts run backward and waited after, chunk 1's
    dispatch gradient likewise around chunk 0's experts (the events in the engine's order)."""
    from moevlm.parallel import ep_overlap

    seen, events = [], []
    grouped, finish = ep_overlap._grouped, ep_overlap._combine_finish
    start_bwd, finish_bwd = ep_overlap._Start.backward, ep_overlap._Finish.backward

    def record(fn, what):
        def run(d, ch):
            seen.append((what, ch.exchange.work is None))  # waited already?
            out = fn(d, ch)
            if what == "dispatch":  # its gradient is ready once the chunk's experts ran backward
                out.register_hook(
                    lambda g, c=ch.exchange.what[-1]: events.append(f"experts {c} backward done")
                )
            return out

        return run

    def issued(ctx, grad):
        events.append(f"issue {ctx.ex.what}")
        out = finish_bwd(ctx, grad)
        assert ctx.ex.grad_work is not None, (
            "the reverse exchange was waited for where it was issued"
        )
        return out

    def waited(ctx, grad):
        events.append(f"wait {ctx.ex.what}")
        return start_bwd(ctx, grad)

    ep_overlap._grouped, ep_overlap._combine_finish = (
        record(grouped, "dispatch"),
        record(finish, "combine"),
    )
    ep_overlap._Start.backward, ep_overlap._Finish.backward = (
        staticmethod(waited),
        staticmethod(issued),
    )
    try:
        _block_case(7, {0: 9, 1: 8})
    finally:
        ep_overlap._grouped, ep_overlap._combine_finish = grouped, finish
        ep_overlap._Start.backward, ep_overlap._Finish.backward = (
            staticmethod(start_bwd),
            staticmethod(finish_bwd),
        )
    assert seen == [("dispatch", False)] * 2 + [("combine", False)] * 2, seen
    assert events == [
        "issue combine 1",
        "issue combine 0",
        "wait combine 1",
        "experts 1 backward done",
        "issue dispatch 1",
        "wait combine 0",
        "experts 0 backward done",
        "issue dispatch 0",
        "wait dispatch 1",
        "wait dispatch 0",
    ], events


def _two_ranks(rank: int, shards: str, tmp: str) -> None:
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    _check_waits_come_late()
    report = {"block": 0.0}
    for seed, tokens in [
        (1, {0: 7, 1: 9}),
        (2, {0: 1, 1: 6}),
        (3, {0: 11, 1: 5}),
        (4, {0: 0, 1: 3}),
    ]:
        report["block"] = max(report["block"], _block_case(seed, tokens))
    report["block_capacity"] = max(
        _block_case(seed, {0: T, 1: T}, capacity_factor=E / K) for seed, T in [(5, 7), (6, 1)]
    )
    report.update(_trainer_runs(shards, tmp, LAYOUTS))
    report["timing_s"] = _time_layer()
    if rank == 0:
        with open(os.path.join(tmp, "ep_overlap.json"), "w") as f:
            json.dump(report, f)


@pytest.mark.slow
def test_overlap_equals_plain_ep2(tmp_path):
    shards = str(ensure_sample()[0])
    run_ranks(_two_ranks, 2, tmp_path, shards, str(tmp_path), timeout_s=300)
    report = json.loads((tmp_path / "ep_overlap.json").read_text())
    print(
        f"\nep_overlap: block max rel err {report['block']:.1e} (capacity {report['block_capacity']:.1e})"
    )
    for name, _, _ in LAYOUTS:
        t = report[name]
        print(
            f"ep_overlap trainer {name}: max rel err loss {t['loss']:.1e} grads {t['grads']:.1e} "
            f"params {t['params']:.1e}"
        )
    tm = report["timing_s"]
    print(
        f"one MoE layer fwd+bwd, 2 gloo ranks x 1 thread, {TIMED}: plain {tm['plain'] * 1e3:.1f} ms, overlap "
        f"{tm['overlap'] * 1e3:.1f} ms (ratio {tm['overlap'] / tm['plain']:.2f}; informational)"
    )


def _four_ranks(rank: int, shards: str, tmp: str) -> None:
    """pp2 x ep2: the overlapped blocks inside pipeline stages (1f1b: micro-batches interleaved)."""
    os.environ.update(WORLD_SIZE="4", RANK=str(rank), LOCAL_RANK=str(rank))
    report = _trainer_runs(
        shards,
        tmp,
        [("pp2_ep2", ["parallel.pp=2", "parallel.ep=2", "model.dispatcher=alltoall"], [])],
    )
    if rank == 0:
        with open(os.path.join(tmp, "ep_overlap_pp.json"), "w") as f:
            json.dump(report, f)


@pytest.mark.slow
def test_overlap_equals_plain_pp2_ep2(tmp_path):
    run_ranks(_four_ranks, 4, tmp_path, str(ensure_sample()[0]), str(tmp_path), timeout_s=300)
    t = json.loads((tmp_path / "ep_overlap_pp.json").read_text())["pp2_ep2"]
    print(
        f"\nep_overlap trainer pp2_ep2: max rel err loss {t['loss']:.1e} grads {t['grads']:.1e} "
        f"params {t['params']:.1e}"
    )
