"""AdamW and the learning-rate schedules.

    opt = build_optimizer(model, job.optim)            # AdamW over decay / no-decay groups
    sched = build_scheduler(opt, job.optim, steps)     # warmup, then cosine | wsd | constant
    notes = fit_resumed_schedule(sched, job.optim, steps)   # after a resume: rescaled to `steps`

No weight decay for parameters of fewer than 2 dimensions or whose name contains `embed`, unless
`optim.decay_norms_biases_embeddings=true`; each group is split further by device mesh.  Moments in
bf16 (`optim.state_dtype`): moevlm.train.adamw; fp32 masters of bf16 weights (`optim.master_weights`):
moevlm.parallel.master_weights.  Why: docs/architecture.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from moevlm.errors import ConfigError
from moevlm.parallel.optimizer_offload import fused_adamw_available
from moevlm.train.adamw import AdamW


def param_groups(model: nn.Module, o) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        exempt = p.ndim < 2 or "embed" in name
        (no_decay if exempt and not o.decay_norms_biases_embeddings else decay).append(p)
    groups = []
    for name, params, wd in (("decay", decay, o.weight_decay), ("no_decay", no_decay, 0.0)):
        for kind, members in _by_layout(params).items():
            groups.append({"params": members, "weight_decay": wd, "name": name + kind})
    return groups


def _by_layout(params: list) -> dict[str, list]:
    """Plain tensors and DTensors of each device mesh apart: the fused and foreach
    kernels take one kind per call (a mixed list is refused under DDP-style data
    parallel, where only the sharded weights are DTensors)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, list] = {}
    for p in params:
        key = (
            ""
            if not isinstance(p, DTensor)
            else "/" + "x".join(p.device_mesh.mesh_dim_names or ("mesh",))
        )
        out.setdefault(key, []).append(p)
    return out


def build_optimizer(model: nn.Module, o, offload: bool = False):
    """AdamW over `model`'s trainable parameters.  `offload` (parallel.optimizer_offload under DDP or one
    process): the same AdamW over host fp32 masters (moevlm.parallel.optimizer_offload); under FSDP's
    CPU offload policy the parameters are on the host already and `offload` stays False.
    `optim.master_weights` (bf16 parameters): the AdamW over fp32 masters of this rank's shards
    (moevlm.parallel.master_weights); `optim.state_dtype=bfloat16`: moments in bf16 (moevlm.train.adamw)."""
    if offload:
        from moevlm.parallel.optimizer_offload import HostOffloadAdamW

        return HostOffloadAdamW(model, lambda module: _adamw(module, o))
    if o.master_weights:
        from moevlm.parallel.master_weights import MasterWeightsAdamW

        return MasterWeightsAdamW(model, lambda module, grad_of: _adamw(module, o, grad_of))
    return _adamw(model, o)


def _adamw(model: nn.Module, o, grad_of=None) -> torch.optim.Optimizer:
    """torch's AdamW, or moevlm's (moevlm.train.adamw) for bf16 moments or gradients read elsewhere
    (`grad_of`: the fp32 masters of bf16 weights)."""
    groups = param_groups(model, o)
    if not groups:
        raise ConfigError("no trainable parameters (is everything frozen?)")
    if o.state_dtype != "float32" or grad_of is not None:
        return AdamW(
            groups,
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=0.0,  # each group's own (param_groups)
            state_dtype=getattr(torch, o.state_dtype),
            grad_of=grad_of,
        )
    kind = o.implementation
    if kind == "auto":
        device = groups[0]["params"][0].device
        kind = "fused" if fused_adamw_available(device) else "foreach"
    flags = {
        "fused": {"fused": True},
        "foreach": {"foreach": True},
        "for_loop": {"foreach": False},
    }[kind]
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, **flags)


