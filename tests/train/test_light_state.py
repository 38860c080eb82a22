"""Lighter model state against today's fp32 path: `optim.state_dtype=bfloat16` (AdamW moments in bf16,
moevlm/train/adamw.py), `optim.master_weights=true` (bf16 weights, fp32 masters in the optimizer,
moevlm/parallel/master_weights.py), `parallel.reduce_dtype=bfloat16` (gradient reductions in bf16).

- moevlm's AdamW with fp32 state is torch's foreach AdamW bit for bit; with bf16 moments every parameter
  stays within BOUND of the fp32 run;
- the master-weights step is torch's AdamW on the fp32 masters (bf16 gradients upcast), bit for bit, and
  the weights are the masters rounded to bf16;
- one process through the Trainer: each option trains within its tolerance of the fp32 (or bf16
  compute) path, and a checkpoint saved after step 1 resumes bit for bit (the masters are what is saved);
- FSDP dp2 (and DDP dp2 for the reductions) on gloo against one process, in one launch (slow);
- the settings they are not built with are one-line config errors; the bytes a parameter keeps.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from test_optimizer_offload import STEPS, overrides  # the same small job

from moevlm.config import OptimConfig, compose_job, estimate_memory, validate
from moevlm.data.sample_cache import ensure_sample
from moevlm.errors import ConfigError
from moevlm.parallel.hf_io import save_hf
from moevlm.parallel.master_weights import MasterWeightsAdamW, cast_parameters_, model_state_bytes
from moevlm.train.adamw import AdamW
from moevlm.train.optim import build_optimizer, param_groups
from moevlm.train.trainer import Trainer

STATE = "optim.state_dtype=bfloat16"
MASTER = "optim.master_weights=true"
REDUCE = "parallel.reduce_dtype=bfloat16"
BF16 = "train.precision=bf16"
LR = 1e-2
# bf16 moments: per element |p - p_fp32| <= BOUND * steps * lr.  An AdamW update is about lr in size; the
# moments rounded to bf16 (8 bits) change it by a few parts in 2^8 per step
BOUND = 2**-6
# through the Trainer (real data, clipping, several steps) an element's update can flip with a tiny change
# of its gradient, so the runs are compared per tensor by how far apart they end over how far the fp32
# run moved it
MOVED_TOL = 1e-2
# master weights vs today's one-process bf16 path (autocast over fp32 weights): the norms and routers, which
# autocast leaves in fp32, compute with bf16 weights (as under FSDP's bf16 gathers); measured 0.32
MASTER_TOL = 0.5


class _NoWindow:
    def add(self, **kw):
        pass


# ------------------------------------------------------------------ the optimizers alone
def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _grads(model: nn.Module, step: int, dtype=None) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        grad = torch.randn(p.shape, generator=g) * 10.0 ** torch.randint(-4, 1, (), generator=g)
        p.grad = grad.to(dtype or p.dtype)


def _steps(model: nn.Module, opt, n: int = STEPS, dtype=None) -> None:
    for s in range(n):
        _grads(model, s, dtype)
        opt.param_groups[0]["lr"] = LR * (s + 1) / n  # the schedule moves
        opt.step()
        opt.zero_grad(set_to_none=True)


def _cfg(**kw) -> OptimConfig:
    return OptimConfig(lr=LR, weight_decay=0.1, eps=1e-8, **kw)


def test_fp32_state_is_torch_foreach_adamw_bit_for_bit():
    ref, ours = _net(), _net()
    o = _cfg()
    torch_opt = torch.optim.AdamW(
        param_groups(ref, o), lr=LR, betas=o.betas, eps=o.eps, foreach=True
    )
    our_opt = AdamW(
        param_groups(ours, o), lr=LR, betas=o.betas, eps=o.eps, state_dtype=torch.float32
    )
    _steps(ref, torch_opt)
    _steps(ours, our_opt)
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(a, b), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch_opt.state[a][key], our_opt.state[b][key]), (name, key)


def test_bf16_moments_stay_within_the_bound_of_fp32():
    ref, light = _net(), _net()
    _steps(ref, build_optimizer(ref, _cfg()))
    opt = build_optimizer(light, _cfg(state_dtype="bfloat16"))
    assert isinstance(opt, AdamW)
    _steps(light, opt)
    worst = 0.0
    for (name, a), b in zip(ref.named_parameters(), light.parameters()):
        s = opt.state[b]
        assert s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16, name
        worst = max(worst, float((a - b).detach().abs().max()) / (STEPS * LR))
    print(f"bf16 moments: max |p - p_fp32| = {worst:.2e} x steps x lr (bound {BOUND:.2e})")
    assert 0 < worst <= BOUND


def test_master_weights_step_is_fp32_adamw_on_the_masters():
    """bf16 weights with bf16 gradients: the masters move as torch's AdamW moves fp32 weights given the
    same gradients in fp32, bit for bit, and the weights are the masters rounded to bf16."""
    model, ref = _net(), _net()
    cast_parameters_(model, torch.bfloat16)
    with torch.no_grad():  # the reference starts where the masters start: the bf16 values
        for a, b in zip(ref.parameters(), model.parameters()):
            a.copy_(b.float())
    o = _cfg(master_weights=True)
    opt = build_optimizer(model, o)
    assert isinstance(opt, MasterWeightsAdamW)
    torch_opt = torch.optim.AdamW(
        param_groups(ref, o), lr=LR, betas=o.betas, eps=o.eps, foreach=True
    )
    for s in range(STEPS):
        _grads(model, s, torch.bfloat16)
        for a, b in zip(ref.parameters(), model.parameters()):
            a.grad = b.grad.float()
        for o_ in (opt, torch_opt):
            o_.param_groups[0]["lr"] = LR * (s + 1) / STEPS
            o_.step()
            o_.zero_grad(set_to_none=True)
    masters = dict(opt.shadow.named_parameters())
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert b.dtype == torch.bfloat16 and masters[name].dtype == torch.float32
        assert torch.equal(masters[name], a), name
        assert torch.equal(b, a.to(torch.bfloat16)), name
        state = opt.state[masters[name]]
        assert state["master"] is masters[name] and state["exp_avg"].dtype == torch.float32


def test_bytes_a_parameter_keeps():
    """(trained, frozen): weight + gradient + master + two moments; the optimizers hold what it says."""
    assert model_state_bytes(False, "float32") == (16, 4)
    assert model_state_bytes(False, "bfloat16") == (12, 4)
    assert model_state_bytes(True, "float32") == (16, 2)
    assert model_state_bytes(True, "bfloat16") == (12, 2)
    for master, dtype in [
        (False, "float32"),
        (False, "bfloat16"),
        (True, "float32"),
        (True, "bfloat16"),
    ]:
        model = _net()
        if master:
            cast_parameters_(model, torch.bfloat16)
        opt = build_optimizer(model, _cfg(master_weights=master, state_dtype=dtype))
        _steps(model, opt, 1, torch.bfloat16 if master else None)
        _grads(model, 0, torch.bfloat16 if master else None)
        n = sum(p.numel() for p in model.parameters())
        held = sum(
            t.numel() * t.element_size()
            for s in opt.state.values()
            for k, t in s.items()
            if k != "step"
        )
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
        assert weights + grads + held == model_state_bytes(master, dtype)[0] * n


# ------------------------------------------------------------------ one process, the Trainer
def train(run_dir, extra=(), *, save_after=None, export=None) -> dict:
    """Per-step losses, the final weights (the masters under master weights) and optimizer state;
    `export`: a folder the final weights are written to as a Hugging Face checkpoint."""
    tr = Trainer(compose_job(overrides(run_dir, extra)))
    try:
        view = getattr(tr.opt, "checkpoint_view", None)
        module, opt = view() if view is not None else (tr.model, tr.opt)
        start = {n: p.detach().float().clone() for n, p in tr.model.named_parameters()}
        held = {n: p.detach().clone() for n, p in module.named_parameters()}  # (masters: fp32)
        step1 = None
        while tr.step < STEPS:
            assert tr.train_step(_NoWindow())
            if tr.step == 1:
                step1 = {n: p.detach().clone() for n, p in module.named_parameters()}
            if tr.step == save_after:
                tr.save(complete=True)
        names = {id(p): n for n, p in module.named_parameters()}
        if export is not None:
            save_hf(tr.model, export, ctx=tr.parallel)
        return {
            "start": start,  # the weights before the first step run here
            "held": held,  # the trained values (masters under master weights) before it
            "step1": step1,  # and after step 1 (None when resumed after it)
            "losses": list(tr.losses),
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "weights": {n: p.detach().clone() for n, p in tr.model.named_parameters()},
            "state": {
                f"{names[id(p)]}.{k}": v.detach().clone()
                for p, s in opt.state.items()
                for k, v in s.items()
                if isinstance(v, torch.Tensor)
            },
        }
    finally:
        tr.close()


def assert_same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    for key in ("params", "weights", "state"):
        assert a[key].keys() == b[key].keys(), key
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), (key, k)


def moved(got: dict, ref: dict, k: str) -> float:
    """How far `got`'s parameter k is from `ref`'s, over how far training moved `ref`'s (L2 norms)."""
    a, b, start = got["params"][k].double(), ref["params"][k].double(), ref["start"][k].double()
    return float((a - b).norm() / (b - start).norm().clamp_min(1e-30))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (run dir, result), each saved after step 1: fp32, bf16 moments."""
    out = {}
    for name, extra in {"fp32": [], "state": [STATE]}.items():
        d = tmp_path_factory.mktemp(name)
        out[name] = (d, train(d, extra, save_after=1))
    return out


def test_bf16_moments_train_within_the_bound_and_resume_exactly(runs, tmp_path):
    (_, ref), (source, light) = runs["fp32"], runs["state"]
    assert light["losses"][0] == ref["losses"][0]  # before any update
    worst = max(moved(light, ref, k) for k in ref["params"])
    print(f"bf16 moments, {STEPS} steps: |p - p_fp32| / |p_fp32 - p_0| at most {worst:.1e}")
    assert worst <= MOVED_TOL
    assert all(v.dtype == torch.bfloat16 for k, v in light["state"].items() if "exp_avg" in k)
    start = f"train.resume={source / 'checkpoints' / 'step_00000001'}"
    assert_same(train(tmp_path, [STATE, start]), light)


@pytest.mark.slow
def test_bf16_moments_across_settings_and_with_the_host_optimizer(runs, tmp_path):
    """Each of fp32 / bf16 moments resumes the other's step-1 checkpoint with its weights exactly (the
    moments cast on load); under parallel.optimizer_offload (the host AdamW over fp32 masters, here on
    the same CPU) bf16 moments train exactly what they train without it."""
    (plain_dir, plain), (state_dir, light) = runs["fp32"], runs["state"]
    ckpt = "checkpoints/step_00000001"
    got = train(tmp_path / "a", [f"train.resume={state_dir / ckpt}"])["held"]
    assert all(torch.equal(got[k], v) for k, v in light["step1"].items())
    got = train(tmp_path / "b", [STATE, f"train.resume={plain_dir / ckpt}"])["held"]
    assert all(torch.equal(got[k], v) for k, v in plain["step1"].items())
    offload = train(tmp_path / "c", [STATE, "parallel.optimizer_offload=true"])
    assert offload["losses"] == light["losses"]
    assert all(torch.equal(offload["weights"][k], v) for k, v in light["weights"].items())


@pytest.mark.slow
def test_master_weights_train_near_bf16_compute_and_resume_exactly(tmp_path):
    """bf16 compute on the CPU: today's (fp32 weights under autocast) and with master weights, the latter
    saved after step 1: it resumes bit for bit, its checkpoint holds the fp32 masters, the weights are the
    masters rounded, its losses are within 2e-2 of today's and its parameters within MASTER_TOL of how far
    today's run moved them; each setting resumes the other's checkpoint with its fp32 values exactly; the
    Hugging Face export writes the bf16 weights."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    today = train(tmp_path / "bf16", [BF16], save_after=1)
    master = train(tmp_path / "master", [BF16, MASTER], save_after=1, export=tmp_path / "hf")
    assert all(w.dtype == torch.bfloat16 for w in master["weights"].values())
    assert all(p.dtype == torch.float32 for p in master["params"].values())
    for k, p in master["params"].items():
        assert torch.equal(master["weights"][k], p.to(torch.bfloat16)), k
    assert abs(master["losses"][0] - today["losses"][0]) <= 2e-2 * abs(today["losses"][0])
    for a, b in zip(master["losses"], today["losses"]):
        assert abs(a - b) <= 2e-2 * abs(b)
    far = sorted((moved(master, today, k), k) for k in today["params"])[-3:]
    print(
        f"master weights vs bf16 compute, {STEPS} steps: |p - p_bf16| / |p_bf16 - p_0| worst {far}"
    )
    assert far[-1][0] <= MASTER_TOL
    ckpt = tmp_path / "master" / "checkpoints" / "step_00000001"
    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert all(meta[f"model.{k}"].properties.dtype == torch.float32 for k in master["params"])
    start = f"train.resume={ckpt}"
    assert_same(train(tmp_path / "again", [BF16, MASTER, start]), master)
    # the export writes the bf16 weights (the masters rounded)
    exported = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(f))
    assert exported and all(t.dtype == torch.bfloat16 for t in exported.values())
    assert torch.equal(exported["lm_head.weight"], master["weights"]["lm_head.weight"])
    # across settings: each checkpoint's fp32 values are what the other setting resumes with
    other = f"train.resume={tmp_path / 'bf16' / 'checkpoints' / 'step_00000001'}"
    masters = train(tmp_path / "from_bf16", [BF16, MASTER, other])["held"]
    weights = train(tmp_path / "from_master", [BF16, start])["held"]
    for k in today["step1"]:
        assert torch.equal(masters[k], today["step1"][k]), k
        assert torch.equal(weights[k], master["step1"][k]), k


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "settings,world,words",
    [
        (
            [MASTER, "train.precision=fp32"],
            1,
            "optim.master_weights=true makes the model's weights bf16, which needs bf16 compute",
        ),
        (
            [MASTER, "parallel.optimizer_offload=true"],
            1,
            "optim.master_weights=true with parallel.optimizer_offload=true is not built",
        ),
        (
            [MASTER, "parallel.pp=2", "parallel.dp_mode=fsdp"],
            2,
            "optim.master_weights=true with parallel.pp=2 is not built yet",
        ),
        (
            [MASTER, "optim.implementation=fused"],
            1,
            "optim.master_weights=true with optim.implementation=fused",
        ),
        (
            [STATE, "optim.implementation=fused"],
            1,
            "optim.state_dtype=bfloat16 with optim.implementation=fused",
        ),
    ],
    ids=["fp32_compute", "offload", "pipeline", "fused_master", "fused_state"],
)
def test_refusals_are_one_line_config_errors(settings, world, words):
    with pytest.raises(ConfigError) as err:
        validate(compose_job(settings), world, environment=False)
    lines = [x for x in str(err.value).splitlines() if words in x]
    assert len(lines) == 1, str(err.value)


