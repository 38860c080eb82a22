"""The fit check: the cheapest changes that make a job fit a GPU, each with what it costs.

    result = fit(job, world=8, gpu_name="h100")    # FitResult: the job as it is, every change tried
    print(format_fit(result, "+experiment=h100_fsdp"))

Changes come from `CHANGES`, one row per kind, tried in the guidance's order (`Change.step`):
selective then full recompute, the smallest added parallelism, lighter state, offloading last.  Each
setting is estimated as the layout search estimates a layout (moevlm.plan.extrapolate: pp rank 0 at
the real size; moevlm.plan.step_time: its step time).  A step that makes nothing fit hands its
most memory-saving setting on to the next.  Costs: recompute FLOPs, communication (wire bytes per
GPU), host copies (bytes per step at HOST_GBPS), each also as seconds added to the modelled step.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from moevlm.errors import ConfigError
from moevlm.plan.candidates import Layout
from moevlm.plan.devices import Gpu, gpu
from moevlm.plan.extrapolate import HOST, Extrapolator
from moevlm.plan.search import _comm_dict, _gib, _last_line, _s
from moevlm.plan.step_time import StepTimeModel, group_ranks, wire_bytes

GIB = 2**30
HOST_GBPS = (
    50.0  # host<->device copies, GB/s each way (PCIe Gen5 x16, sustained): their cost in seconds
)
SELECTIVE = (("moe_act",), ("moe_act", "layernorm"), ("moe_act", "layernorm", "core_attn"))
PARALLEL = ("ep", "pp", "tp", "cp")  # the dims an added parallelism doubles, in this order on a tie
# the job fields a `Layout` sets (one Extrapolator serves the settings differing only in these)
LAYOUT_FIELDS = frozenset(
    {f"parallel.{d}" for d in ("tp", "cp", "pp", "vpp", "ep", "etp", "dp_mode", "dp_replicate")}
    | {"model.recompute", "train.micro_batch_size"}
)


# ------------------------------------------------------------------ the table of changes
def _recompute(job, world: int, g: Gpu) -> list[dict]:
    """Selective regions (nested, cheapest first: moe_act, + layernorm, + core_attn), then full, then
    full with the collectives reissued (where the layers exchange: ep, tp or cp > 1); only those that
    recompute more than the job does."""
    m, p = job.model, job.parallel
    out = []
    if m.recompute != "full":
        have = set(m.recompute_modules or ()) if m.recompute == "selective" else set()
        out = [
            {"model.recompute": "selective", "model.recompute_modules": list(mods)}
            for mods in SELECTIVE
            if not set(mods) <= have
        ]
        out.append({"model.recompute": "full"})
    if max(p.ep, p.tp, p.cp) > 1 and m.recompute_collectives == "save":
        # then the layers' exchanges too: each keeps its input only (moevlm.parallel.recompute)
        out.append({"model.recompute": "full", "model.recompute_collectives": "reissue"})
    return out


def _parallel(job, world: int, g: Gpu) -> list[dict]:
    """One dim of the layout doubled, then quadrupled...: settings in rounds of growing factor (each
    round a list; `fit` stops at the first round where one fits)."""
    p, limit = job.parallel, {"tp": min(8, g.domain)}
    rounds, factor = [], 2
    while factor <= world:
        dims = [d for d in PARALLEL if getattr(p, d) * factor <= limit.get(d, world)]
        rounds.append([_times(p, d, factor, world) for d in dims])
        factor *= 2
    return rounds


def _times(p, dim: str, factor: int, world: int) -> dict:
    """`dim` times `factor`; more pipeline stages leave fewer ranks per stage, so ep (x etp) shrinks to
    what a stage holds."""
    out = {f"parallel.{dim}": getattr(p, dim) * factor}
    per_stage = world // (p.pp * factor) if dim == "pp" else None
    if per_stage and (p.ep * p.etp) > per_stage:
        out["parallel.ep"] = math.gcd(p.ep, max(per_stage // p.etp, 1))
    return out


def _optimizer_offload(job, world: int, g: Gpu) -> list[dict]:
    return [] if job.parallel.optimizer_offload else [{"parallel.optimizer_offload": True}]


def _activation_offload(job, world: int, g: Gpu) -> list[dict]:
    """The decoder layers' inputs (what full recompute keeps) to host memory."""
    if "layer_input" in (job.model.offload_modules or ()):
        return []
    return [{"model.offload_modules": [*(job.model.offload_modules or ()), "layer_input"]}]


