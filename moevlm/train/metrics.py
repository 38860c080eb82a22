"""Step metrics and logging: one JSON line, TensorBoard scalars, W&B (optional) and a console line
per logged step, written by rank 0 only, every line flushed.

    logger = MetricsLogger(run_dir, rank, total_steps, log_every)
    if logger.should_log(step):
        logger.log(step_record(step=step, loss=..., useful_tokens=..., flops=..., ...))
    logger.close()

Rates are per device (`tokens_per_s`, `tflops`: global useful tokens or model FLOPs / step time /
world size); MFU divides by the device's dense bf16 peak (`PEAK_TFLOPS`).  What every field means:
docs/architecture.md, "Training loop services".
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

from moevlm.train.integrity import write_failed_line

# Dense peak TFLOP/s (no sparsity) by lower-case substring of torch.cuda.get_device_name();
# the longest matching key wins ("gb200" over "b200", "h100 nvl" over "h100").
# Sources: NVIDIA H100/H200/HGX B200/GB200 NVL72/A100/L40S and AMD MI300X datasheets
# (sparse figures halved).  fp16 peaks equal bf16.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "h100": {"bf16": 989.4, "fp8": 1978.9},  # SXM ("NVIDIA H100 80GB HBM3")
    "h100 pcie": {"bf16": 756.0, "fp8": 1513.0},
    "h100 nvl": {"bf16": 835.5, "fp8": 1670.5},
    "h200": {"bf16": 989.4, "fp8": 1978.9},
    "h200 nvl": {"bf16": 835.5, "fp8": 1670.5},
    "gh200": {"bf16": 989.4, "fp8": 1978.9},  # Grace Hopper: an H100-class GPU
    "b200": {"bf16": 2250.0, "fp8": 4500.0},
    "gb200": {"bf16": 2500.0, "fp8": 5000.0},
    "a100": {"bf16": 312.0},
    "l40s": {"bf16": 362.0, "fp8": 733.0},
    "mi300x": {"bf16": 1307.4, "fp8": 2614.9},
}
_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "bf16", "float16": "bf16", "fp8": "fp8"}


def peak_tflops_for_name(name: str, dtype: str = "bf16") -> float | None:
    """Table lookup by device name; None when the device or the dtype is not in the table."""
    matches = [k for k in PEAK_TFLOPS if k in name.lower()]
    if not matches:
        return None
    return PEAK_TFLOPS[max(matches, key=len)].get(_DTYPES.get(dtype, dtype))


def device_name(device: torch.device) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def describe_device(device: torch.device) -> str:
    """The GPU's name, or the CPU's model and torch's thread count (the line a benchmark prints)."""
    if torch.device(device).type == "cuda":
        return device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return f"CPU: {names[0] if names else 'unknown'}, {torch.get_num_threads()} threads"


def device_peak_tflops(
    device: torch.device, dtype: str = "bf16", override: float | None = None
) -> float | None:
    """`override` (config train.peak_tflops; 0 or None = unset) wins; CPU and unknown GPUs -> None."""
    if override:
        return float(override)
    if torch.device(device).type != "cuda":
        return None
    return peak_tflops_for_name(device_name(device), dtype)


def peak_memory_gib(device: torch.device) -> float:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


