"""The layouts of a job on `world` GPUs of one kind: enumerated, checked, fitted, timed, ranked.

    result = search(job, world=16, gpu_name="h100", top=10)   # SearchResult
    print(format_search(result))     # the top layouts as a markdown table, then what was left out
    result.as_dict()                 # JSON-able
    search(job, 16, "h100", full_space=True)                  # the whole space (slower)
    search(job, 16, "h100", fields={"dp_mode": ["fsdp", "ddp"], "pp": [1]})

Legend: M micro-batches per step and data-parallel rank.  Candidates come from
`moevlm.plan.candidates`, memory and collectives from `moevlm.plan.extrapolate`, step times from
`moevlm.plan.step_time`; the branch and bound: docs/architecture.md, "The planner".
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import re
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from moevlm.plan.candidates import (
    RECOMPUTE,
    Layout,
    Left,
    candidate_space,
    enumerate_layouts,
    resolve_replicas,
)
from moevlm.plan.devices import Gpu, gpu
from moevlm.plan.extrapolate import MEMORY, Extrapolator, add_vision
from moevlm.plan.step_time import StepTimeModel

GIB = 2**30


@dataclass
class Estimate:
    """A layout that fits, with its memory (pp rank 0, extrapolated) and its modelled step time."""

    layout: Layout
    dp: int
    grad_accum: int  # micro-batches per step and data-parallel rank (M)
    bubble: float
    peak_bytes: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_peak_bytes: int
    comm_bytes: dict  # group role -> collective -> bytes per step (rank 0)
    compute_s: float
    recompute_s: float
    busy_s: float
    exposed_comm_s: float
    overlapped_comm_s: float
    step_s: float
    tokens_per_s: float
    mfu: float

    def as_dict(self) -> dict:
        out = asdict(self)
        out["layout"] = asdict(self.layout) | {"schedule": self.layout.schedule}
        return out


@dataclass
class SearchResult:
    """What `search` found: the top estimates, every other candidate with its reason (`rejected`:
    invalid, does not fit, dry run failed; `skipped`: dominated, bounded out, not evaluated), and
    what the search cost."""

    world: int
    gpu: Gpu
    usable_bytes: float
    top: list[Estimate]
    rejected: list[Left]  # invalid, or does not fit
    skipped: list[Left]
    candidates: int
    valid: int
    screened: int  # candidates with a reduced-tower estimate (a lower bound)
    evaluated: int  # candidates with the full estimate (the vision term added)
    dry_runs: int
    dry_run_s: float
    seconds: float
    complete: bool  # the top is exact under the model (not cut short by max_dry_runs)
    space: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "world": self.world,
            "gpu": asdict(self.gpu),
            "usable_bytes": self.usable_bytes,
            "top": [e.as_dict() for e in self.top],
            "rejected": [r.as_dict() for r in self.rejected],
            "skipped": [s.as_dict() for s in self.skipped],
            "candidates": self.candidates,
            "valid": self.valid,
            "screened": self.screened,
            "evaluated": self.evaluated,
            "dry_runs": self.dry_runs,
            "dry_run_s": self.dry_run_s,
            "seconds": self.seconds,
            "complete": self.complete,
            "space": self.space,
        }


def _last_line(err: Exception) -> str:
    """An error from inside a dry run: its last line, without the rank prefixes torch adds."""
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else type(err).__name__
    return re.sub(r"^(\[rank\d+\]:\s*)+", "", text).strip()


# ------------------------------------------------------------------ the search
@contextlib.contextmanager
def _quiet_threads(n: int):
    """n torch threads, and fake tensors' error log silenced (a failing dry run is reported as a
    rejection with its error, not as a page of traceback per attempt); both restored after."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    before, level = torch.get_num_threads(), log.level
    torch.set_num_threads(n)
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        log.setLevel(level)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}" if nbytes >= GIB else f"{nbytes / GIB:.3g}"


def _comm_dict(q: dict) -> dict:
    out: dict = {}
    for k, v in sorted((k, v) for k, v in q.items() if isinstance(k, tuple)):
        if round(v):
            out.setdefault(k[1], {})[k[2]] = round(v)
    return out