def test_options_validate_and_reach_the_build():
    plan = validate(compose_job([MASTER, STATE, REDUCE, BF16]), 2, environment=False)
    assert plan.build.master_weights and plan.build.reduce_dtype == torch.bfloat16
    assert plan.optim.state_dtype == "bfloat16"
    plain = validate(compose_job([]), 1, environment=False).build
    assert not plain.master_weights and plain.reduce_dtype == torch.float32


def test_memory_estimate_follows_the_bytes_per_parameter():
    def est(settings):
        return estimate_memory(validate(compose_job(settings), 1, environment=False), "cuda").bytes

    plain = est([])
    assert est([STATE]) == pytest.approx(plain * 12 / 16)
    assert est([MASTER, STATE, BF16]) == pytest.approx(plain * 12 / 16)
    assert est([MASTER, BF16]) == pytest.approx(plain)


# ------------------------------------------------------------------ FSDP dp2 and DDP dp2 on gloo
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
# each run on 2 ranks: (its settings, what it is compared with, tolerance).  The reference is a
# one-process run (a tuple of its settings) or an earlier run of the launch (its index).  bf16 moments:
# the same rounding of nearly the same values (1e-5, as every layout).  bf16 reductions: each rank's
# gradient rounded to bf16 before the sum, against one process, which sums nothing: 2^-9 of each part,
# more relative to a sum whose parts cancel (measured: gradients 2.8e-2, parameters 4.7e-3).  Master
# weights against today's FSDP bf16 path (fp32 shards gathered as bf16): the same bf16 weights in the first
# forward, so the same first loss; the gradients kept in bf16 after the fp32 reduce-scatter, and summed
# over a rank's 2 micro-batches in bf16 (measured: gradients 5.7e-2, parameters 2.6e-3, loss 5.4e-6).  A resumed run
# (RESUME: saved after step 1, a new Trainer) against the same run uninterrupted: bit for bit (0)
FSDP, DDP = "parallel.dp_mode=fsdp", "parallel.dp_mode=ddp"
DP2 = [
    ([FSDP, STATE], (STATE,), 1e-5),
    ([FSDP, STATE, "RESUME"], 0, 0.0),
    ([FSDP, REDUCE], (), {"loss": 1e-4, "grads": 5e-2, "params": 1e-2}),
    ([DDP, REDUCE], (), {"loss": 1e-4, "grads": 5e-2, "params": 1e-2}),
    ([FSDP, BF16], None, None),  # today's bf16 path: the next runs' reference
    ([FSDP, BF16, MASTER], 4, {"loss": 1e-4, "grads": 1e-1, "params": 1e-2}),
    ([FSDP, BF16, MASTER, "RESUME"], 5, 0.0),
]


