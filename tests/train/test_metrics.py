"""Metrics: record arithmetic, peak table, JSONL/TensorBoard/console output, rank gating."""

import json
import math

import pytest
import torch

from moevlm.train.metrics import (
    MetricsLogger,
    Window,
    console_line,
    device_peak_tflops,
    expert_load_max_over_mean,
    fmt_count,
    fmt_duration,
    peak_memory_gib,
    peak_tflops_for_name,
    scalars,
    slowest_over_micro_batches,
    step_record,
    vision_flops_slots,
)


def strict_json(token):
    raise ValueError(f"not valid JSON: {token}")  # json.loads accepts bare NaN/Infinity by default


def record(**kw):
    args = dict(
        step=10,
        loss=2.5,
        aux_loss=0.01,
        grad_norm=1.5,
        lr=2e-3,
        step_time_s=2.0,
        data_wait_s=0.5,
        useful_tokens=40_000,
        flops=8e14,
        world_size=4,
        peak_tflops=400.0,
        skipped={"too_long": 2, "bad_image": 1},
        nonfinite_steps=0,
        mem_gib=1.25,
    )
    return step_record(**(args | kw))


def test_record_arithmetic_per_device():
    r = record()
    assert r["tokens_per_s"] == pytest.approx(40_000 / 2.0 / 4)
    assert r["tflops"] == pytest.approx(8e14 / 2.0 / 4 / 1e12)  # 100 TFLOP/s per device
    assert r["mfu"] == pytest.approx(0.25)
    assert r["flops"] == 8e14
    assert r["data_wait_frac"] == pytest.approx(0.25)
    assert r["bad_samples"] == 3 and r["bad_samples_by_reason"] == {"bad_image": 1, "too_long": 2}
    assert r["expert_load_max_over_mean"] is None


def test_window_means_loss_sums_work_and_takes_the_moment_from_the_caller():
    """Two steps in one window: loss and aux averaged, time, tokens, images, image tokens, FLOPs and wait
    summed, the last step's grad_norm and lr, expert counts summed; step, memory and skip counts are the
    caller's."""
    w = Window()
    for loss, counts in ((3.0, torch.tensor([[1, 3]])), (2.0, None)):
        w.add(
            images=int(loss),
            image_tokens=16 * int(loss),
            # the slowest rank's vision FLOPs and the mean rank's: 9 + 4 over 6 + 2
            vision_max=9.0 if loss == 3.0 else 4.0,
            vision_mean=6.0 if loss == 3.0 else 2.0,
            loss=loss,
            aux=0.02,
            grad_norm=loss / 2,
            lr=loss * 1e-3,
            useful_tokens=20_000,
            flops=4e14,
            seconds=1.0,
            wait=0.25,
            counts=counts,
        )
    r = w.record(
        step=10,
        world_size=4,
        peak_tflops=400.0,
        mem_gib=1.25,
        expert_counts=w.counts,
        skipped={"too_long": 2, "bad_image": 1},
        nonfinite_steps=0,
        mem_gib_by_pp_rank=[1.25, 1.0],
    )
    assert r == record(
        loss=2.5, aux_loss=0.02, grad_norm=1.0, expert_counts=torch.tensor([[1, 3]])
    ) | {
        "mem_gib_by_pp_rank": [1.25, 1.0],
        "steps_in_window": 2,
        "tokens": 40_000,
        "images": 5,
        "image_tokens": 80,
        "videos": 0,
        "video_tokens": 0,
        # steps weighted by their vision work, not a mean of the ratios (1.5 and 2.0)
        "vision_flops_max_over_mean": 13.0 / 8.0,
    }
    # a window without images has no vision balance to report
    empty = Window()
    empty.add(
        loss=1.0,
        aux=0.0,
        grad_norm=1.0,
        lr=1e-3,
        useful_tokens=1,
        flops=1.0,
        seconds=1.0,
        wait=0.0,
        counts=None,
    )
    assert (
        empty.record(
            step=1,
            world_size=1,
            peak_tflops=None,
            mem_gib=None,
            expert_counts=None,
            skipped={},
            nonfinite_steps=0,
        )["vision_flops_max_over_mean"]
        is None
    )