class _Search:
    """The branch and bound of `search` (docs/architecture.md).  A candidate's state: None (nothing
    known: bound = busy time), "lower" (its reduced-tower estimate, a lower bound of memory and
    traffic: bound = the step time from it) or "exact" (fits: bound = its step time)."""

    def __init__(self, plans, order, ext, timer, g: Gpu, max_dry_runs, progress):
        self.plans, self.order, self.ext, self.timer, self.g = plans, order, ext, timer, g
        self.usable = g.memory_bytes - g.headroom_bytes
        self.max_dry_runs, self.progress = max_dry_runs, progress
        self.runs0 = ext.runs
        self.state: dict = {}
        self.lower: dict = {}  # candidate -> reduced-tower quantities at the real depth
        self.found: dict[Layout, Estimate] = {}
        self.bound: dict = {}
        self.heap: list = []
        self.resolved: set = set()
        self.rejected: list[Left] = []
        self.skipped: list[Left] = []
        self.evaluated = 0
        for lay, plan in plans.items():
            self.push(lay, timer.busy(lay, plan)["busy_s"])

    # -- bookkeeping
    def push(self, lay: Layout, value: float) -> None:
        self.bound[lay] = value
        heapq.heappush(self.heap, (value, self.order[lay], lay))

    def resolve(self, lay: Layout, left: Left, into: list) -> None:
        if lay not in self.resolved:
            self.resolved.add(lay)
            into.append(left)

    def budget_left(self) -> bool:
        return self.max_dry_runs is None or self.ext.runs - self.runs0 < self.max_dry_runs

    def reject(
        self,
        lay: Layout,
        peak: float,
        exact: bool,
        what: str = "the estimate with one vision block",
    ) -> None:
        u = _gib(self.usable)
        if exact:
            reason = f"does not fit: peak {_gib(peak)} GiB > {u} GiB usable"
        else:
            reason = (
                f"does not fit: peak >= {_gib(peak)} GiB > {u} GiB usable ({what}, a lower bound)"
            )
        self.resolve(lay, Left(lay, reason), self.rejected)
        self.tell(lay, reason)

    def failed(self, lay: Layout, err: Exception) -> None:
        reason = f"dry run failed: {_last_line(err)}"
        self.resolve(lay, Left(lay, reason), self.rejected)
        self.tell(lay, reason)

    def tell(self, lay: Layout, what: str) -> None:
        """One progress line: a candidate and what its dry runs (counted so far) showed."""
        if self.progress:
            self.progress(f"{lay.label()}: {what} ({self.ext.runs} dry runs)")

    def share_comm(self, lay: Layout, comm: dict) -> None:
        """Recompute changes no collective: the step time with `comm` bounds every recompute
        setting of the layout not yet estimated (`comm` may itself be a lower bound)."""
        for r in RECOMPUTE:
            s = replace(lay, recompute=r)
            if s in self.plans and s not in self.resolved and self.state.get(s) is None:
                b = self.timer.step(s, self.plans[s], comm)["step_s"]
                if b > self.bound[s]:
                    self.push(s, b)

    # -- the two stages
    def stage_lower(self, lay: Layout) -> None:
        """The reduced-tower estimate (2-3 dry runs).  It does not fit: rejected (a lower bound).
        It fits: queued at the step time it gives, or estimated whole at once when the vision term
        is known (free) or when it is a pipeline's (whose tower, held for every micro-batch in
        flight, makes the reduced estimate a weak bound)."""
        plan = self.plans[lay]
        vision = self.ext.cached_vision(lay, plan)
        try:
            if vision is None and lay.pp > 1:  # shares the fit's runs, and often rejects its key
                vision = self.ext.vision(lay, plan)
            if vision is not None and not self.g.fits(vision.get("peak_bytes", 0.0)):
                self.reject(lay, vision["peak_bytes"], exact=False, what="its vision term alone")
                return
            q = self.ext.lower(lay, plan)
        except Exception as err:  # noqa: BLE001 - kernels' shape rules raise RuntimeError, ValueError...
            self.failed(lay, err)
            return
        self.lower[lay] = q
        self.tell(lay, f"peak >= {_gib(q['peak_bytes'])} GiB with one vision block")
        comm = _comm_dict(q)
        self.share_comm(lay, comm)
        if not self.g.fits(q["peak_bytes"]):
            self.reject(lay, q["peak_bytes"], exact=False)
            return
        self.state[lay] = "lower"
        if vision is not None or lay.pp > 1:
            self.stage_exact(lay)
        else:
            self.push(lay, self.timer.step(lay, plan, comm)["step_s"])

    def stage_exact(self, lay: Layout) -> None:
        """The vision term (one dry run per vision key, cached): the estimate at the real size."""
        plan = self.plans[lay]
        try:
            q = add_vision(self.lower[lay], self.ext.vision(lay, plan))
        except Exception as err:  # noqa: BLE001 - as in stage_lower
            self.failed(lay, err)
            return
        self.evaluated += 1
        mem = {k: round(q[k]) for k in MEMORY}
        comm = _comm_dict(q)
        self.share_comm(lay, comm)
        t = self.timer.step(lay, plan, comm)
        self.tell(lay, f"peak {_gib(mem['peak_bytes'])} GiB, step {_s(t['step_s'])} s")
        if not self.g.fits(mem["peak_bytes"]):
            self.reject(lay, mem["peak_bytes"], exact=True)
            return
        self.found[lay] = Estimate(
            layout=lay,
            dp=plan.dims.dp,
            grad_accum=plan.grad_accum,
            activation_peak_bytes=mem["peak_bytes"] - sum(mem[k] for k in MEMORY[1:]),
            comm_bytes=comm,
            **mem,
            **t,
        )
        self.state[lay] = "exact"
        self.push(lay, t["step_s"])
        i = RECOMPUTE.index(lay.recompute)
        for r in RECOMPUTE[i + 1 :]:
            s = replace(lay, recompute=r)
            if s in self.plans:
                self.resolve(
                    s,
                    Left(
                        s,
                        f"dominated: recompute={lay.recompute} of this layout fits (step "
                        f"{_s(t['step_s'])} s); more recompute adds FLOPs, same collectives",
                    ),
                    self.skipped,
                )

    # -- the loop
    def run(self, top: int, exhaustive: bool) -> tuple[list[Estimate], bool]:
        ranked: list[Estimate] = []
        while self.heap and (exhaustive or len(ranked) < top):
            value, _, lay = heapq.heappop(self.heap)
            if lay in self.resolved or value != self.bound[lay]:
                continue
            state = self.state.get(lay)
            if state == "exact":
                ranked.append(self.found[lay])
                self.resolved.add(lay)
                continue
            if not self.budget_left():
                heapq.heappush(self.heap, (value, self.order[lay], lay))
                return ranked, False
            if state == "lower":
                self.stage_exact(lay)
                continue
            self.stage_lower(lay)
        return ranked, True

    def leftovers(self, top: int, ranked: list[Estimate], complete: bool) -> None:
        best = ranked[:top]
        cut = best[-1].step_s if len(best) == top else None
        for e in ranked[top:]:
            self.skipped.append(
                Left(e.layout, f"fits, ranked below the top {top}: step {_s(e.step_s)} s")
            )
        for value, _, lay in sorted(self.heap):
            if lay in self.resolved or value != self.bound[lay]:
                continue
            state = self.state.get(lay)
            if state == "exact":
                reason = f"fits, ranked below the top {top}: step {_s(value)} s"
            elif not complete:
                reason = f"not evaluated: the dry-run budget ({self.max_dry_runs} runs) ran out"
            else:
                what = {"lower": "step with one vision block", None: "busy time"}[state]
                if state is None and value > self.timer.busy(lay, self.plans[lay])["busy_s"]:
                    what = "step with the collectives of another recompute setting"
                reason = (
                    f"not evaluated: its {what} {_s(value)} s >= the top {top}'s slowest "
                    f"step {_s(cut)} s"
                )
            self.resolve(lay, Left(lay, reason), self.skipped)


