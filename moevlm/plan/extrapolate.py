"""Dry runs of pp rank 0 at reduced sizes, cached, and their extrapolation to the real model.

Legend: x (y) the decoder layers of pp rank 0's first (second) stage, T the deepstack taps of the
vision tower, x0 = min(max(T, 1), x).

    ext = Extrapolator(job, world)
    ext.lower(layout, plan)      # quantities at the real depth with one vision block (a lower bound)
    ext.estimate(layout, plan)   # with the vision term added: rank 0 at the real size

Quantities: the memory and host-copy fields and ("comm", group, kind) bytes, affine in x and y
(docs/architecture.md, "The planner").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from moevlm.plan.candidates import Layout
from moevlm.plan.dry_run import dry_run

ATTENTION_ROLES = frozenset(
    {"tp", "cp", "dp", "dense", "vision", "pp", "cp_tp"}
    | {"dense_replicate", "dense_shard", "vision_replicate", "vision_shard"}
)
MEMORY = ("peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes")
# host<->device copies per step (optimizer offload; the activation offload's copies to the host)
HOST = ("h2d_bytes", "d2h_bytes", "activation_offload_bytes")


def _quantities(r) -> dict[str, float]:
    """A RankPlan as one flat vector: the memory and host-copy fields and ("comm", group, kind) bytes."""
    q = {k: float(getattr(r, k)) for k in (*MEMORY, *HOST)}
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


def add_vision(fit: dict, delta: dict) -> dict:
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
    """Quantities affine in rank 0's stage layers: at (x, y) = base + (x - x0) dx + (y - y0) dy."""

    base: dict
    dx: dict
    dy: dict
    x0: int = 1
    y0: int = 1

    def at(self, x: int, y: int = 1) -> dict:
        return _axpy(y - self.y0, self.dy, _axpy(x - self.x0, self.dx, self.base))


class Extrapolator:
    """Dry runs of pp rank 0 at reduced sizes, cached, and their extrapolation to the real model
    (docs/architecture.md): `lower(layout, plan)` with one vision block (a lower bound: more blocks
    only add), `estimate(layout, plan)` with the vision term added."""

    def __init__(self, job, world: int, vision_layers: int = 1):
        from moevlm.config import model_config

        self.job, self.world = job, world
        self.cfg = model_config(job.model)
        self.depth = self.cfg.vision.depth
        self.reduced_vision = min(vision_layers, self.depth)
        self.real_taps = self.cfg.vision.deepstack_visual_indexes
        self.taps = len(self.real_taps)
        self.fits: dict = {}
        self.visions: dict = {}
        self.runs = 0
        self.run_s = 0.0
        self.runs_done: dict = {}  # (layout, stage layers, vision depth, taps) -> quantities

    # -- the runs
    def _run(
        self, layout: Layout, stage_layers: list[int], vision_depth: int | None, taps=None
    ) -> dict:
        """Rank 0's quantities with `stage_layers` decoder layers per stage and a tower of
        `vision_depth` blocks (None: the real one) tapped at `taps` (None: the real taps within it)."""
        depth = self.depth if vision_depth is None else vision_depth
        taps = tuple(i for i in self.real_taps if i < depth) if taps is None else tuple(taps)
        key = (layout, tuple(stage_layers), depth, taps)
        if key in self.runs_done:
            return self.runs_done[key]
        job = layout.apply(self.job, self.world)
        job.model.num_layers = sum(stage_layers)
        job.model.vision_depth = depth
        job.model.vision_taps = list(taps)
        if layout.pp > 1:
            job.parallel.pp_layers = ",".join(map(str, stage_layers))
        t0 = time.perf_counter()
        r = dry_run(job, self.world, rank=0)
        self.runs += 1
        self.run_s += time.perf_counter() - t0
        self.runs_done[key] = _quantities(r)
        return self.runs_done[key]

    def _split(self, layout: Layout, x: int, y: int = 1) -> list[int]:
        """Decoder layers per stage of a reduced run: x on stage 0, y on stage pp (rank 0's second
        stage when vpp = 2), one on every other stage."""
        split = [1] * (layout.pp * layout.vpp)
        split[0] = x
        if layout.vpp > 1:
            split[layout.pp] = y
        return split

    def fit(self, layout: Layout, start: tuple[int, int] = (1, 1)) -> _Fit:
        """The decoder terms: runs with the reduced tower at (x, y) = (s, t), (s + 1, t) and, interleaved,
        (s, t + 1), for `start` = (s, t) (`steady_start`: 2 leaves a stage's first-layer terms out of
        the slope)."""
        s, ys = start[0], start[1] if layout.vpp > 1 else 1
        key = (layout, s, ys)
        if key not in self.fits:
            v = self.reduced_vision
            q0 = self._run(layout, self._split(layout, s, ys), v)
            dx = _axpy(-1.0, q0, self._run(layout, self._split(layout, s + 1, ys), v))
            dy = {}
            if layout.vpp > 1:
                dy = _axpy(-1.0, q0, self._run(layout, self._split(layout, s, ys + 1), v))
            self.fits[key] = _Fit(q0, dx, dy, s, ys)
        return self.fits[key]

    @staticmethod
    def steady_start(x: int, y: int = 1) -> tuple[int, int]:
        """Where the fit for stages of x (y) real layers starts: 2 for a stage of more than 2, else 1
        (exact at 1 and 2).  A stage's first layer can add a one-time term (measured: the 235B recipe
        under full recompute with the collectives reissued peaks 0.70 GiB higher at 2 layers than at
        1, then 0.50 GiB a layer): a slope taken from 1 to 2 would count it for every layer."""
        return (2 if x > 2 else 1, 2 if y > 2 else 1)

    def lower(self, layout: Layout, plan) -> dict:
        """Rank 0's quantities at the real depth with one vision block."""
        x, y = self.real_layers(layout, plan)
        return self.fit(layout, self.steady_start(x, y)).at(x, y)

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
                full = self.tower(layout, split)
                fit = self.fit(layout, self.steady_start(*self.real_layers(layout, plan)))
                self.visions[key] = _axpy(-1.0, fit.at(x0), full)
        return self.visions[key]

    def tower(self, layout: Layout, split: list[int]) -> dict:
        """Rank 0's quantities at `split` with the real tower, from two short towers: d = max(T, 1)
        blocks and d + 1, the T taps on the first blocks; the real depth D is d + (D - d) untapped
        blocks, each adding what the (d + 1)-th adds.  A tower of at most d + 1 blocks is run whole."""
        d = max(self.taps, 1)
        if self.depth <= d + 1:
            return self._run(layout, split, None)
        taps = range(self.taps)
        short = self._run(layout, split, d, taps)
        block = _axpy(-1.0, short, self._run(layout, split, d + 1, taps))
        return _axpy(self.depth - d, block, short)

    def estimate(self, layout: Layout, plan) -> dict:
        """Rank 0's quantities at the real size."""
        return add_vision(self.lower(layout, plan), self.vision(layout, plan))

    def real_layers(self, layout: Layout, plan) -> tuple[int, int]:
        if plan.pipeline is None:
            return self.cfg.text.num_layers, 1
        layers = plan.pipeline.layers
        return layers[0], layers[layout.pp] if layout.vpp > 1 else 1