def _chunked_loss(job, world: int, g: Gpu) -> list[dict]:
    """The LM head's loss over token chunks (no micro-batch's whole logits), where it is off."""
    return [{"model.loss_chunk_tokens": 1024}] if job.model.loss_chunk_tokens == 0 else []


def _lighter_state(job, world: int, g: Gpu) -> list[dict]:
    """Nested: bf16 optimizer moments, then bf16 weights with fp32 masters in the optimizer too (where
    the build takes them: bf16 compute, no pipeline stages, no optimizer offload)."""
    o, p = job.optim, job.parallel
    if o.implementation == "fused":
        return []
    out = [] if o.state_dtype == "bfloat16" else [{"optim.state_dtype": "bfloat16"}]
    if (
        not o.master_weights
        and p.pp == 1
        and not p.optimizer_offload
        and job.train.precision != "fp32"
    ):
        out.append({"optim.state_dtype": "bfloat16", "optim.master_weights": True})
    return out


@dataclass(frozen=True)
class Change:
    """One kind of change: its step in the guidance's order, the settings it tries (job fields ->
    values; a list of rounds when `rounds`), what it costs, and whether its settings are nested (each
    saves what the one before saves, and costs more: the first that fits is the cheapest)."""

    step: int  # 1 recompute, 2 parallelism, 3 lighter state, 4 offload
    name: str
    settings: Callable[[object, int, Gpu], list]
    cost: str  # recompute | communication | precision | host copies
    nested: bool = False
    rounds: bool = False


CHANGES = (
    Change(1, "chunked loss", _chunked_loss, "recompute"),
    Change(1, "recompute", _recompute, "recompute", nested=True),
    Change(2, "added parallelism", _parallel, "communication", rounds=True),
    Change(3, "lighter state", _lighter_state, "precision", nested=True),
    Change(4, "optimizer offload", _optimizer_offload, "host copies"),
    Change(4, "activation offload", _activation_offload, "host copies"),
)


# ------------------------------------------------------------------ one estimate
@dataclass
class Tried:
    """A setting of the job (the original's `changes` empty) and its estimate, costs against the job."""

    step: int
    name: str
    changes: dict  # job field -> value, cumulative
    peak_bytes: float = 0.0
    fits: bool = False
    step_s: float = 0.0
    recompute_s: float = 0.0  # added over the job as it is
    recompute_flops: float = 0.0  # added forward FLOPs per GPU and step
    comm_wire_bytes: float = 0.0  # added, per GPU and step
    comm_s: float = 0.0  # added exposed + overlapped seconds
    host_bytes: float = 0.0  # host<->device copies per step (both ways)
    step_s_added: float = 0.0  # the modelled step's increase
    error: str | None = None

    @property
    def cost_s(self) -> float:
        """What the change adds to a step: the modelled step time's increase and the host copies."""
        return self.step_s_added + self.host_bytes / (HOST_GBPS * 1e9)

    def overrides(self) -> list[str]:
        return [f"{k}={_render(v)}" for k, v in self.changes.items()]

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out["overrides"] = self.overrides()
        out["cost_s"] = self.cost_s
        return out