def test_mfu_null_without_peak_and_on_cpu():
    cpu = torch.device("cpu")
    assert device_peak_tflops(cpu) is None
    assert device_peak_tflops(cpu, override=123.0) == 123.0
    assert record(peak_tflops=device_peak_tflops(cpu))["mfu"] is None
    assert peak_memory_gib(cpu) > 0


@pytest.mark.parametrize(
    "name,bf16",
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA H200", 989.4),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA GB200", 2500.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.0),
        ("AMD Instinct MI300X", 1307.4),
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_peak_table_by_name(name, bf16):
    assert peak_tflops_for_name(name) == bf16
    if bf16 is not None and "A100" not in name:
        # L40S: 733 vs 2 x 362
        assert peak_tflops_for_name(name, "fp8") == pytest.approx(2 * bf16, rel=0.02)
    assert peak_tflops_for_name("NVIDIA A100-SXM4-80GB", "fp8") is None


def test_expert_load():
    counts_LE = torch.tensor(
        [
            [10, 10, 10, 10],  # balanced: 1.0
            [40, 0, 0, 0],  # all on one: 4.0
            [0, 0, 0, 0],
        ]
    )  # empty layer: ignored
    assert expert_load_max_over_mean(counts_LE) == pytest.approx(4.0)
    assert expert_load_max_over_mean(counts_LE[:1]) == pytest.approx(1.0)
    assert expert_load_max_over_mean(counts_LE[2:]) is None
    assert record(expert_counts=counts_LE)["expert_load_max_over_mean"] == pytest.approx(4.0)


def test_expert_load_by_layer_and_dropped_share_per_layer():
    """Per MoE layer: max/mean of the counts (null for an empty layer) in the record and under one
    TensorBoard tag each; the capacity dispatchers' dropped share per layer (the trainer's reading)."""
    from types import SimpleNamespace

    from moevlm.train.report import dropped_by_layer

    counts_LE = torch.tensor([[10, 10, 10, 10], [40, 0, 0, 0], [0, 0, 0, 0]])
    rec = record(expert_counts=counts_LE)
    assert rec["expert_load_by_layer"] == [1.0, 4.0, None]
    rec["moe_dropped_fraction_by_layer"] = [0.25, None]
    tags = scalars(rec)
    assert (
        tags["moe/load_max_over_mean/layer_1"] == 4.0
        and "moe/load_max_over_mean/layer_2" not in tags
    )
    assert tags["moe/dropped_fraction/layer_0"] == 0.25
    dispatchers = [
        SimpleNamespace(dropped=torch.tensor(3), routed=12),
        SimpleNamespace(dropped=None, routed=0),
    ]
    fake = SimpleNamespace(
        overflow=SimpleNamespace(dispatchers=dispatchers),
        device=torch.device("cpu"),
        parallel=SimpleNamespace(loss_group=None),
        pipeline=None,
    )
    assert dropped_by_layer(fake) == [0.25, None]


def test_vision_slots_count_the_slowest_rank_of_each_micro_batch():
    """The trainer's vision-balance values: each rank fills its own dp x M slots (the slowest cp share
    of each of its M micro-batches), the SUM all-reduce gives every rank all of them, and the step's
    figure is the slowest rank of each micro-batch, summed: two ranks whose steps sum the same but whose
    micro-batches alternate heavy and light still wait for each other at every micro-batch."""

    class Micro:
        def __init__(self, *cp):
            self.vision_flops_cp = cp

    rank0 = [Micro(3.0, 1.0), Micro(1.0, 1.0)]  # cp shares of its two micro-batches
    rank1 = [Micro(1.0, 0.5), Micro(3.0, 2.0)]
    slots = [
        a + b for a, b in zip(vision_flops_slots(rank0, 0, 2), vision_flops_slots(rank1, 1, 2))
    ]
    assert vision_flops_slots(rank0, 0, 2) == [3.0, 1.0, 0.0, 0.0]
    assert slots == [3.0, 1.0, 1.0, 3.0]
    assert (
        slowest_over_micro_batches(slots, 2) == 6.0
    )  # per step the two ranks' sums would be 4 and 4
    assert slowest_over_micro_batches([5.0, 2.0], 2) == 5.0  # one micro-batch per step


