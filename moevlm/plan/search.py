"""The layouts of a job on `world` GPUs of one kind: enumerated, checked, fitted, timed, ranked.

    result = search(job, world=16, gpu_name="h100", top=10)   # SearchResult
    print(format_search(result))     # the top layouts as a markdown table, then what was left out
    result.as_dict()                 # JSON-able
    search(job, 16, "h100", full_space=True)                  # the whole space (slower)
    search(job, 16, "h100", fields={"dp_mode": ["fsdp", "ddp"], "pp": [1]})

Legend: L decoder layers, x (y) the decoder layers of pp rank 0's first (second) stage, M
micro-batches per step and data-parallel rank, T the deepstack taps of the vision tower.

Design choices:
- Candidate space (deterministic, in this nesting order): pp in {1, 2, 4, 8} (at most L) with vpp
  1 (1f1b) or, for pp > 1, 2 (interleaved_1f1b); tp in the powers of 2 up to min(8, the GPU's
  NVLink domain); cp in {1, 2}; ep the divisors of the expert count that divide the world; etp 1
  or tp; dp_mode fsdp or ddp; recompute none, selective (the job's model.recompute_modules) or
  full; micro_batch_size 1 or 2; dp_replicate (HSDP replicas) 1 or "nodes" = world / the NVLink
  domain (one replica per domain, the shard groups inside it: the one R at which HSDP moves FSDP's
  gathers off the network; any R can be given with `fields`).  Each candidate is the job with these fields set
  (parallel.world_size = world, dp derived), checked by `validate()`; a refusal is kept as
  "invalid: <its first line>".
- Reduction, stated because the whole space does not fit in a few minutes of one core (each
  candidate in reach costs dry runs of one to a few seconds): by default only etp 1, fsdp,
  dp_replicate 1 and micro_batch_size 1 (`NARROWED`; `full_space=True` or `fields` brings them back).  A pipeline
  of any micro-batch count costs the same: its dry run steps two short schedules and extrapolates
  (`moevlm.plan.dry_run`).
- Memory and collectives come from dry runs (`moevlm.plan.dry_run`) of pp rank 0, the rank that
  holds the most (the vision tower, the embedding, the first stage), at a reduced size and
  extrapolated.  What a dry run reports (peak, parameter, gradient and optimizer bytes, the bytes
  of every collective of every group) is affine in the decoder layers a stage holds and in the
  vision blocks, with a jump at the deepstack taps: per candidate, runs with one vision block at
  x = 1 and 2 (interleaved: (x, y) = (1, 1), (2, 1), (1, 2); other stages hold one layer, which
  rank 0 does not see) give the decoder terms; per *vision key* (the candidate without ep and
  etp: the tower and the taps do not see them) one run with the real tower at
  x0 = min(max(T, 1), x) layers gives the vision term, that run less the candidate's own fit at
  x0.  The estimate is the fit at the real x (y) plus the vision term.  Accuracy, measured: 30B
  at world 16 without stages, the fit equals a direct 48-layer run to the byte and the vision term
  is byte-equal under ep 1/4/8/16, etp 1/2, tp 1/2; tiny model (tests), at another depth: equal
  without stages, the 1f1b peak within 1e-4, the interleaved peak within 1% (the vision term
  shifts a little with the layers of rank 0's second stage; it is measured with one).  Only rank
  0 is estimated: the last stage (LM head and loss) is not checked.
- Fit: a candidate fits when `Gpu.fits` keeps its peak (the memory less the allocator's and the
  runtime's headroom), else "does not fit: peak X GiB > Y GiB usable"; with "peak >= X" when the
  one-vision-block estimate already exceeds it (the tower only adds: a lower bound).  A candidate
  whose dry run raises (a kernel's shape rule, e.g. torch._grouped_mm's 16-byte rows under a wide
  etp of a small model) is rejected as "dry run failed: <the error's last line>".
- Step time (a stated simple model, for ranking; absolute times are optimistic):
  compute_s = the step's training FLOPs per rank (the budget micro-batch's FLOPs x M x dp / world,
  vision included) / the GPU's bf16 peak; recompute_s = the forward FLOPs of the recomputed
  regions (full: every decoder layer and vision block; selective: the named regions, elementwise
  ones count 0) per rank / peak; busy_s = (compute_s + recompute_s) / (1 - bubble), the bubble
  the idle fraction of torch's own schedule at this pp, vpp and M, simulated under unit costs
  (`PipelinePlan.bubble`; 0 without stages).  Every collective costs the bytes one GPU sends
  on the wire over the bandwidth of its link class.  The dry run counts what a rank puts into each
  call (`moevlm.plan.fake`); on a group of n ranks a ring moves, per GPU and direction, (n - 1)
  times that for an all-gather (its input is the shard), (n - 1) / n of it for a reduce-scatter
  or an all-to-all, 2 (n - 1) / n for an all-reduce, all of it for a send or a broadcast; a recv
  is the peer's send, not counted twice (`wire_bytes`).  The link is NVLink when rank 0's group of
  that role lies in one NVLink domain (rank order pp x dp x cp x tp, tp fastest), else the
  network (per GPU: each has its own NIC).  All-to-alls, sends and collectives of a group serving
  tp, cp, etp, cp_tp or pp are exposed (added); the rest (dp, dense, expert, vision: FSDP/DDP, and
  under HSDP their *_shard and *_replicate groups) overlap the compute.
  step_s = max(busy_s, overlapped_comm_s) + exposed_comm_s; tokens/s = global batch x seq_len /
  step_s; mfu = compute_s / step_s (useful FLOPs: recompute and the bubble lower it).  Ranked by
  step_s, ties in enumeration order.
- Search (branch and bound, exact for the top under the model and the estimates): candidates are
  taken by a lower bound on their step time: first busy_s, then the step time from their
  one-vision-block estimate (or a sibling's: recompute changes no collective, since a recomputed
  region replays its collectives' saved outputs; the dry runs agree), then, with the vision term,
  their exact step time.  The search stops when `top` candidates have come out with exact times;
  the rest are reported with the bound that left them out.  A pipeline's vision term is measured
  first (its tower is held for every micro-batch in flight: the one-block estimate bounds it
  poorly), and a vision term that alone exceeds the memory rejects every candidate of its key
  without more runs (the estimate is that term plus a fit, itself a peak).  Dominance: once a layout fits with
  some recompute, more recompute is skipped (same collectives, more FLOPs).  No memory is
  inferred across candidates: measured, full recompute can need more than none (tp 8 x etp 8
  keeps every collective's gathered output), and ddp less than fsdp (dp 1, edp 1).
  `exhaustive=True` drops the bound; `max_dry_runs` caps the work (the result says it is
  incomplete); `extrapolator=` reuses an earlier search's dry runs (same job and world).
- Dry runs use one torch thread (restored after): they are Python-bound, and on a shared machine
  a second thread made some CPU ops of the fake step's host side much slower, not faster.
"""

