"""The plan of parallel.optimizer_offload: per rank the bytes taken off the device (the optimizer state;
under FSDP also the parameter shards and their gradients), the host memory it needs, the copies per
step, and the device peak lower by what left it.  The host AdamW's figure is checked against a real
trainer's host buffers."""

from __future__ import annotations

import pytest

from moevlm.config import compose_job
from moevlm.plan.dry_run import dry_run
from moevlm.plan.report import format_plan, make_plan
from moevlm.train.trainer import Trainer

COMMON = [
    "data.shards=sample",
    "data.num_workers=0",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.tensorboard=false",
    "train.checkpoint_at_end=false",
    "train.checkpoint_every=0",
    "train.progress=false",
]
OFFLOAD = "parallel.optimizer_offload=true"


@pytest.mark.parametrize(
    "layout,world,kind",
    [
        pytest.param([], 1, "host", id="one_process"),
        pytest.param(["parallel.dp_mode=ddp"], 2, "host", id="ddp_dp2", marks=pytest.mark.slow),
        pytest.param(["parallel.dp_mode=fsdp"], 2, "fsdp", id="fsdp_dp2", marks=pytest.mark.slow),
    ],
)
def test_offload_moves_bytes_to_the_host_and_lowers_the_device_peak(layout, world, kind):
    off = dry_run(compose_job(COMMON + layout), world=world, bf16=False)
    on = dry_run(compose_job(COMMON + layout + [OFFLOAD]), world=world, bf16=False)
    assert (
        off.optimizer_offload is None
        and off.optimizer_host_bytes == 0
        and on.optimizer_offload == kind
    )
    # the same tensors, now partly on the host
    for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_peak_bytes"):
        assert getattr(on, k) == getattr(off, k), k
    p, g, o = on.params_bytes, on.grads_bytes, on.optimizer_bytes
    if kind == "host":  # the state leaves; masters and gradient buffers are host copies
        assert on.offloaded_bytes == o and on.optimizer_host_bytes == p + g + o
        assert on.h2d_bytes == p and on.d2h_bytes == g
    else:  # FSDP's shards, gradients and state live on the host
        assert on.offloaded_bytes == on.optimizer_host_bytes == p + g + o
        micro_batches = 4 // world
        assert on.d2h_bytes == micro_batches * g and on.h2d_bytes == 2 * micro_batches * p
    assert off.peak_bytes - on.peak_bytes == on.offloaded_bytes > 0


def test_host_figure_is_the_real_host_optimizer_s(tmp_path):
    """One process, fp32: the planned host memory equals the host AdamW's buffers after a real step."""
    job = compose_job(COMMON + [OFFLOAD, f"train.run_dir={tmp_path}", "train.steps=1"])
    planned = dry_run(job, bf16=False)
    tr = Trainer(job)
    try:
        assert tr.train_step(_NoWindow())
        real = tr.opt.host_bytes()
    finally:
        tr.close()
    assert planned.optimizer_host_bytes == sum(real.values())
    assert planned.offloaded_bytes == real["state"] == planned.optimizer_bytes
    assert planned.h2d_bytes == real["masters"] and planned.d2h_bytes == real["grads"]


def test_cli_report_has_the_offload_table():
    out = make_plan(compose_job(COMMON + [OFFLOAD]), 1, "h100")
    text = format_plan(out)
    assert "optimizer offload (host AdamW" in text
    r = out["ranks"][0]
    row = f"| 0 | {r['offloaded_bytes'] / 2**30:.1f} | {r['optimizer_host_bytes'] / 2**30:.1f} |"
    assert row in text, text


class _NoWindow:
    def add(self, **kw):
        pass