def test_fmt_count():
    assert [fmt_count(x) for x in (999, 12_345, 4.5e6, 2.5)] == ["999", "12.3k", "4.5M", "2.5"]


def test_console_line_step_eta_throughput_and_validation():
    """`step i/N | eta T | loss | val_loss | ...`: the ETA as the logger computes it (the steps left at
    the rate since the launch's first record), the job's tokens/s beside the per-device ones on several
    ranks, the validation loss where the record has one; tags val/loss, val/tokens, data/images."""
    assert [fmt_duration(x) for x in (0.4, 59, 75, 3725, 200_000, None, math.inf)] == [
        "0s",
        "59s",
        "1m15s",
        "1h02m",
        "2d07h",
        "?",
        "?",
    ]
    rec = record() | {"val_loss": 2.25, "val_tokens": 512, "images": 3, "image_tokens": 48}
    line = console_line(rec, 100, eta_s=95.0, world_size=4)
    assert line.startswith("step  10/100 | eta 1m35s | loss 2.5000 | val_loss 2.2500 | aux ")
    assert "| 20.0k tok/s | 5.0k tok/s/dev | 100 TFLOP/s |" in line
    assert "tok/s |" not in console_line(record(), 100)  # one process: per device only
    tags = scalars(rec)
    assert (tags["val/loss"], tags["val/tokens"], tags["data/images"]) == (2.25, 512, 3)
    assert tags["data/image_tokens"] == 48
    rec["vision_flops_max_over_mean"] = 1.25
    assert scalars(rec)["data/vision_flops_max_over_mean"] == 1.25
    log = MetricsLogger(None, rank=1, total_steps=100, log_every=1)  # (the ETA's arithmetic only)
    assert log._eta(record(step=10, step_time_s=2.0)) is None  # the first record: no ETA yet
    log._since = (log._since[0] - 30.0, 10)  # 30 s later, 5 steps on: 6 s a step, 85 steps left
    assert log._eta(record(step=15)) == pytest.approx(510.0, rel=1e-2)


def test_jsonl_tensorboard_console(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, rank=0, total_steps=100, log_every=10, progress=False) as log:
        assert (
            log.should_log(1)
            and log.should_log(20)
            and log.should_log(100)
            and not log.should_log(15)
        )
        log.log(record(step=10, expert_counts=torch.tensor([[3, 1]])))
        log.log(record(step=20, loss=float("nan"), grad_norm=float("inf"), peak_tflops=None))
        log.info("hello")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(line, parse_constant=strict_json) for line in lines]
    for r in recs:
        assert {"step", "loss", "tokens_per_s", "tflops", "mfu"} <= r.keys()
    assert (
        recs[1]["loss"] == "nan"
        and math.isnan(float(recs[1]["loss"]))
        and recs[1]["grad_norm"] == "inf"
    )
    assert recs[1]["mfu"] is None

    out = capsys.readouterr().out.splitlines()
    # no ETA at the launch's first record (its step time holds the warm-up)
    assert out[0].startswith("step  10/100 | eta ? | loss 2.5000 |") and "100 TFLOP/s" in out[0]
    assert "5.0k tok/s/dev" in out[0] and "MFU 25.0%" in out[0] and "load 1.5x" in out[0]
    assert "MFU" not in out[1] and out[2] == "hello"

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in (
        "train/loss",
        "perf/tflops",
        "perf/mfu",
        "perf/tokens_per_s",
        "memory/peak_gib",
        "data/wait_frac",
        "moe/load_max_over_mean",
        "data/bad_samples",
        "data/bad_samples/too_long",
    ):
        assert tag in tags
    assert [(e.step, e.value) for e in acc.Scalars("perf/tflops")] == [(10, 100.0), (20, 100.0)]
    assert [e.step for e in acc.Scalars("perf/mfu")] == [10]


def test_nonzero_rank_writes_nothing(tmp_path, capsys):
    log = MetricsLogger(tmp_path / "run", rank=1, total_steps=10, log_every=1, progress=False)
    log.log(record())
    log.info("hi")
    log.close()
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr().out == ""
