"""Plans with activation offload (`model.offload_modules`): the dry run reports the activation bytes
copied to the host per step and the host memory they hold, per rank, and its device peak falls by
what left the device; both agree with a real CPU step measured the same way (its host-to-host
copies are counted as host memory by the same tracker)."""

from __future__ import annotations

from test_dry_run import COMMON

from moevlm.config import compose_job, validate
from moevlm.plan.dry_run import dry_run
from moevlm.plan.measure import measure_trainer_step
from moevlm.plan.report import format_plan


def _job(tmp_path, name: str, extra: list[str]):
    return compose_job(
        COMMON
        + [
            f"train.run_dir={tmp_path / name}",
            "train.global_batch_size=2",
            "model.recompute=full",
            *extra,
        ]
    )


def test_offload_moves_layer_inputs_to_host_and_lowers_the_device_peak(tmp_path):
    off = dry_run(_job(tmp_path, "off", []), bf16=False)
    job = _job(tmp_path, "on", ["model.offload_modules=[layer_input]"])
    on = dry_run(job, bf16=False)
    assert off.activation_offload_bytes == off.activation_host_bytes == 0
    # full recompute keeps each layer's input h (B,S,D) of every micro-batch: fp32 here
    plan = job.data.pack
    cfg = validate(job, 1, environment=False).model
    h_bytes = job.train.micro_batch_size * plan.seq_len * cfg.text.hidden_size * 4
    per_micro_batch = cfg.text.num_layers * h_bytes
    assert on.activation_offload_bytes == 2 * per_micro_batch  # two micro-batches per step
    assert on.activation_host_bytes == per_micro_batch  # one micro-batch's, freed by its backward
    # the device peak falls by the offloaded inputs, less the one layer's prefetched back early
    fall = off.peak_bytes - on.peak_bytes
    print(
        f"peak {off.peak_bytes} -> {on.peak_bytes} B (fall {fall}), offloaded per micro-batch "
        f"{per_micro_batch} B, per step {on.activation_offload_bytes} B, host {on.activation_host_bytes} B"
    )
    assert per_micro_batch - 2 * h_bytes <= fall <= per_micro_batch, (fall, per_micro_batch)
    assert on.params_bytes == off.params_bytes and on.optimizer_bytes == off.optimizer_bytes
    # a real step on the CPU measured the same way
    real = measure_trainer_step(job)
    assert real["activation_offload_bytes"] == on.activation_offload_bytes
    assert real["activation_host_bytes"] == on.activation_host_bytes
    assert abs(on.peak_bytes - real["peak_bytes"]) <= 0.15 * real["peak_bytes"]
    # the report names them per rank
    out = {
        "world": 1,
        "layout": "one process",
        "micro_batches": 2,
        "gpu_name": "H100",
        "usable_bytes": 1 << 36,
        "device_memory_bytes": 1 << 36,
        "schedule": None,
        "fits": True,
        "ranks": [{**on.as_dict(), "fits": True}],
    }
    text = format_plan(out)
    assert "copied to host per step GiB" in text and "host memory GiB (pinned)" in text