def search(
    job,
    world: int,
    gpu_name: str | Gpu,
    top: int = 10,
    *,
    full_space: bool = False,
    fields: dict | None = None,
    exhaustive: bool = False,
    max_dry_runs: int | None = None,
    extrapolator: Extrapolator | None = None,
    progress=None,
) -> SearchResult:
    """The `top` fastest layouts of `job` on `world` GPUs `gpu_name` (a `GPUS` name, or a Gpu)
    that fit, under the step time model, and every candidate left out with its reason (module
    docstring).  `job` is a composed job (DictConfig or JobConfig).  The candidates are the space
    less `NARROWED` (`full_space=True`: all of it), with `fields` replacing any field's values
    (e.g. {"pp": [1], "dp_mode": ["fsdp", "ddp"]});
    `extrapolator` brings the dry runs of an earlier search of the same job and world (another GPU,
    other fields); `progress(line)` hears of each estimate."""
    from omegaconf import OmegaConf

    t0 = time.perf_counter()
    if OmegaConf.is_config(job):
        job = OmegaConf.to_object(job)
    g = gpu_name if isinstance(gpu_name, Gpu) else gpu(gpu_name)
    space = candidate_space(job, world, g, full=full_space)
    unknown = set(fields or {}) - set(space)
    if unknown:
        raise ValueError(f"fields {sorted(unknown)}: the candidate fields are {list(space)}")
    space |= {k: list(v) for k, v in (fields or {}).items()}
    space = resolve_replicas(space, world, g)
    plans, invalid, layouts = enumerate_layouts(job, world, space)
    order = {lay: i for i, lay in enumerate(layouts)}
    with _quiet_threads(1):
        ext = extrapolator or Extrapolator(job, world)
        runs, run_s = ext.runs, ext.run_s
        s = _Search(plans, order, ext, StepTimeModel(job, world, g), g, max_dry_runs, progress)
        ranked, complete = s.run(top, exhaustive)
        s.leftovers(top, ranked, complete)
    return SearchResult(
        world=world,
        gpu=g,
        usable_bytes=s.usable,
        top=ranked[:top],
        rejected=sorted(invalid + s.rejected, key=lambda r: order[r.layout]),
        skipped=sorted(s.skipped, key=lambda r: order[r.layout]),
        candidates=len(layouts),
        valid=len(plans),
        screened=len(s.lower),
        evaluated=s.evaluated,
        dry_runs=ext.runs - runs,
        dry_run_s=ext.run_s - run_s,
        seconds=time.perf_counter() - t0,
        complete=complete,
        space=space,
    )