class LRSchedule:
    """lr multiplier at step s (0-based: the multiplier of the first update is f(0))."""

    def __init__(self, o, steps: int):
        self.kind, self.steps, self.warmup = o.schedule, steps, o.warmup_steps
        self.min_ratio, self.decay_fraction, self.decay_shape = (
            o.min_lr_ratio,
            o.decay_fraction,
            o.decay_shape,
        )

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        if self.kind == "cosine":
            span = max(1, self.steps - self.warmup - 1)
            return self._down(min(1.0, (s - self.warmup) / span), "cosine")
        decay_steps = max(1, round(self.decay_fraction * self.steps))
        start = self.steps - decay_steps
        if s < start:
            return 1.0
        return self._down(min(1.0, (s - start + 1) / decay_steps), self.decay_shape)

    def _down(self, x: float, shape: str) -> float:
        """From 1 at x=0 to min_ratio at x=1."""
        frac = {
            "linear": 1 - x,
            "cosine": 0.5 * (1 + math.cos(math.pi * x)),
            "sqrt": 1 - math.sqrt(x),
        }[shape]
        return self.min_ratio + (1 - self.min_ratio) * frac


class Scheduler(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR with one schedule for every group, whose state does not depend on
    the number of parameter groups (they follow the parallel layout), so a
    checkpoint resumes under another layout.  Its state holds the schedule's
    fields, `steps` (the run length it was built for) included."""

    loaded_steps: int | None = (
        None  # the run length the loaded state was built for (None: not recorded)
    )

    def state_dict(self) -> dict:
        return {
            "last_epoch": self.last_epoch,
            "_step_count": self._step_count,
            "schedule": dict(self.lr_lambdas[0].__dict__),
        }

    def load_state_dict(self, state: dict) -> None:
        self.last_epoch, self._step_count = state["last_epoch"], state["_step_count"]
        schedule = state.get("schedule", {})
        for fn in self.lr_lambdas:
            fn.__dict__.update(schedule)
        self.loaded_steps = schedule.get("steps")
        self._set_lrs()

    def _set_lrs(self) -> None:
        factor = self.lr_lambdas[0](self.last_epoch)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]


def build_scheduler(opt: torch.optim.Optimizer, o, steps: int) -> Scheduler:
    # an offloaded optimizer's lr lives in its host AdamW's param_groups (the ones it exposes)
    # (a master-weights optimizer's: its `inner` AdamW's)
    inner = getattr(opt, "host", getattr(opt, "inner", opt))
    return Scheduler(inner, LRSchedule(o, steps))


# the optim field each schedule attribute comes from (for the resume notes)
_FIELDS = {
    "kind": "schedule",
    "warmup": "warmup_steps",
    "min_ratio": "min_lr_ratio",
    "decay_fraction": "decay_fraction",
    "decay_shape": "decay_shape",
}


def fit_resumed_schedule(
    sched: Scheduler, o, steps: int, saved_lr: float | None = None
) -> list[str]:
    """After `sched` was loaded from a checkpoint: run it to `steps` (train.steps), and return lines for
    the log.  A changed length rescales the schedule: it is rebuilt for `steps` and keeps its position
    (`last_epoch`, the updates taken), so the lr from here on is the one a fresh `steps`-long run has at
    the same step (warmup is counted in steps and unchanged; extending a cosine lifts the lr from the old
    curve's value to the new one's; extending a wsd run whose decay had begun returns it to the plateau).
    The other schedule fields stay the checkpoint's; a differing one is noted.  A state without its
    length (not written by this trainer) is assumed to be `steps` long.  `saved_lr`: the checkpoint's
    optim.lr (None: not recorded, taken as `o.lr`), so that "was" is the lr its run had next."""
    fn, fresh = sched.lr_lambdas[0], LRSchedule(o, steps)
    lines = [
        (
            f"note: optim.{field}={getattr(fresh, attr)!r} differs from the resumed schedule's "
            f"{getattr(fn, attr)!r}: the checkpoint's is kept"
        )
        for attr, field in _FIELDS.items()
        if getattr(fn, attr) != getattr(fresh, attr)
    ]
    old = sched.loaded_steps
    if old is None:
        return lines + [
            (
                f"note: the checkpoint does not record its lr schedule's length; assumed "
                f"train.steps={steps}, as now"
            )
        ]
    if old == steps:
        return lines
    # the loaded position on the old curve, scaled to the old run's peak lr (optim.lr may change too)
    before = sched.get_last_lr()[0] * (saved_lr / o.lr if saved_lr else 1.0)
    for f in sched.lr_lambdas:
        f.steps = steps
    sched._set_lrs()
    return lines + [
        (
            f"train.steps changed from {old} to {steps}: the {fn.kind} lr schedule is rescaled to {steps} "
            f"steps; the next update's lr is {sched.get_last_lr()[0]:.3e} (was {before:.3e})"
        )
    ]