from __future__ import annotations

import contextlib
import copy
import heapq
import logging
import re
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from moevlm.errors import ConfigError
from moevlm.plan.devices import Gpu, gpu
from moevlm.plan.dry_run import budget_micro_batch, dry_run

GIB = 2**30
RECOMPUTE = ("none", "selective", "full")  # less memory, more FLOPs, left to right
SCHEDULE = {1: "1f1b", 2: "interleaved_1f1b"}  # vpp -> schedule
EXPOSED_ROLES = frozenset({"tp", "cp", "etp", "cp_tp", "pp"})
EXPOSED_KINDS = frozenset({"all_to_all", "send"})
ATTENTION_ROLES = frozenset(
    {"tp", "cp", "dp", "dense", "vision", "pp", "cp_tp"}
    | {"dense_replicate", "dense_shard", "vision_replicate", "vision_shard"}
)
MEMORY = ("peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes")


# ------------------------------------------------------------------ results
@dataclass(frozen=True)
class Layout:
    """One candidate: the fields of `job.parallel`, `model.recompute` and the micro-batch it sets."""

    tp: int
    cp: int
    pp: int
    vpp: int
    ep: int
    etp: int
    dp_mode: str
    recompute: str
    micro_batch_size: int
    dp_replicate: int = 1  # HSDP replicas (parallel.dp_replicate); 1 = FSDP over all of dp x cp

    @property
    def schedule(self) -> str:
        return SCHEDULE[self.vpp] if self.pp > 1 else "none"

    def overrides(self) -> list[str]:
        """The command-line overrides that give this layout."""
        out = [f"parallel.tp={self.tp}", f"parallel.cp={self.cp}", f"parallel.pp={self.pp}"]
        if self.pp > 1:
            out += [f"parallel.vpp={self.vpp}", f"parallel.pp_schedule={self.schedule}"]
        out += [
            f"parallel.ep={self.ep}",
            f"parallel.etp={self.etp}",
            f"parallel.dp_mode={self.dp_mode}",
            *([f"parallel.dp_replicate={self.dp_replicate}"] if self.dp_replicate > 1 else []),
            f"model.recompute={self.recompute}",
            f"train.micro_batch_size={self.micro_batch_size}",
        ]
        return out

    def label(self) -> str:
        pipe = f"pp{self.pp}" + (f"x{self.vpp}" if self.vpp > 1 else "")
        return (
            f"tp{self.tp} cp{self.cp} {pipe} ep{self.ep} etp{self.etp} {self.data_parallel} "
            f"recompute={self.recompute} mbs{self.micro_batch_size}"
        )

    @property
    def data_parallel(self) -> str:
        """dp_mode, or `hsdp rR` for R HSDP replicas."""
        return self.dp_mode if self.dp_replicate == 1 else f"hsdp r{self.dp_replicate}"

    def apply(self, job, world: int):
        """A copy of `job` (a JobConfig object) laid out as this candidate on `world` ranks."""
        job = copy.deepcopy(job)
        p = job.parallel
        p.tp, p.cp, p.pp, p.ep, p.etp, p.dp_mode = (
            self.tp,
            self.cp,
            self.pp,
            self.ep,
            self.etp,
            self.dp_mode,
        )
        p.vpp = self.vpp if self.pp > 1 else None
        p.pp_schedule = SCHEDULE[self.vpp]
        p.pp_layers = "auto"
        p.dp, p.world_size, p.scale_to = -1, world, None
        p.dp_replicate = self.dp_replicate
        job.model.recompute = self.recompute
        job.train.micro_batch_size = self.micro_batch_size
        return job


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
class Left:
    """A candidate left out of the ranking, and why: `reason` for the reader, `group` (its numbers
    masked) to count alike reasons together."""

    layout: Layout
    reason: str

    @property
    def group(self) -> str:
        return re.sub(r"\d+(\.\d+)?", "#", self.reason)

    def as_dict(self) -> dict:
        return {"layout": asdict(self.layout), "reason": self.reason}


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