def _ref_name(settings: tuple) -> str:
    """A file name for the one-process run of `settings` (no "=": it goes into a Hydra override)."""
    return "ref_" + ("_".join(x.replace("=", "-") for x in settings) or "fp32")


def _dp2_on_ranks(rank: int, world: int, shards: str, tmp: str) -> None:
    import json

    import torch.distributed as dist
    from test_layouts import compare, run_job

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    report, runs = {}, []
    for i, (layout, ref, tol) in enumerate(DP2):
        runs.append(run_job(shards, os.path.join(tmp, f"dp2_{i}"), layout))
        if ref is None:
            continue
        want = (
            runs[ref]
            if isinstance(ref, int)
            else torch.load(os.path.join(tmp, f"{_ref_name(ref)}.pt"), weights_only=False)
        )
        errors = compare(runs[-1], want)
        report[" ".join(layout)] = errors
        limit = tol if isinstance(tol, dict) else dict.fromkeys(errors, tol)
        assert all(v <= limit[k] for k, v in errors.items()), (layout, errors)
        if layout[1:] == [BF16, MASTER]:  # the same bf16 weights in the first forward
            assert runs[-1]["losses"][0] == want["losses"][0]
        dist.barrier()
    if rank == 0:
        Path(tmp, "dp2.json").write_text(json.dumps(report, indent=1))


@pytest.mark.slow
def test_light_state_under_fsdp_and_ddp_dp2_matches_one_process(tmp_path):
    from gloo_ranks import run_forked, run_ranks
    from test_layouts import _one_process

    shards = str(ensure_sample()[0])
    refs = {ref for _, ref, _ in DP2 if isinstance(ref, tuple)}
    run_forked(_one_process, [(shards, str(tmp_path), _ref_name(r), list(r)) for r in refs])
    launch = tmp_path / "launch"
    launch.mkdir()
    run_ranks(_dp2_on_ranks, 2, launch, 2, shards, str(tmp_path), timeout_s=600)
    for layout, err in __import__("json").loads((tmp_path / "dp2.json").read_text()).items():
        print(f"dp2 [{layout}]: " + " ".join(f"{k} {v:.1e}" for k, v in err.items()))
