"""parallel.optimizer_offload in one process (fp32, CPU): the host AdamW trains exactly what the device
optimizer trains, its checkpoints are in the device optimizer's format (a run saved with offload resumes
without it and the other way round, exactly), and the settings it cannot run with are config errors.
The FSDP and DDP layouts with offload are entries of tests/parallel/test_layouts.py; resume after a
SIGKILL with offload is part of tests/train/test_trainer.py::test_resume_after_sigkill_is_exact."""

from __future__ import annotations

import pytest
import torch

from moevlm.config import compose_job, estimate_memory, validate
from moevlm.data.sample_cache import ensure_sample
from moevlm.errors import ConfigError
from moevlm.parallel.optimizer_offload import HostOffloadAdamW
from moevlm.train.trainer import Trainer

OFFLOAD = "parallel.optimizer_offload=true"
STEPS = 3


class _NoWindow:
    def add(self, **kw):
        pass


def overrides(run_dir, extra=()) -> list[str]:
    return [
        f"data.shards={ensure_sample()[0]}",
        "data.num_workers=0",
        "data.streams=2",
        "train.global_batch_size=2",
        "train.micro_batch_size=1",
        f"train.steps={STEPS}",
        f"train.run_dir={run_dir}",
        "train.tensorboard=false",
        "train.checkpoint_at_end=false",
        "train.checkpoint_every=0",
        "train.require_loss_decrease=false",
        "train.progress=false",
        "optim.warmup_steps=2",  # the schedule moves between steps
        "optim.grad_clip=0.05",  # active: the clipped gradients are what crosses to the host
        *extra,
    ]


def train(run_dir, extra=(), *, save_after=None, stop_at=STEPS, look=None):
    """(per-step losses, final parameters, optimizer state by name, trainer's optimizer type).
    `look(trainer)`: called before the first step and after each (checks of the internals)."""
    tr = Trainer(compose_job(overrides(run_dir, extra)))
    kind = type(tr.opt)
    try:
        while tr.step < stop_at:
            if look is not None:
                look(tr)
            assert tr.train_step(_NoWindow())
            if tr.step == save_after:
                tr.save(complete=True)
        if look is not None:
            look(tr)
        params = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        return list(tr.losses), params, _state_by_name(tr), kind
    finally:
        tr.close()


def _state_by_name(tr) -> dict:
    view = getattr(tr.opt, "checkpoint_view", None)
    module, opt = view() if view is not None else (tr.model, tr.opt)
    names = {id(p): n for n, p in module.named_parameters()}
    return {
        f"{names[id(p)]}.{k}": v.detach().clone()
        for p, s in opt.state.items()
        for k, v in s.items()
        if isinstance(v, torch.Tensor)
    }


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The job without and with offload, each checkpointed after step 1: {"plain": (dir, result),
    "offload": (dir, result, what `_HostChecks` saw)}."""
    plain, offload = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("offload")
    checks = _HostChecks()
    return {
        "plain": (plain, train(plain, save_after=1)),
        "offload": (offload, train(offload, [OFFLOAD], save_after=1, look=checks), checks),
    }


class _HostChecks:
    """Before the first step and after each, on the host AdamW's trainer: the masters are host copies
    named like the trainable parameters, each step changes the model and leaves master == weight, the
    schedule drives the host AdamW's groups, its host buffers have the documented sizes."""

    name = "lm_head.weight"

    def __init__(self):
        self.before, self.steps_seen = None, 0

    def __call__(self, tr):
        opt = tr.opt
        shadow = dict(opt.shadow.named_parameters())
        device = dict(tr.model.named_parameters())
        assert shadow.keys() == {n for n, p in device.items() if p.requires_grad}
        w, master = device[self.name].detach(), shadow[self.name].detach()
        assert master.data_ptr() != w.data_ptr() and master.device.type == "cpu"
        torch.testing.assert_close(w, master, rtol=0, atol=0)
        assert opt.param_groups is opt.inner.param_groups
        assert tr.sched.get_last_lr()[0] == opt.param_groups[0]["lr"]
        if self.before is not None:  # the update reached the model
            assert not torch.equal(w, self.before)
            n = sum(p.numel() for p in device.values() if p.requires_grad)
            assert opt.state[shadow[self.name]]["exp_avg"].device.type == "cpu"
            assert opt.host_bytes() == {
                "masters": 4 * n,
                "grads": 4 * n,
                "state": 8 * n + 4 * len(shadow),  # exp_avg, exp_avg_sq, a float32 step each
            }
            self.steps_seen += 1
        self.before = w.clone()