# ------------------------------------------------------------------ the candidates
# The default search leaves these values out of the full space (module docstring); search's
# `full_space=True` or `fields` brings them back.
NARROWED = {"etp": [1], "dp_mode": ["fsdp"], "micro_batch_size": [1], "dp_replicate": [1]}
# "nodes": one HSDP replica per NVLink domain (world / domain replicas, each sharded within a domain)
NODES = "nodes"


def candidate_space(job, world: int, g: Gpu, full: bool = False) -> dict[str, list]:
    """The values each field takes (module docstring): the full space, or less `NARROWED`."""
    from moevlm.config import model_config

    cfg = model_config(job.model)
    experts = cfg.moe.num_experts
    space = {
        "pp": [p for p in (1, 2, 4, 8) if p <= cfg.text.num_layers],
        "vpp": [1, 2],
        "tp": [t for t in (1, 2, 4, 8) if t <= min(8, g.domain)],
        "cp": [1, 2],
        "ep": [e for e in range(1, world + 1) if world % e == 0 and (experts or 1) % e == 0],
        "etp": [1, "tp"],
        "dp_mode": ["fsdp", "ddp"],
        "recompute": list(RECOMPUTE),
        "micro_batch_size": [1, 2],
        "dp_replicate": [1, NODES],
    }
    return resolve_replicas(space if full else space | NARROWED, world, g)