def reset_peak_memory(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _load_ratios(counts_LE: torch.Tensor | None) -> list[float | None] | None:
    """max_e / mean_e of routed-token counts (layers x experts) per layer, None for a layer that
    routed nothing; None without counts."""
    if counts_LE is None or counts_LE.numel() == 0:
        return None
    c = counts_LE.detach().double().reshape(-1, counts_LE.shape[-1])
    mean_L, max_L = c.mean(-1), c.max(-1).values
    return [float(m / a) if a > 0 else None for m, a in zip(max_L, mean_L)]


def vision_flops_slots(micro, dp_rank: int, dp: int) -> list[float]:
    """This data-parallel rank's share of the vision-balance values in the step's token-count all-reduce
    (SUM): dp x M slots for M micro-batches, its own `dp_rank * M + i` holding micro-batch i's slowest
    context-parallel share (`MicroBatch.vision_flops_cp`), every other slot zero."""
    M = len(micro)
    slots = [0.0] * (dp * M)
    for i, m in enumerate(micro):
        slots[dp_rank * M + i] = max(m.vision_flops_cp)
    return slots


def slowest_over_micro_batches(slots, dp: int) -> float:
    """The all-reduced `vision_flops_slots`: the slowest data-parallel rank's vision FLOPs of each
    micro-batch, summed over the step's micro-batches."""
    M = len(slots) // dp
    return sum(max(slots[r * M + i] for r in range(dp)) for i in range(M))


def expert_load_max_over_mean(counts_LE: torch.Tensor | None) -> float | None:
    """max over layers of max_e / mean_e of routed-token counts (layers x experts); empty layers ignored."""
    used = [r for r in _load_ratios(counts_LE) or () if r is not None]
    return max(used) if used else None


def expert_load_by_layer(counts_LE: torch.Tensor | None) -> list[float | None] | None:
    """max_e / mean_e of routed-token counts per layer (null for a layer that routed nothing)."""
    ratios = _load_ratios(counts_LE)
    return None if ratios is None else [None if r is None else round(r, 4) for r in ratios]


def _num(x) -> float | None:
    return None if x is None else float(x)


def step_record(
    *,
    step: int,
    loss,
    lr: float,
    step_time_s: float,
    useful_tokens: int,
    flops: float,
    world_size: int,
    peak_tflops: float | None,
    aux_loss=None,
    grad_norm=None,
    data_wait_s: float = 0.0,
    expert_counts: torch.Tensor | None = None,
    skipped: dict[str, int] | None = None,
    nonfinite_steps: int = 0,
    mem_gib: float | None = None,
) -> dict:
    """The JSON record of one logged step.  Time, tokens and FLOPs may be one step's or sums over
    the logging window; tokens and FLOPs are global (all ranks), the rates come out per device."""
    per_dev_s = step_time_s * world_size if step_time_s > 0 else math.nan
    tflops = flops / per_dev_s / 1e12
    skipped = dict(sorted((skipped or {}).items()))
    return {
        "step": int(step),
        "loss": _num(loss),
        "aux_loss": _num(aux_loss),
        "grad_norm": _num(grad_norm),
        "lr": float(lr),
        "tokens_per_s": useful_tokens / per_dev_s,
        "tflops": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "flops": float(flops),
        "step_time_s": float(step_time_s),
        "data_wait_frac": data_wait_s / step_time_s if step_time_s > 0 else None,
        "mem_gib": _num(mem_gib),
        "expert_load_max_over_mean": expert_load_max_over_mean(expert_counts),
        "expert_load_by_layer": expert_load_by_layer(expert_counts),
        "bad_samples": sum(skipped.values()),
        "bad_samples_by_reason": skipped,
        "nonfinite_steps": int(nonfinite_steps),
    }


class Window:
    """Sums over the steps between two log lines (`add` after each step); `record` makes them the JSON
    record.  It holds only what the steps report: the values of the moment (step, memory, skip counts, the
    expert counts gathered from every pipeline stage) are the caller's, passed when the record is made."""

    def __init__(self):
        self.steps, self.loss, self.aux, self.tokens = 0, 0.0, 0.0, 0
        self.flops, self.seconds, self.wait = 0.0, 0.0, 0.0
        self.images, self.image_tokens = 0, 0
        self.videos, self.video_tokens = 0, 0
        self.vision_max, self.vision_mean = 0.0, 0.0
        self.counts, self.last, self.skipped_steps = None, {}, 0

    def add(
        self,
        *,
        loss,
        aux,
        grad_norm,
        lr,
        useful_tokens,
        flops,
        seconds,
        wait,
        counts,
        updated=True,
        images=0,
        image_tokens=0,
        videos=0,
        video_tokens=0,
        vision_max=0.0,
        vision_mean=0.0,
    ) -> None:
        """`updated`: the step changed the weights (False: skipped for non-finite values); `images`,
        `image_tokens` (`videos`, `video_tokens`): the global batch's real images (videos) and their tokens; `vision_max`, `vision_mean`: the
        step's vision FLOPs of the slowest data-parallel (x cp) rank of each micro-batch and of the mean
        rank, summed over its micro-batches."""
        self.steps += 1
        self.skipped_steps += not updated
        self.loss, self.aux = self.loss + loss, self.aux + aux
        self.tokens, self.flops = self.tokens + useful_tokens, self.flops + flops
        self.images, self.image_tokens = self.images + images, self.image_tokens + image_tokens
        self.videos, self.video_tokens = self.videos + videos, self.video_tokens + video_tokens
        self.seconds, self.wait = self.seconds + seconds, self.wait + wait
        self.vision_max, self.vision_mean = (
            self.vision_max + vision_max,
            self.vision_mean + vision_mean,
        )
        if counts is not None:
            self.counts = counts if self.counts is None else self.counts + counts
        self.last = {"grad_norm": grad_norm, "lr": lr, "updated": updated}

    def record(
        self,
        *,
        step: int,
        world_size: int,
        peak_tflops: float | None,
        mem_gib: float | None,
        expert_counts: torch.Tensor | None,
        skipped: dict[str, int] | None,
        nonfinite_steps: int,
        mem_gib_by_pp_rank: list[float] | None = None,
    ) -> dict:
        """`step_record` of the window's means (loss, aux) and sums (time, tokens, FLOPs, data wait), the
        last step's grad_norm and lr; `expert_counts` is `self.counts` of every layer (all pipeline stages)."""
        n = max(self.steps, 1)
        rec = step_record(
            step=step,
            loss=self.loss / n,
            aux_loss=self.aux / n,
            lr=self.last["lr"],
            grad_norm=self.last["grad_norm"],
            step_time_s=self.seconds,
            useful_tokens=int(self.tokens),
            flops=self.flops,
            world_size=world_size,
            peak_tflops=peak_tflops,
            data_wait_s=self.wait,
            expert_counts=expert_counts,
            skipped=skipped,
            nonfinite_steps=nonfinite_steps,
            mem_gib=mem_gib,
        )
        if mem_gib_by_pp_rank is not None:
            rec["mem_gib_by_pp_rank"] = mem_gib_by_pp_rank
        rec["tokens"], rec["images"] = int(self.tokens), int(self.images)
        rec["image_tokens"] = int(self.image_tokens)
        rec["videos"], rec["video_tokens"] = int(self.videos), int(self.video_tokens)
        rec["steps_in_window"] = self.steps
        rec["vision_flops_max_over_mean"] = (
            self.vision_max / self.vision_mean if self.vision_mean > 0 else None
        )
        # a skipped step is logged at once, marked: did the logged step update?
        if self.skipped_steps:
            rec["updated"], rec["skipped_steps_in_window"] = (
                self.last["updated"],
                self.skipped_steps,
            )
        return rec


def fmt_count(x: float) -> str:
    """12345 -> '12.3k', 4.5e6 -> '4.5M'."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{suffix}"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def json_safe(x):
    """Replaces non-finite floats (nested in dicts/lists too) by 'nan', 'inf', '-inf'."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


_TB_TAGS = {
    "loss": "train/loss",
    "aux_loss": "train/aux_loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "tokens_per_s": "perf/tokens_per_s",
    "tflops": "perf/tflops",
    "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s",
    "mem_gib": "memory/peak_gib",
    "data_wait_frac": "data/wait_frac",
    "expert_load_max_over_mean": "moe/load_max_over_mean",
    "bad_samples": "data/bad_samples",
    "nonfinite_steps": "train/nonfinite_steps",
    "tokens": "data/tokens",
    "images": "data/images",
    "image_tokens": "data/image_tokens",
    "videos": "data/videos",
    "video_tokens": "data/video_tokens",
    "vision_flops_max_over_mean": "data/vision_flops_max_over_mean",
    "val_loss": "val/loss",
    "val_tokens": "val/tokens",
}


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers under their TensorBoard / W&B tags (nulls left out)."""
    out = {tag: record[key] for key, tag in _TB_TAGS.items() if record.get(key) is not None}
    per_layer = {
        "expert_load_by_layer": "moe/load_max_over_mean",
        "moe_dropped_fraction_by_layer": "moe/dropped_fraction",
    }
    for key, tag in per_layer.items():
        for i, v in enumerate(record.get(key) or ()):
            if v is not None:
                out[f"{tag}/layer_{i}"] = v
    for reason, n in record.get("bad_samples_by_reason", {}).items():
        out[f"data/bad_samples/{reason}"] = n
    for name, seconds in (record.get("components_s") or {}).items():  # train.profile_components
        out[f"profile/{name}_s"] = seconds
    return out


def fmt_duration(seconds: float | None) -> str:
    """75 -> '1m15s', 3725 -> '1h02m', 200000 -> '2d07h'; None or not finite -> '?'."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def console_line(r: dict, total_steps: int, eta_s: float | None = None, world_size: int = 1) -> str:
    """One line per logged record: step / total, the time left to `total_steps` (`eta_s`), the losses,
    lr, tokens/s (the job's when `world_size` > 1, then per device), TFLOP/s and the rest."""
    w = len(str(total_steps))
    parts = [f"step {r['step']:>{w}}/{total_steps}", f"eta {fmt_duration(eta_s)}"]
    parts.append(f"loss {r['loss']:.4f}")
    if r.get("val_loss") is not None:
        parts.append(f"val_loss {r['val_loss']:.4f}")
    if r.get("aux_loss") is not None:
        parts.append(f"aux {r['aux_loss']:.3g}")
    if r.get("grad_norm") is not None:
        parts.append(f"gnorm {r['grad_norm']:.3g}")
    parts.append(f"lr {r['lr']:.1e}")
    if world_size > 1:
        parts.append(f"{fmt_count(r['tokens_per_s'] * world_size)} tok/s")
    parts += [f"{fmt_count(r['tokens_per_s'])} tok/s/dev", f"{r['tflops']:.3g} TFLOP/s"]
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if r.get("mem_gib") is not None:
        parts.append(f"mem {r['mem_gib']:.1f} GiB")
    if r.get("data_wait_frac") is not None:
        parts.append(f"data {100 * r['data_wait_frac']:.0f}%")
    if r.get("expert_load_max_over_mean") is not None:
        parts.append(f"load {r['expert_load_max_over_mean']:.1f}x")
    if r.get("videos"):  # what the step trained on, beside the images, where it had videos
        parts.append(
            f"img {r.get('images', 0)} vid {r['videos']} ({fmt_count(r['video_tokens'])} tok)"
        )
    parts.append(f"skipped {r.get('bad_samples', 0)}")
    if r.get("nonfinite_steps"):
        parts.append(f"nonfinite {r['nonfinite_steps']}")
    return " | ".join(parts)


def _step_of_line(line: str) -> float:
    """The step of a metrics.jsonl line (a torn last line counts as after everything)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


class LogWriteError(RuntimeError):
    """metrics.jsonl or TensorBoard could not be written (a full disk, most often): the trainer stops
    with one line and ExitCode.CHECKPOINT; the checkpoints are intact."""


class MetricsLogger:
    """metrics.jsonl + TensorBoard (run_dir/tb) + W&B (`wandb`: a moevlm.train.wandb_log.WandbLog, or
    anything with `log(scalars, step)` and `finish()`) + console (tqdm bar on a TTY); rank 0 only."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        total_steps: int,
        log_every: int,
        tensorboard: bool = True,
        progress: bool | None = None,
        wandb=None,
        world_size: int = 1,
    ):
        self.total_steps, self.log_every = total_steps, max(1, log_every)
        self.world_size = world_size
        # (time, step) of this launch's first record: the console's ETA is the rate since then
        self._since: tuple[float, int] | None = None
        self.active = rank == 0
        self._file = self._tb = self._bar = None
        self.tb_failed: LogWriteError | None = None
        self._wandb = wandb if self.active else None
        if not self.active:
            return
        self.run_dir = run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = self._open()
        if tensorboard:
            self._tb = self._writer()
        if progress if progress is not None else sys.stdout.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, dynamic_ncols=True)

    def _open(self):
        """metrics.jsonl for appending, readable too: if the file is deleted mid-run, what it held is
        still read through this handle (`_reopen_if_gone`)."""
        return open(self.run_dir / "metrics.jsonl", "a+", buffering=1)

    def _reopen_if_gone(self) -> None:
        """metrics.jsonl deleted or renamed away since it was opened (the handle's inode no longer at the
        path): write what the handle holds to a new file there and append to that; one line says so.  A
        stat and an fstat per logged record."""
        path = self.run_dir / "metrics.jsonl"
        held = os.fstat(self._file.fileno())
        try:
            now = os.stat(path)
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                return
            replaced = True  # another file at the path: it is kept, ours is appended to it
        except FileNotFoundError:
            replaced = False
        self._file.seek(0)
        old = self._file.read()
        self._file.close()
        self._file = self._open()
        self._file.write(old)
        self.info(
            f"{path} was {'replaced' if replaced else 'deleted'} during the run: "
            f"{'appended' if replaced else 'written again'} with its {old.count(chr(10))} earlier "
            "records, and logging goes on there"
        )

    def _writer(self, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=purge_step)

    def resume_at(self, step: int, abandoned: Path | None = None) -> int:
        """The run continues after `step`: drop the records of later steps (a crashed run logged them
        and they will be logged again) from metrics.jsonl, and have TensorBoard discard its events
        after `step` (its purge_step).  `abandoned`: a folder that receives the whole file first (the
        records of a line of history the run abandons).  Returns the number of records dropped."""
        if not self.active:
            return 0
        path = self.run_dir / "metrics.jsonl"
        self._file.close()
        lines = path.read_text().splitlines(keepends=True)
        steps = [_step_of_line(ln) for ln in lines]
        keep = [ln for ln, s in zip(lines, steps) if s <= step]
        if len(keep) < len(lines):
            if abandoned is not None:
                Path(abandoned).mkdir(parents=True, exist_ok=True)
                (Path(abandoned) / "metrics.jsonl").write_text("".join(lines))
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(keep))
            os.replace(tmp, path)
            if self._tb is not None:
                self._tb.close()
                self._tb = self._writer(purge_step=step + 1)
            last = max((s for s in steps if math.isfinite(s)), default=step)
            if self._wandb is not None and last > step:
                self.info(
                    f"W&B cannot drop history: its steps {step + 1}..{last} keep the values logged before "
                    "this resume (metrics.jsonl and TensorBoard have the new ones)"
                )
        self._file = self._open()
        return len(lines) - len(keep)

    def should_log(self, step: int) -> bool:
        """Every log_every steps, the first and the last (the trainer builds records only then)."""
        return step % self.log_every == 0 or step in (1, self.total_steps)

    def log(self, record: dict) -> None:
        if not self.active:
            return
        step, values = record["step"], scalars(record)
        try:
            self._reopen_if_gone()
            self._file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
            self._file.flush()
        except OSError as err:
            raise LogWriteError(write_failed_line(err, self.run_dir / "metrics.jsonl")) from None
        if self._tb is not None:
            try:
                for tag, value in values.items():
                    self._tb.add_scalar(tag, value, step)
                self._tb.flush()
            except OSError as err:
                # raised by `check_tensorboard` once a checkpoint due at this step is written
                self._tb = None  # closing it would only fail again
                self.tb_failed = LogWriteError(write_failed_line(err, self.run_dir / "tb"))
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        if self._bar is not None:
            self._bar.update(max(0, step - self._bar.n))
        self.info(console_line(record, self.total_steps, self._eta(record), self.world_size))

    def check_tensorboard(self) -> None:
        """Raises the TensorBoard write failure `log` met, if any (LogWriteError: exit 7).  The trainer
        calls it after the checkpoint due at the step, so that a failure there never skips one."""
        if self.tb_failed is not None:
            err, self.tb_failed = self.tb_failed, None
            raise err

    def _eta(self, record: dict) -> float | None:
        """Seconds to train.steps: the steps left at the mean wall time per step since this launch's
        first record (validation and checkpoints included); None (shown `?`) at that first record,
        whose step time holds the warm-up (compilation, the first allocations, the loader's start)."""
        now, step = time.perf_counter(), record["step"]
        if self._since is None:
            self._since = (now, step)
        t0, step0 = self._since
        if step <= step0:
            return None
        return (now - t0) / (step - step0) * max(self.total_steps - step, 0)

    def info(self, msg: str) -> None:
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        # a TensorBoard failure the run never reached check_tensorboard for (a signal, non-finite values)
        if self.tb_failed is not None:
            print(f"TensorBoard: {self.tb_failed}", file=sys.stderr, flush=True)
            self.tb_failed = None
        for h in (self._bar, self._tb, self._file):
            if h is not None:
                try:
                    h.close()
                except OSError:  # a full disk, already reported by the write that met it
                    pass
        if self._wandb is not None:
            self._wandb.finish()
        self._file = self._tb = self._bar = self._wandb = None
        self.active = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