def test_offload_trains_exactly_what_the_device_optimizer_trains(runs):
    _, plain = runs["plain"]
    _, (losses, params, state, kind), checks = runs["offload"]
    assert kind is HostOffloadAdamW and plain[3] is torch.optim.AdamW
    assert checks.steps_seen == STEPS
    # the same AdamW arithmetic on the same fp32 values (CPU here: the same kernels), bit for bit
    assert losses == plain[0]
    assert_equal(params, plain[1])
    assert_equal(state, plain[2])


@pytest.mark.parametrize(
    "saved,resumed",
    [("offload", []), ("plain", [OFFLOAD])],
    ids=["offload_to_plain", "plain_to_offload"],
)
def test_checkpoint_resumes_across_offload_exactly(runs, tmp_path, saved, resumed):
    """The step-1 checkpoint of one setting resumed with the other: the same steps 2..3 as the
    uninterrupted run without offload (which equals the one with it, above)."""
    source, plain = runs[saved][0], runs["plain"][1]
    start = f"train.resume={source / 'checkpoints' / 'step_00000001'}"
    losses, params, state, _ = train(tmp_path, [*resumed, start])
    assert losses == plain[0]
    assert_equal(params, plain[1])
    assert_equal(state, plain[2])


def test_fp8_weight_cache_follows_the_host_step(tmp_path):
    """FP8 (emulated on the CPU) with its per-step weight codes: the host step ends a cache generation
    (its step hook is the host AdamW's), so offload trains exactly what the device optimizer trains."""
    fp8 = ["model.fp8=blockwise", "model.fp8_backend=emulate"]
    plain = train(tmp_path / "plain", fp8, stop_at=2)
    losses, params, _, _ = train(tmp_path / "offload", [*fp8, OFFLOAD], stop_at=2)
    assert losses == plain[0]
    assert_equal(params, plain[1])


@pytest.mark.parametrize(
    "probe,layout,world,words",
    [
        (
            "fsdp_cpu_offload_available",
            ["parallel.dp_mode=fsdp"],
            2,
            "under FSDP needs FSDP2's CPU offload policy (torch.distributed.fsdp.CPUOffloadPolicy), which "
            "this torch lacks; use parallel.dp_mode=ddp",
        ),
        (
            "cpu_fused_adamw",
            ["optim.implementation=fused"],
            1,
            "with optim.implementation=fused: this torch has no fused AdamW kernel for the CPU, where the "
            "offloaded step runs; use optim.implementation=auto",
        ),
    ],
    ids=["fsdp_without_cpu_offload_policy", "fused_without_cpu_kernel"],
)
def test_refusals_are_one_line_config_errors(monkeypatch, probe, layout, world, words):
    """Each refusal names the setting, the reason and what to change, on one line; the same job without
    the missing feature (the probe true) or without offload validates."""
    import moevlm.config.build_checks as v

    job = compose_job([OFFLOAD, *layout])
    validate(job, world, environment=False)  # this torch has the feature
    monkeypatch.setattr(v, probe, lambda: False)
    with pytest.raises(ConfigError) as err:
        validate(job, world, environment=False)
    (line,) = str(err.value).splitlines()
    assert line.startswith("parallel.optimizer_offload=true ") and words in line, line
    validate(compose_job(layout), world, environment=False)
    if world > 1:  # DDP's host AdamW does not need FSDP's policy
        validate(compose_job([OFFLOAD, "parallel.dp_mode=ddp"]), world, environment=False)


def test_memory_check_counts_only_what_stays_on_the_gpu():
    """The pre-build memory check (moevlm.config.memory) against a GPU: the host AdamW leaves the weight and
    its gradient (8 of 16 bytes a trained parameter), FSDP's CPU offload nothing persistent; on the CPU
    the host is the device and nothing is taken off."""

    def est(overrides, world, device_type):
        job = compose_job(overrides)
        return estimate_memory(validate(job, world, environment=False), device_type)

    plain = est([], 1, "cuda")
    host = est([OFFLOAD], 1, "cuda")
    assert host.bytes == plain.bytes / 2 and host.params == plain.params
    assert host.offloaded and "parallel.optimizer_offload" in host.describe()
    assert est([OFFLOAD], 1, "cpu").bytes == plain.bytes
    assert est([OFFLOAD, "parallel.dp_mode=ddp"], 2, "cuda").bytes == plain.bytes / 2
    fsdp = est([OFFLOAD, "parallel.dp_mode=fsdp"], 2, "cuda")
    assert fsdp.bytes == 0 < est(["parallel.dp_mode=fsdp"], 2, "cuda").bytes