# ------------------------------------------------------------------ the report
def _summary(lefts: list[Left]) -> list[str]:
    """Alike reasons (numbers masked) counted together, most frequent first, one example each."""
    groups: dict[str, list[Left]] = {}
    for left in lefts:
        groups.setdefault(left.group, []).append(left)
    rows = ["| count | reason (example) | example layout |", "|---:|---|---|"]
    for items in sorted(groups.values(), key=lambda v: -len(v)):
        ex = items[0]
        rows.append(f"| {len(items)} | {ex.reason.replace('|', '/')} | {ex.layout.label()} |")
    return rows


def _s(seconds: float) -> str:
    return f"{seconds:.3f}" if seconds >= 0.01 or seconds == 0 else f"{seconds:.2e}"


HEADER = (
    "| # | tp | cp | pp | vpp | ep | etp | dp | dp_mode | recompute | mbs | M | peak GiB "
    "| compute s | busy s | exposed s | overlapped s | step s | tokens/s | MFU |"
)


def format_search(result: SearchResult) -> str:
    """Markdown: the top layouts, the time model in one line, then the rejected and the skipped
    candidates grouped by reason."""
    r, g = result, result.gpu
    lines = [
        f"## Layouts on {r.world} x {g.name} ({_gib(r.usable_bytes)} GiB usable per GPU)",
        "",
        f"{r.candidates} candidates, {r.valid} valid, {r.screened} screened with one vision block, "
        f"{r.evaluated} estimated whole; {r.dry_runs} dry runs ({r.dry_run_s:.0f} s); search wall "
        f"time {r.seconds:.1f} s"
        + ("" if r.complete else "; INCOMPLETE: the dry-run budget ran out"),
        "",
        HEADER,
        "|" + "---:|" * 8 + "---|---|" + "---:|" * 10,
    ]
    for i, e in enumerate(r.top, 1):
        a = e.layout
        lines.append(
            f"| {i} | {a.tp} | {a.cp} | {a.pp} | {a.vpp} | {a.ep} | {a.etp} | {e.dp} | {a.data_parallel} "
            f"| {a.recompute} | {a.micro_batch_size} | {e.grad_accum} | {_gib(e.peak_bytes)} "
            f"| {_s(e.compute_s)} | {_s(e.busy_s)} | {_s(e.exposed_comm_s)} "
            f"| {_s(e.overlapped_comm_s)} | {_s(e.step_s)} | {e.tokens_per_s:,.0f} "
            f"| {100 * e.mfu:.1f}% |"
        )
    if not r.top:
        lines.append("| - | no layout fits |" + " |" * 18)
    lines += [
        "",
        (
            "step = max(busy, overlapped) + exposed; busy = (compute + recompute) / (1 - bubble); "
            f"collectives at {g.nvlink_gbps:g} GB/s inside an NVLink domain of {g.domain}, "
            f"{g.network_gbps:g} GB/s across; MFU = compute / step at {g.bf16_tflops:g} TFLOP/s "
            "bf16 (moevlm.plan.search)."
        ),
    ]
    if r.rejected:
        lines += ["", f"### Rejected ({len(r.rejected)})", "", *_summary(r.rejected)]
    if r.skipped:
        lines += ["", f"### Not ranked ({len(r.skipped)})", "", *_summary(r.skipped)]
    return "\n".join(lines)