def resolve_replicas(space: dict, world: int, g: Gpu) -> dict:
    """`space` with dp_replicate's "nodes" as a number: world / the NVLink domain (at least 1),
    without repeats."""
    values = []
    for v in space.get("dp_replicate", [1]):
        v = max(1, world // g.domain) if v == NODES else int(v)
        if v not in values:
            values.append(v)
    return space | {"dp_replicate": values}


def candidates(space: dict) -> list[Layout]:
    out = []
    for pp in space["pp"]:
        for vpp in [v for v in space["vpp"] if pp > 1 or v == 1]:
            for tp in space["tp"]:
                for cp in space["cp"]:
                    for ep in space["ep"]:
                        for etp in sorted({tp if e == "tp" else e for e in space["etp"]}):
                            for dp_mode in space["dp_mode"]:
                                for rc in space["recompute"]:
                                    for mbs in space["micro_batch_size"]:
                                        for r in space.get("dp_replicate", [1]):
                                            out.append(
                                                Layout(
                                                    tp, cp, pp, vpp, ep, etp, dp_mode, rc, mbs, r
                                                )
                                            )
    return out


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _last_line(err: Exception) -> str:
    """An error from inside a dry run: its last line, without the rank prefixes torch adds."""
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else type(err).__name__
    return re.sub(r"^(\[rank\d+\]:\s*)+", "", text).strip()


def enumerate_layouts(job, world: int, space: dict) -> tuple[dict, list[Left], list[Layout]]:
    """(layout -> validated Plan, the invalid ones with validate's first line, all in order)."""
    from moevlm.config import validate

    plans, invalid = {}, []
    layouts = candidates(space)
    for lay in layouts:
        try:
            plans[lay] = validate(lay.apply(job, world), world, environment=False)
        except (ConfigError, ValueError) as err:
            invalid.append(Left(lay, f"invalid: {_first_line(err)}"))
    return plans, invalid, layouts


# ------------------------------------------------------------------ the step time model
def _role_ranks(role: str, dims) -> list[int]:
    """Rank 0's group of `role` (ParallelContext.groups' names); None when the role is unknown."""
    g = dims.groups(0)
    per_stage = dims.world // dims.pp
    return {
        "tp": g["tp"],
        "cp": g["cp"],
        "dp": g["dp"],
        "pp": g["pp"],
        "ep": g["ep"],
        "etp": g["etp"],
        "expert": g["edp"],
        "dense": g["dp_cp"],
        "vision": list(range(per_stage)),
        **{name: g[name] for pair in dims.FOLDED.values() for name in pair},
        "cp_tp": list(range(dims.cp * dims.tp)),
    }.get(role)


def _group_ranks(group: str, dims) -> list[int]:
    """Rank 0's group of a collective's group name (roles joined by "/" name one set of ranks; the
    first known role gives it); an unknown name is taken as the whole world."""
    for role in group.split("/"):
        ranks = _role_ranks(role, dims)
        if ranks:
            return ranks
    return list(range(dims.world))


def link_gbps(group: str, dims, g: Gpu) -> float:
    """NVLink bandwidth when rank 0's group lies in one NVLink domain (domains are consecutive
    blocks of ranks), else the network's."""
    return g.nvlink_gbps if max(_group_ranks(group, dims)) // g.domain == 0 else g.network_gbps


def wire_bytes(kind: str, payload: float, n: int) -> float:
    """Bytes one GPU sends for a collective of `kind` into which it put `payload` bytes, on a group
    of `n` ranks, as a ring algorithm moves them (module docstring)."""
    if n <= 1 and kind not in ("send", "recv"):
        return 0.0
    return {
        "all_gather": payload * (n - 1),
        "reduce_scatter": payload * (n - 1) / n,
        "all_to_all": payload * (n - 1) / n,
        "all_reduce": payload * 2 * (n - 1) / n,
        "recv": 0.0,
    }.get(kind, payload)


def is_exposed(group: str, kind: str) -> bool:
    """All-to-alls and sends are on the critical path, as is every collective of a group that
    serves tp, cp, etp, cp_tp or pp; FSDP/DDP traffic (dp, dense, expert, vision) overlaps."""
    return kind in EXPOSED_KINDS or bool(EXPOSED_ROLES & set(group.split("/")))


def comm_seconds(comm_bytes: dict, dims, g: Gpu) -> tuple[float, float]:
    """(exposed, overlapped) seconds of a step's collectives: wire bytes over the link's bandwidth."""
    exposed = overlapped = 0.0
    for group, kinds in comm_bytes.items():
        bw, n = link_gbps(group, dims, g) * 1e9, len(_group_ranks(group, dims))
        for kind, nbytes in kinds.items():
            seconds = wire_bytes(kind, nbytes, n) / bw
            if is_exposed(group, kind):
                exposed += seconds
            else:
                overlapped += seconds
    return exposed, overlapped


def recompute_forward_flops(cfg, mb, mode: str, modules=()) -> float:
    """Forward FLOPs one micro-batch recomputes in backward, counted as moevlm.model.flops counts
    (matmuls and attention's QK^T and PV; norms and activations are free)."""
    from moevlm.model.flops import doc_lens_of, layer_forward_parts, vision_block_forward_parts

    if mode == "none":
        return 0.0
    B, S = mb.input_ids.shape
    docs = doc_lens_of(B, S, mb.cu_seqlens)
    grids = [] if mb.image_grid_thw is None else mb.image_grid_thw.tolist()
    depth = cfg.vision.depth
    layers = [layer_forward_parts(cfg, i, docs) for i in range(cfg.text.num_layers)]
    block = vision_block_forward_parts(cfg, grids)
    vision_block = sum(block.values())
    if mode == "full":
        return float(sum(sum(p.values()) for p in layers) + depth * vision_block)
    regions = {
        "core_attn": sum(p["core_attn"] for p in layers) + depth * block["core_attn"],
        "mlp": sum(p.get("mlp", 0) for p in layers) + depth * block["mlp"],
        "moe": sum(p.get("moe", 0) for p in layers),
        "vision": depth * vision_block,
    }
    chosen = set(modules)
    if "vision" in chosen:  # regions inside a recomputed vision block are not recomputed twice
        regions["core_attn"] -= depth * block["core_attn"]
        regions["mlp"] -= depth * block["mlp"]
    return float(sum(regions.get(r, 0) for r in chosen))


# ------------------------------------------------------------------ extrapolated dry runs
def _quantities(r) -> dict[str, float]:
    """A RankPlan as one flat vector: the memory fields and ("comm", group, kind) bytes."""
    q = {k: float(getattr(r, k)) for k in MEMORY}
    for group, kinds in r.comm_bytes.items():
        for kind, nbytes in kinds.items():
            q[("comm", group, kind)] = float(nbytes)
    return q


def _axpy(a: float, x: dict, y: dict) -> dict:
    """a x + y, over the union of keys (a missing collective moved 0 bytes)."""
    return {k: a * x.get(k, 0.0) + y.get(k, 0.0) for k in x.keys() | y.keys()}


def _canonical(group: str) -> frozenset:
    """A group by its attention roles: the same ranks under every ep/etp (expert-mesh roles join a
    group's name when the expert mesh's group has the same ranks)."""
    roles = frozenset(group.split("/"))
    return roles & ATTENTION_ROLES or roles


def _add_vision(fit: dict, delta: dict) -> dict:
    """`fit` + `delta` where delta's collectives are renamed to fit's group of the same ranks."""
    names = {_canonical(k[1]): k[1] for k in fit if isinstance(k, tuple)}
    moved = {}
    for k, v in delta.items():
        if isinstance(k, tuple):
            k = ("comm", names.get(_canonical(k[1]), k[1]), k[2])
        moved[k] = moved.get(k, 0.0) + v
    return _axpy(1.0, moved, fit)


@dataclass
class _Fit:
    """Quantities affine in rank 0's stage layers: at (x, y) = base + (x-1) dx + (y-1) dy."""

    base: dict
    dx: dict
    dy: dict

    def at(self, x: int, y: int = 1) -> dict:
        return _axpy(y - 1, self.dy, _axpy(x - 1, self.dx, self.base))


class Extrapolator:
    """Dry runs of pp rank 0 at reduced sizes, cached, and their extrapolation to the real model
    (module docstring): `lower(layout, plan)` with one vision block (a lower bound: more blocks
    only add), `estimate(layout, plan)` with the vision term added."""

    def __init__(self, job, world: int, vision_layers: int = 1):
        from moevlm.config import model_config

        self.job, self.world = job, world
        self.cfg = model_config(job.model)
        self.depth = self.cfg.vision.depth
        self.reduced_vision = min(vision_layers, self.depth)
        self.taps = len(self.cfg.vision.deepstack_visual_indexes)
        self.fits: dict = {}
        self.visions: dict = {}
        self.runs = 0
        self.run_s = 0.0

    # -- the runs
    def _run(self, layout: Layout, stage_layers: list[int], vision_depth: int | None) -> dict:
        job = layout.apply(self.job, self.world)
        job.model.num_layers = sum(stage_layers)
        job.model.vision_depth = vision_depth
        if layout.pp > 1:
            job.parallel.pp_layers = ",".join(map(str, stage_layers))
        t0 = time.perf_counter()
        r = dry_run(job, self.world, rank=0)
        self.runs += 1
        self.run_s += time.perf_counter() - t0
        return _quantities(r)

    def _split(self, layout: Layout, x: int, y: int = 1) -> list[int]:
        """Decoder layers per stage of a reduced run: x on stage 0, y on stage pp (rank 0's second
        stage when vpp = 2), one on every other stage."""
        split = [1] * (layout.pp * layout.vpp)
        split[0] = x
        if layout.vpp > 1:
            split[layout.pp] = y
        return split

    def fit(self, layout: Layout) -> _Fit:
        """The decoder terms: runs with the reduced tower at x = 1, 2 (and y = 2)."""
        if layout not in self.fits:
            v = self.reduced_vision
            q11 = self._run(layout, self._split(layout, 1), v)
            q21 = self._run(layout, self._split(layout, 2), v)
            dx = _axpy(-1.0, q11, q21)
            dy = {}
            if layout.vpp > 1:
                dy = _axpy(-1.0, q11, self._run(layout, self._split(layout, 1, 2), v))
            self.fits[layout] = _Fit(q11, dx, dy)
        return self.fits[layout]

    def lower(self, layout: Layout, plan) -> dict:
        """Rank 0's quantities at the real depth with one vision block."""
        return self.fit(layout).at(*self.real_layers(layout, plan))

    def _x0(self, x: int) -> int:
        return min(max(self.taps, 1), x)

    def vision_key(self, layout: Layout, x: int) -> tuple:
        return (replace(layout, ep=1, etp=1), self._x0(x))

    def cached_vision(self, layout: Layout, plan) -> dict | None:
        """The vision term of `layout` if a candidate of its vision key has measured it."""
        if self.reduced_vision == self.depth:
            return {}
        return self.visions.get(self.vision_key(layout, self.real_layers(layout, plan)[0]))

    def vision(self, layout: Layout, plan) -> dict:
        """The vision term: the real tower minus the reduced one, at x0 layers on stage 0 (the taps
        are consumed where they are in the real split), shared by the candidates without ep/etp."""
        key = self.vision_key(layout, self.real_layers(layout, plan)[0])
        if key not in self.visions:
            if self.reduced_vision == self.depth:
                self.visions[key] = {}
            else:
                x0 = key[1]
                split = self._split(layout, x0)
                if sum(split) < self.taps:  # the taps need that many layers: after stage 0
                    split[1] += self.taps - sum(split)
                full = self._run(layout, split, None)
                self.visions[key] = _axpy(-1.0, self.fit(layout).at(x0), full)
        return self.visions[key]

    def estimate(self, layout: Layout, plan) -> dict:
        """Rank 0's quantities at the real size."""
        return _add_vision(self.lower(layout, plan), self.vision(layout, plan))

    def real_layers(self, layout: Layout, plan) -> tuple[int, int]:
        if plan.pipeline is None:
            return self.cfg.text.num_layers, 1
        layers = plan.pipeline.layers
        return layers[0], layers[layout.pp] if layout.vpp > 1 else 1


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


class _Timer:
    """The step time model (module docstring) for one job, world and GPU."""

    def __init__(self, job, world: int, g: Gpu):
        self.job, self.world, self.g = job, world, g
        self.modules = tuple(job.model.recompute_modules or ())
        self._flops: dict = {}

    def flops(self, plan, layout: Layout) -> tuple[float, float]:
        """(training FLOPs, recomputed forward FLOPs) of one budget micro-batch."""
        key = (layout.micro_batch_size, layout.recompute)
        if key not in self._flops:
            job = copy.deepcopy(self.job)
            job.train.micro_batch_size = layout.micro_batch_size
            mb = budget_micro_batch(job, plan.model)
            again = recompute_forward_flops(plan.model, mb, layout.recompute, self.modules)
            self._flops[key] = (mb.flops, again)
        return self._flops[key]

    def busy(self, layout: Layout, plan) -> dict:
        """compute_s, recompute_s, bubble, busy_s: all that needs no dry run."""
        flops, again = self.flops(plan, layout)
        share = plan.grad_accum * plan.dims.dp / self.world / (self.g.bf16_tflops * 1e12)
        bubble = plan.pipeline.bubble if plan.pipeline is not None else 0.0
        compute_s, recompute_s = flops * share, again * share
        return {
            "compute_s": compute_s,
            "recompute_s": recompute_s,
            "bubble": bubble,
            "busy_s": (compute_s + recompute_s) / (1.0 - bubble),
        }

    def step(self, layout: Layout, plan, comm_bytes: dict) -> dict:
        out = self.busy(layout, plan)
        exposed, overlapped = comm_seconds(comm_bytes, plan.dims, self.g)
        step_s = max(out["busy_s"], overlapped) + exposed
        tokens = self.job.train.global_batch_size * self.job.data.pack.seq_len
        return out | {
            "exposed_comm_s": exposed,
            "overlapped_comm_s": overlapped,
            "step_s": step_s,
            "tokens_per_s": tokens / step_s,
            "mfu": out["compute_s"] / step_s,
        }


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}" if nbytes >= GIB else f"{nbytes / GIB:.3g}"


def _comm_dict(q: dict) -> dict:
    out: dict = {}
    for k, v in sorted((k, v) for k, v in q.items() if isinstance(k, tuple)):
        if round(v):
            out.setdefault(k[1], {})[k[2]] = round(v)
    return out


class _Search:
    """The branch and bound of `search` (module docstring).  A candidate's state: None (nothing
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
            q = _add_vision(self.lower[lay], self.ext.vision(lay, plan))
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
        s = _Search(plans, order, ext, _Timer(job, world, g), g, max_dry_runs, progress)
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
