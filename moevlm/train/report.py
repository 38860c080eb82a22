"""What the trainer reports that only it knows: the extra fields of each log record (memory per
pipeline rank, expert loads of every stage, dropped rows per layer, compile counters, component
times), the data line and the end-of-run summary."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moevlm.parallel.offload import describe as describe_offload
from moevlm.parallel.recompute import describe as describe_recompute
from moevlm.train.exit_codes import ExitCode
from moevlm.train.metrics import Window, peak_memory_gib, reset_peak_memory

if TYPE_CHECKING:
    from moevlm.train.trainer import Trainer


def window_record(tr: Trainer, window: Window) -> dict:
    """The log record of `window` with what only the trainer knows.  Collective under pipeline stages
    and expert capacity: every rank builds it, rank 0 writes it."""
    mem = peak_memory_gib(tr.device)
    if tr.step_graph is not None:  # replays use the memory their capture took
        mem = max(mem, tr.step_graph.peak_gib)
    rec = window.record(
        step=tr.step,
        world_size=tr.world,
        peak_tflops=tr.peak,
        mem_gib=mem,
        expert_counts=pp_all_layers(tr, window.counts),
        mem_gib_by_pp_rank=None if tr.pipeline is None else max_by_pp_rank(tr, mem),
        skipped=tr.loader.stats()["skipped"],
        nonfinite_steps=tr.nonfinite_steps,
    )
    rec["recompute"] = describe_recompute(
        *tr.plan.build.recompute, tr.plan.build.recompute_collectives
    )
    rec["offload"] = describe_offload(tr.plan.build.offload)
    # compiled_graphs, graph_breaks, recompiles (moevlm.parallel.compile)
    if tr.compiled is not None:
        rec.update(tr.compiled.record())
    if tr.prof.timing:  # seconds per component summed over the window, like step_time_s
        rec["components_s"] = tr.prof.take_window()
    # collective: moe_dropped_tokens, _fraction, moe_overflowed_dispatches
    if tr.overflow is not None:
        rec["moe_dropped_fraction_by_layer"] = dropped_by_layer(tr)
        rec.update(tr.overflow.record(tr.device))  # over the window
    rec["mock"] = tr.plan.data.mock  # data.mock: "none" for real data
    if tr.plan.model.moe.router_force_balance:
        rec["moe_router_force_balance"] = True
    reset_peak_memory(tr.device)
    return rec


def dropped_by_layer(tr: Trainer) -> list[float | None]:
    """Per MoE layer (decoder order, every pipeline stage's), the capacity dispatchers' dropped over
    routed (token, expert) choices of the window, summed over the ranks holding different tokens;
    read before `OverflowCounter.record` resets the counts.  Collective, like that record."""
    rows = [
        torch.stack(
            [
                torch.zeros((), dtype=torch.long) if d.dropped is None else d.dropped.cpu().long(),
                torch.as_tensor(d.routed).cpu().long(),
            ]
        )
        for d in tr.overflow.dispatchers
    ]
    local = torch.stack(rows).to(tr.device) if rows else None
    # the ranks of one pipeline position hold the same layers
    if local is not None and tr.parallel.loss_group is not None:
        dist.all_reduce(local, group=tr.parallel.loss_group)
    if tr.pipeline is not None:
        local = pp_all_layers(tr, local)
    if local is None:
        return []
    return [round(float(d) / float(r), 6) if r else None for d, r in local.tolist()]


def pp_all_layers(tr: Trainer, counts: torch.Tensor | None) -> torch.Tensor | None:
    """Expert counts of every MoE layer: each pipeline rank holds its stages' layers."""
    if tr.pipeline is None:
        return counts
    every: list = [None] * tr.plan.dims.pp
    dist.all_gather_object(
        every, None if counts is None else counts.cpu(), group=tr.parallel.pp_group
    )
    parts = [c for c in every if c is not None]
    return torch.cat(parts) if parts else None


def max_by_pp_rank(tr: Trainer, value: float) -> list[float]:
    """`value` (peak memory) per pipeline position: the largest over the ranks that hold its stages."""
    t = torch.zeros(tr.plan.dims.pp, dtype=torch.float64, device=tr.device)
    t[tr.pipeline.pp_rank] = value
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [round(x, 3) for x in t.tolist()]


def summary(tr: Trainer, seconds: float, steps: int) -> int:
    """The end-of-run lines, and the exit code train.require_loss_decrease asks for."""
    real = tr.updated_losses  # this launch's updates only: not skipped steps, not a resumed past
    t = tr.plan.train
    tr.log.info(
        f"done: {steps} steps in {seconds:.1f}s ({steps / max(seconds, 1e-9):.2f} steps/s); "
        f"data: {describe_data(tr.loader.stats())}"
    )
    if tr.compiled is not None:
        c = tr.compiled.record()
        tr.log.info(
            f"compile: {c['compiled_graphs']} graphs, {c['graph_breaks']} graph breaks, "
            f"{c['recompiles']} recompiles after the first step"
        )
    if t.require_loss_decrease and len(real) < 6:
        tr.log.info(
            f"note: train.require_loss_decrease not checked: it compares the mean of the first 3 "
            f"and last 3 losses of steps that updated the weights in this launch, and this launch "
            f"has {len(real)} (run at least 6 steps)"
        )
    if t.require_loss_decrease and len(real) >= 6:
        first, last = sum(real[:3]) / 3, sum(real[-3:]) / 3
        if not last < first:
            tr.log.info(f"FAIL: loss did not fall (first 3 steps {first:.4f}, last 3 {last:.4f})")
            return ExitCode.NO_PROGRESS
        tr.log.info(f"ok: mean loss of the first 3 steps {first:.4f} -> last 3 {last:.4f}")
    return ExitCode.OK


def describe_data(stats: dict) -> str:
    """The loader's end-of-run counts (PackedLoader.stats) as one line of text."""
    if "samples_read" not in stats:  # NoData: a later pipeline stage reads nothing
        return "read on the first pipeline stage"
    skipped = stats.get("skipped") or {}
    skips = ", ".join(f"{reason} {n}" for reason, n in skipped.items()) if skipped else "none"
    bad = stats.get("shards_all_skipped") or {}
    shards = f"; shards with no usable sample: {', '.join(sorted(bad))}" if bad else ""
    fell = stats.get("fell_back") or {}
    down = {r: fell.pop(r) for r in ("video_fewer_frames", "video_lower_resolution") if r in fell}
    fell = (
        "; trained without their images: " + ", ".join(f"{r} {n}" for r, n in fell.items())
        if fell
        else ""
    )
    if down:
        fell += "; videos sampled down to fit: " + ", ".join(f"{r} {n}" for r, n in down.items())
    images = f" with {stats['images_packed']} images" if "images_packed" in stats else ""
    if stats.get("videos_packed"):
        images += f" and {stats['videos_packed']} videos"
    # read counts what the shuffle buffer and the packer read ahead of the rows trained, epochs too
    return (
        f"{stats['samples_packed']} samples trained{images} in {stats['batches']} batches; "
        f"{stats['samples_read']} samples read (the shuffle buffer and packer read ahead: the streams "
        f"are in data epoch {stats['epoch']}); skipped: {skips}{shards}{fell}; waited "
        f"{stats['data_wait_s']:.1f}s for data"
    )


def ruined_by_skips(ran: int, skipped: int, first_step: int) -> str | None:
    """ "Most steps skipped": more than half of a launch's `ran` steps were skipped as non-finite (one
    of one, two of three, six of ten): what training the launch did is outweighed by what it lost."""
    if ran == 0 or 2 * skipped <= ran:
        return None
    what = "every step" if skipped == ran else f"{skipped} of the {ran} steps"
    return (
        f"{what} of this launch ({first_step + 1}..{first_step + ran}) "
        f"{'was' if skipped == ran else 'were'} skipped for non-finite loss or gradients: the "
        "weights are ruined (more than half skipped). Lower optim.lr or check the data"
    )


# a loss within this fraction of ln(vocabulary) is the uniform prediction's
COLLAPSE_RTOL = 1e-3


def collapsed(loss: float, grad_norm: float, vocab_size: int) -> str | None:
    """ "Collapsed to a constant prediction": the launch's last step with a finite loss had a gradient
    norm of exactly 0 (no update can change the model any more) and a loss within COLLAPSE_RTOL of
    ln(vocabulary), the loss of a uniform prediction over every token id."""
    uniform = math.log(vocab_size)
    if grad_norm != 0.0 or abs(loss - uniform) > COLLAPSE_RTOL * uniform:
        return None
    return (
        f"the model collapsed to a constant prediction (loss {loss:.4f} = ln(vocabulary "
        f"{vocab_size}) = {uniform:.4f}, gradient norm 0: nothing can train it further). Lower "
        "optim.lr or check the data"
    )
