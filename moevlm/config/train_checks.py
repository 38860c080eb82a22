"""Checks of the loop's settings: batch and steps, the optimizer and schedule, fault handling,
validation, profiling; each raises ConfigError, or returns notes for the log (valid but probably
unintended settings).  Every real-valued field must be a finite number in its range: Python's
comparisons are False for NaN, so each range test is written to fail on it."""

from __future__ import annotations

import math

from moevlm.config.sections import RESUME_CHANGES
from moevlm.errors import ConfigError, check
from moevlm.fields import is_int, is_real
from moevlm.parallel.mesh import ParallelDims


def check_batch(t, dims: ParallelDims) -> None:
    check(t.steps >= 1, f"train.steps={t.steps} must be >= 1")
    check(t.micro_batch_size >= 1, f"train.micro_batch_size={t.micro_batch_size} must be >= 1")
    per_step = t.micro_batch_size * dims.dp
    check(
        t.global_batch_size >= per_step and t.global_batch_size % per_step == 0,
        f"train.global_batch_size={t.global_batch_size} must be a multiple of micro_batch_size x dp = "
        f"{t.micro_batch_size} x {dims.dp} = {per_step}; e.g. train.global_batch_size="
        f"{max(1, math.ceil(t.global_batch_size / per_step)) * per_step}",
    )
    check(t.log_every >= 1, f"train.log_every={t.log_every} must be >= 1")
    check(
        t.checkpoint_every >= 0,
        f"train.checkpoint_every={t.checkpoint_every} must be >= 0 (0 = at the end)",
    )
    check(
        t.resume in ("auto", "none") or bool(t.resume),
        "train.resume must be auto, none or a checkpoint path",
    )
    allow = list(t.resume_allow_changes or [])
    check(
        set(allow) <= set(RESUME_CHANGES),
        f"train.resume_allow_changes={allow}: each must be tokenizer or architecture (what a resume "
        "refuses unless told; every other change is only noted)",
    )
    check(
        t.max_nonfinite_steps >= 1,
        f"train.max_nonfinite_steps={t.max_nonfinite_steps} must be >= 1",
    )
    check(
        t.peak_tflops is None or is_real(t.peak_tflops) and t.peak_tflops > 0,
        f"train.peak_tflops={t.peak_tflops!r} must be a finite number > 0 (TFLOP/s per device), or null for "
        "the device table",
    )


def check_optim(o, steps: int) -> list[str]:
    """Every real-valued field must be a finite number in its range: Python's comparisons are False for
    NaN, so each range test is written to fail on it, and infinities are refused by name.  Returns notes
    (valid but probably unintended settings) for the log."""
    check(is_real(o.lr) and o.lr > 0, f"optim.lr={o.lr!r} must be a finite number > 0")
    check(
        is_real(o.min_lr_ratio) and 0 <= o.min_lr_ratio <= 1,
        f"optim.min_lr_ratio={o.min_lr_ratio!r} must be a number in [0, 1] (final lr = lr x min_lr_ratio)",
    )
    betas = list(o.betas)
    check(
        len(betas) == 2 and all(is_real(b) and 0 <= b < 1 for b in betas),
        f"optim.betas={betas} must be two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]",
    )
    check(
        is_real(o.eps) and o.eps > 0,
        f"optim.eps={o.eps!r} must be a finite number > 0 (AdamW divides by sqrt(v) + eps), e.g. optim.eps=1e-8",
    )
    check(
        is_real(o.weight_decay) and o.weight_decay >= 0,
        f"optim.weight_decay={o.weight_decay!r} must be a finite number >= 0 (0 = no decay)",
    )
    check(
        is_int(o.warmup_steps) and o.warmup_steps >= 0,
        f"optim.warmup_steps={o.warmup_steps!r} must be >= 0",
    )
    check(
        is_real(o.decay_fraction) and 0 < o.decay_fraction <= 1,
        f"optim.decay_fraction={o.decay_fraction!r} must be a number in (0, 1]",
    )
    check(
        is_real(o.grad_clip),
        f"optim.grad_clip={o.grad_clip!r} must be a finite number (the max gradient norm; 0 or less disables "
        "clipping)",
    )
    # the multiplier after warmup step s is (s + 1) / warmup: 1 at s = warmup - 1
    if o.warmup_steps > steps:
        return [
            f"note: optim.warmup_steps={o.warmup_steps} > train.steps={steps}: the learning rate never "
            f"reaches optim.lr={o.lr} in this run"
        ]
    return []


def check_faults(p, t) -> None:
    check(
        is_real(p.timeout_s) and p.timeout_s > 0,
        f"parallel.timeout_s={p.timeout_s} must be > 0 seconds (torch's NCCL default is 600)",
    )
    check(
        is_real(t.watchdog_factor) and (t.watchdog_factor == 0 or t.watchdog_factor > 1),
        f"train.watchdog_factor={t.watchdog_factor} must be > 1 (x the median step time) or 0 (no reports)",
    )
    check(
        is_real(t.watchdog_min_s) and t.watchdog_min_s >= 0,
        f"train.watchdog_min_s={t.watchdog_min_s} must be >= 0",
    )
    check(
        t.watchdog_abort_s is None or is_real(t.watchdog_abort_s) and t.watchdog_abort_s > 0,
        f"train.watchdog_abort_s={t.watchdog_abort_s} must be > 0 seconds, or null (never abort)",
    )


def check_validation(t, d) -> list[str]:
    """train.val_every / val_batches against data.val_shards; a note when held-out shards are named but
    never read."""
    check(
        t.val_every >= 0,
        f"train.val_every={t.val_every} must be >= 0 (steps between validations; 0 = off)",
    )
    check(
        t.val_batches >= 1,
        f"train.val_batches={t.val_batches} must be >= 1 (global batches of held-out rows per "
        "validation)",
    )
    check(
        not t.val_every or bool(d.val_shards),
        f"train.val_every={t.val_every} validates on data.val_shards, which is not set: point "
        "data.val_shards at held-out shards (a folder, a brace pattern, a list, or sample), or set "
        "train.val_every=0",
    )
    if d.val_shards and not t.val_every:
        return [
            f"note: data.val_shards={d.val_shards} is set but train.val_every=0: no validation runs "
            "(set train.val_every=N to validate every N steps)"
        ]
    return []


def check_profile(t) -> None:
    parse_profile_steps(t.profile_steps, t.steps)
    check(
        not (t.profile_components and t.compile),
        "train.profile_components=true times modules with hooks, which would break the graphs of "
        "train.compile=true; profile eagerly (train.compile=false), or drop train.profile_components",
    )


def parse_profile_steps(value, steps: int) -> tuple[int, int] | None:
    """train.profile_steps as (A, B), or None when off; ConfigError naming the value otherwise."""
    if value is None or value == "" or (not isinstance(value, (str, int)) and len(value) == 0):
        return None
    how = f"give two steps A,B with 1 <= A <= B <= train.steps={steps}, e.g. train.profile_steps=[3,5]"
    try:
        if isinstance(value, bool):
            raise ValueError
        parts = (
            [value]
            if isinstance(value, int)
            else value.split(",")
            if isinstance(value, str)
            else list(value)
        )
        nums = [int(str(p).strip()) for p in parts]
    except (ValueError, TypeError):
        raise ConfigError(f"train.profile_steps={value!r} is not a step range; {how}") from None
    if len(nums) == 1:
        nums *= 2
    if len(nums) != 2 or not 1 <= nums[0] <= nums[1] <= steps:
        raise ConfigError(
            f"train.profile_steps={value!r} is not a step range within this run; {how}"
        )
    return nums[0], nums[1]
