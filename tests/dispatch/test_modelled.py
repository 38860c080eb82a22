"""The `deepep` and `hybridep` dispatchers as a plan models them (moevlm/dispatch/modelled.py), without
the deep_ep package: the documented buffer sizes worked by hand; planning the DeepEP and HybridEP
recipes with no deep_ep importable (not even the test emulators) gives a plan whose peak holds those
buffers and whose EP group carries the exchanges; a real run without the package is still refused with
the package's name; and on 2 gloo ranks the model's outputs and gradients equal the alltoall
dispatcher's to bf16's precision (its rows cross in bf16, as the packages' do)."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import result, run_forked, run_ranks, selected

from moevlm.dispatch import DispatcherSpec, ModelledBuffers, ModelledDeepEP, ModelledHybridEP
from moevlm.dispatch.modelled import deepep_v1_bytes, deepep_v2_bytes, hybridep_bytes

REL = 3e-2  # bf16 rows against fp32 alltoall
MIB = 2**20


# ------------------------------------------------------------ the documented sizes, by hand
def test_deepep_v2_buffer_by_hand():
    # one NVLink domain of 16, C 8192, hidden 2048, top-8: a dispatch slot is 4096 bytes of row +
    # 8 x (4 + 4) + (1 + 8) x 4 = 100 -> 128 bytes of metadata; dispatch 16 x 8192 slots of 4224 bytes
    # outgrows combine's 8 x 8192 of 4096 + 64; 553,648,128 bytes is 264 x 2 MiB already
    assert deepep_v2_bytes(16, 8192, 2048, 8, domain=16) == 16 * 8192 * 4224 == 528 * MIB
    # two domains of 8 (H100 nodes): dispatch stages 8 x 2 x C + C + 2 x (C + 1280) slots of 4224 bytes,
    # combine min(8, 8) x 2 x C + 2 x (C + 1280) + min(2, 8) x C slots of 4160: combine's is larger
    dispatch = (16 * 8192 + 8192 + 2 * (8192 + 1280)) * 4224
    combine = (8 * 2 * 8192 + 2 * (8192 + 1280) + 2 * 8192) * 4160
    assert combine > dispatch
    assert deepep_v2_bytes(16, 8192, 2048, 8, domain=8) == -(-combine // (2 * MIB)) * 2 * MIB


def test_deepep_v1_and_hybridep_buffers_by_hand():
    # V1, 8 ranks in a node, 10 channels (20 SMs): 8 peers x 256 tokens x (4096 + 8 + 128 x 16) bytes
    # + 8 x 5 ints of each channel, 128-aligned; no RDMA part within a node
    nvl = 10 * 8 * (5 * 4 + 256 * 6152)
    assert deepep_v1_bytes(8, 2048) == -(-nvl // 128) * 128
    assert deepep_v1_bytes(16, 2048) > deepep_v1_bytes(8, 2048)  # across nodes: an RDMA buffer too
    # HybridEP, 16 ranks of 8192 tokens, hidden 2048, 8 experts each, one domain of 16
    N = 16 * 8192
    assert hybridep_bytes(16, 8192, 2048, 8, 16) == N * 2048 * 2 + N * 8 * 16 * 4 + N * 16 * 4


# ------------------------------------------------------------ plans without deep_ep
SHALLOW = ["data.shards=sample", "model.num_layers=2", "model.vision_depth=2"]


def _plan_without_deep_ep(recipe: str, gpu: str) -> dict:
    """The CLI's plan (exit status, JSON) and the buffers its dry run modelled, in a worker where
    `import deep_ep` fails (no package, no emulator)."""
    from moevlm.config import compose_job, validate
    from moevlm.dispatch import base
    from moevlm.plan.cli import main

    sys.modules["deep_ep"] = None  # neither the package nor an emulator can be imported
    pools = []
    for_plan = base.DispatcherSpec.for_plan

    def recording(self):
        spec = for_plan(self)
        pools.append(spec.plan_buffers)
        return spec

    base.DispatcherSpec.for_plan = recording
    job = compose_job([f"+experiment={recipe}", *SHALLOW])
    plan = validate(job, 16, environment=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([f"+experiment={recipe}", *SHALLOW, "--gpu", gpu, "--json"])
    assert "deep_ep" not in [m for m, v in sys.modules.items() if v is not None]
    return {
        "code": int(code),
        "plan": json.loads(out.getvalue()),
        "spec_modelled": plan.dispatcher.modelled,
        "buffers": [{k: v.numel() for k, v in p.held.items()} for p in pools if p is not None],
        "hidden": plan.model.text.hidden_size,
        "experts": plan.model.moe.num_experts,
        "top_k": plan.model.moe.top_k,
        "tokens": job.data.pack.seq_len * job.train.micro_batch_size,
    }


@pytest.fixture(scope="module")
def planned(request):
    calls = [(r, RECIPES[r]) for r in selected(request, "recipe")]
    return dict(
        zip([c[0] for c in calls], run_forked(_plan_without_deep_ep, calls, keep_errors=True))
    )


RECIPES = {"gb200_hybridep": "gb200", "h100_deepep": "h100"}


@pytest.mark.parametrize(
    "recipe", ["gb200_hybridep", pytest.param("h100_deepep", marks=pytest.mark.slow)]
)
def test_recipe_plans_without_deep_ep_with_its_buffers_modelled(planned, recipe):
    r = result(planned[recipe])
    assert r["code"] in (0, 9) and r["plan"]["fits"] == (r["code"] == 0)
    assert "modelled" in r["plan"]["dispatcher_note"] and not r["spec_modelled"]
    (rank,) = r["plan"]["ranks"]
    # the dry run's buffers (the other pools: specs made for the note, never built): one buffer for
    # the job's one EP group, shared by its layers
    ((held,),) = [list(b.values()) for b in r["buffers"] if b]
    D, E, K, T = r["hidden"], r["experts"], r["top_k"], r["tokens"]
    if recipe == "gb200_hybridep":  # domain: HybridEP's default 8 (the variable is not set here)
        assert held == hybridep_bytes(16, -(-T // 64) * 64, D, E // 16, 8)
    else:
        C = 1 << (T - 1).bit_length()
        assert held == deepep_v2_bytes(16, C, D, K, 8)
    state = rank["params_bytes"] + rank["grads_bytes"] + rank["optimizer_bytes"]
    assert rank["peak_bytes"] >= state + held
    comm = rank["comm_bytes"]
    (ep_group,) = [g for g in comm if "ep" in g.split("/")]
    # the rows of every (token, rank) pair cross in bf16, there and back, in forward and backward
    assert comm[ep_group]["all_to_all"] >= 2 * 2 * T * D * 2
    if recipe == "gb200_hybridep":  # HybridEP's routing-map all-gather
        assert comm[ep_group]["all_gather"] >= T * E


def test_a_real_run_without_deep_ep_is_refused_with_the_package(monkeypatch):
    from moevlm.config import compose_job, validate
    from moevlm.errors import ConfigError
    from moevlm.model.config import MoEConfig

    monkeypatch.setitem(sys.modules, "deep_ep", None)
    for recipe, name in (("gb200_hybridep", "hybridep"), ("h100_deepep", "deepep")):
        job = compose_job([f"+experiment={recipe}", "data.shards=sample"])
        with pytest.raises(ConfigError, match="the deep_ep package is not installed"):
            validate(job, 16)
        spec = DispatcherSpec(name)
        assert not spec.modelled and spec.for_plan().modelled
        with pytest.raises(RuntimeError, match="deep_ep package is not installed"):
            spec.build(MoEConfig(num_experts=8, top_k=2))
    assert not DispatcherSpec("alltoall").for_plan().modelled


# ------------------------------------------------------------ against alltoall on 2 ranks
def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _two_ranks(rank, out):
    from moevlm.dispatch import build_dispatcher

    E, K, D, T = 8, 2, 6, 12
    W_EDD = torch.randn(E, D, D, generator=torch.Generator().manual_seed(7)) / D**0.5
    gen = torch.Generator().manual_seed(3 + rank)
    x = torch.randn(T, D, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    idx[0] = torch.tensor([0, 1])  # a token whose choices are both on rank 0
    w = torch.rand(T, K, generator=gen).softmax(-1)
    errors = {}
    ref = build_dispatcher("alltoall", num_experts=E, top_k=K, ep_group=dist.group.WORLD)
    for cls in (ModelledDeepEP, ModelledHybridEP):
        got = []
        for d in (cls(E, K, ModelledBuffers(), ep_group=dist.group.WORLD), ref):
            xx, ww, W = x.clone().requires_grad_(), w.clone().requires_grad_(), W_EDD.clone()
            W.requires_grad_()
            rows, counts, handle = d.dispatch(xx, idx, ww)
            first = dist.get_rank() * (E // 2)
            ends = torch.cumsum(counts, 0).tolist()
            parts = [
                rows[s:e] @ W[first + j] for j, (s, e) in enumerate(zip([0, *ends[:-1]], ends))
            ]
            y = d.combine(torch.cat(parts), handle)
            (y * torch.arange(D)).sum().backward()
            got.append((y.detach(), xx.grad, ww.grad, W.grad, counts))
        (y, gx, gw, gW, c), (y0, gx0, gw0, gW0, c0) = got
        assert torch.equal(c, c0), cls.__name__
        for key, a, b in (("y", y, y0), ("dx", gx, gx0), ("dw", gw, gw0), ("dW", gW, gW0)):
            errors[f"{cls.name} {key}"] = _rel(a, b)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(errors, f)


@pytest.mark.slow
def test_the_model_equals_alltoall_on_2_ranks(tmp_path):
    out = tmp_path / "errors.json"
    run_ranks(_two_ranks, 2, tmp_path, str(out))
    errors = json.loads(out.read_text())
    print("modelled vs alltoall, relative error on rank 0:", errors)
    assert max(errors.values()) <= REL, errors