def _render(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(map(str, v)) + "]"
    return str(v)


def apply_changes(job, changes: dict, world: int):
    """A copy of `job` (a JobConfig object) with `changes` set and laid out on `world` ranks."""
    job = copy.deepcopy(job)
    for key, value in changes.items():
        *path, name = key.split(".")
        node = job
        for part in path:
            node = getattr(node, part)
        setattr(node, name, list(value) if isinstance(value, (list, tuple)) else value)
    job.parallel.dp, job.parallel.world_size, job.parallel.scale_to = -1, world, None
    return job


class _Estimator:
    """Estimates per distinct job (one Extrapolator each: its dry runs cached per layout)."""

    def __init__(self, job, world: int, g: Gpu):
        self.job, self.world, self.g = job, world, g
        self.extrapolators: dict = {}
        self.dry_runs, self.dry_run_s = 0, 0.0
        self.base: Tried | None = None

    def estimate(self, step: int, name: str, changes: dict) -> Tried:
        from moevlm.config import validate

        tried = Tried(step, name, dict(changes))
        job = apply_changes(self.job, changes, self.world)
        try:
            plan = validate(job, self.world, environment=False)
            layout = Layout.of(job)
            key = repr({k: v for k, v in changes.items() if k not in LAYOUT_FIELDS})
            ext = self.extrapolators.setdefault(key, Extrapolator(job, self.world))
            runs, run_s = ext.runs, ext.run_s
            try:
                q = ext.estimate(layout, plan)
            finally:
                self.dry_runs += ext.runs - runs
                self.dry_run_s += ext.run_s - run_s
        except (ConfigError, ValueError) as err:
            tried.error = f"invalid: {str(err).strip().splitlines()[0]}"
            return tried
        except Exception as err:  # noqa: BLE001 - a dry run's kernels and shapes raise many kinds
            tried.error = f"dry run failed: {_last_line(err)}"
            return tried
        comm = _comm_dict(q)
        timer = StepTimeModel(job, self.world, self.g)
        t = timer.step(layout, plan, comm)
        again = timer.flops(plan, layout)[1]
        tried.peak_bytes = q["peak_bytes"]
        tried.fits = self.g.fits(q["peak_bytes"])
        tried.step_s = t["step_s"]
        tried.recompute_s = t["recompute_s"]
        tried.recompute_flops = again * plan.grad_accum * plan.dims.dp / self.world
        tried.comm_s = t["exposed_comm_s"] + t["overlapped_comm_s"]
        tried.comm_wire_bytes = sum(
            wire_bytes(kind, b, len(group_ranks(group, plan.dims)))
            for group, kinds in comm.items()
            for kind, b in kinds.items()
        )
        # the activation offload's copies go to the host and come back
        tried.host_bytes = sum(q.get(k, 0.0) for k in HOST) + q.get("activation_offload_bytes", 0.0)
        if self.base is not None:  # costs against the job as it is
            b = self.base
            tried.step_s_added = tried.step_s - b.step_s
            tried.recompute_s -= b.recompute_s
            tried.recompute_flops -= b.recompute_flops
            tried.comm_s -= b.comm_s
            tried.comm_wire_bytes -= b.comm_wire_bytes
            tried.host_bytes -= b.host_bytes
        return tried


# ------------------------------------------------------------------ the check
@dataclass
class FitResult:
    world: int
    gpu: Gpu
    usable_bytes: float
    base: Tried  # the job as it is
    tried: list[Tried] = field(default_factory=list)  # every change estimated, in cost order
    dry_runs: int = 0
    seconds: float = 0.0

    @property
    def proposal(self) -> Tried | None:
        """The cheapest change that fits (None: the job fits as it is, or nothing tried fits)."""
        return next((t for t in self.tried if t.fits), None)

    @property
    def fits(self) -> bool:
        return self.base.fits or self.proposal is not None

    def as_dict(self) -> dict:
        return {
            "world": self.world,
            "gpu": self.gpu.name,
            "usable_bytes": self.usable_bytes,
            "fits_as_it_is": self.base.fits,
            "base": self.base.as_dict(),
            "proposal": None if self.proposal is None else self.proposal.as_dict(),
            "tried": [t.as_dict() for t in self.tried],
            "dry_runs": self.dry_runs,
            "seconds": self.seconds,
        }


def order_key(t: Tried) -> tuple:
    """The listing's order: the guidance's step, then what the change costs; failures last."""
    return (t.error is not None, t.step, t.cost_s)


def fit(job, world: int, gpu_name: str | Gpu, progress=None) -> FitResult:
    """The job as it is on `world` GPUs `gpu_name`, and, when it does not fit, the changes of `CHANGES`
    in their order until some fit (module docstring).  `job`: a composed job (DictConfig or JobConfig)."""
    from omegaconf import OmegaConf

    t0 = time.perf_counter()
    if OmegaConf.is_config(job):
        job = OmegaConf.to_object(job)
    g = gpu_name if isinstance(gpu_name, Gpu) else gpu(gpu_name)
    est = _Estimator(job, world, g)
    base = est.estimate(0, "as it is", {})
    if base.error is not None:
        raise ValueError(f"the job as it is: {base.error}")
    est.base = base
    say = progress or (lambda line: None)
    tried: list[Tried] = []
    held, held_peak = {}, base.peak_bytes  # the changes handed on from the steps before
    for step in [] if base.fits else sorted({c.step for c in CHANGES}):
        results = []
        for change in (c for c in CHANGES if c.step == step):
            settings = change.settings(apply_changes(job, held, world), world, g)
            for group in settings if change.rounds else [settings]:
                found = False
                for setting in group:
                    t = est.estimate(step, change.name, {**held, **setting})
                    say(_progress_line(t, est.dry_runs))
                    results.append(t)
                    found = found or t.fits
                    if change.nested and t.fits:
                        break
                if found:  # rounds: the smallest factor that fits
                    break
        tried += results
        if any(t.fits for t in results):
            break
        good = [t for t in results if t.error is None]
        best = min(good, key=lambda t: t.peak_bytes, default=None)
        if best is not None and best.peak_bytes < held_peak:
            held, held_peak = dict(best.changes), best.peak_bytes
    tried.sort(key=order_key)
    return FitResult(
        world=world,
        gpu=g,
        usable_bytes=g.memory_bytes - g.headroom_bytes,
        base=base,
        tried=tried,
        dry_runs=est.dry_runs,
        seconds=time.perf_counter() - t0,
    )


def _progress_line(t: Tried, runs: int) -> str:
    what = t.error or f"peak {t.peak_bytes / GIB:.1f} GiB{'' if t.fits else ', does not fit'}"
    return f"fit: {' '.join(t.overrides())}: {what} ({runs} dry runs)"


# ------------------------------------------------------------------ the report
def _delta(b: float) -> str:
    return "0" if not b else ("+" if b > 0 else "-") + _gib(abs(b))


def _signed(seconds: float) -> str:
    return ("+" if seconds >= 0 else "-") + _s(abs(seconds))


def format_fit(result: FitResult, command: str = "") -> str:
    """Markdown: the job as it is, every change tried in cost order with its costs, the proposal."""
    r, b = result, result.base
    lines = [
        f"## Fit check on {r.world} x {r.gpu.name} ({_gib(r.usable_bytes)} GiB usable per GPU)",
        "",
        f"as it is: peak {_gib(b.peak_bytes)} GiB (pp rank 0, extrapolated), step {_s(b.step_s)} s: "
        + ("fits" if b.fits else "does NOT fit"),
    ]
    if not b.fits:
        lines += [
            "",
            "| # | step | change | peak GiB | fits | recompute TFLOP/GPU | recompute s "
            "| comm wire GiB/GPU | comm s | host copies GiB | step s | cost s |",
            "|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for i, t in enumerate(r.tried, 1):
            change = " ".join(t.overrides()).replace("|", "/")
            if t.error is not None:
                lines.append(f"| {i} | {t.step} | {change} | - | {t.error} |" + " |" * 7)
                continue
            lines.append(
                f"| {i} | {t.step} | {change} | {_gib(t.peak_bytes)} | "
                f"{'yes' if t.fits else 'no'} | {t.recompute_flops / 1e12:+.3g} | "
                f"{_signed(t.recompute_s)} | {_delta(t.comm_wire_bytes)} | {_signed(t.comm_s)} | "
                f"{_delta(t.host_bytes)} | {_s(t.step_s)} | {_signed(t.cost_s)} |"
            )
        lines += [
            "",
            "steps: 1 recompute, 2 added parallelism, 3 lighter state, 4 offload (the guidance's "
            "order); costs are against the job as it is; cost s = the modelled step's increase + the "
            f"host copies at {HOST_GBPS:g} GB/s (moevlm.plan.fit).",
        ]
    p = r.proposal
    if b.fits:
        lines += ["", "verdict: fits as it is; nothing to change"]
    elif p is None:
        lines += [
            "",
            "verdict: no change tried makes it fit; more GPUs (--world) or shorter budgets",
        ]
    else:
        lines += [
            "",
            f"proposal: {' '.join(p.overrides())} (peak {_gib(p.peak_bytes)} GiB, "
            f"step {_s(p.step_s)} s, cost {_signed(p.cost_s)} s)",
            "  " + " ".join(x for x in ("python -m moevlm.plan", command, *p.overrides()) if x),
        ]
    lines.append(f"({r.dry_runs} dry runs, {r.seconds:.0f} s)")
    return "\n".join(lines)
