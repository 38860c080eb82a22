"""The pipeline layout, planned and checked before anything is built: which decoder layers each
stage holds, which rank holds each stage, and what every stage costs.

Legend: pp pipeline ranks, v = vpp stages per rank, K = pp*v (virtual) stages,
L decoder layers, M micro-batches per optimizer step.

    plan = split_pipeline(model_cfg, pp=2, vpp=None, schedule="1f1b", layers="auto",
                         microbatches=8, rows=1, seq_len=8192, max_patches=16384, image_patches=4096)
    plan.layers            # decoder layers per stage, e.g. (22, 26)
    plan.stages_of(rank)   # the stages this pp rank holds
    print(plan.describe()) # one line per stage: rank, layers, what else it holds, FLOP share
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from moevlm.errors import ConfigError, check
from moevlm.model.config import VLMConfig
from moevlm.model.flops import head_forward_flops, layer_forward_flops, vision_forward_flops
from moevlm.parallel.pipeline_bubble import schedule_bubble
from moevlm.parallel.pipeline_schedules import SCHEDULES, schedule_name, stage_rank


@dataclass(frozen=True)
class PipelineSplit:
    pp: int
    vpp: int
    schedule: str
    layers: tuple[int, ...]  # decoder layers per stage
    flops: tuple[float, ...]  # training FLOPs per stage and micro-batch, at the budgets
    microbatches: int
    auto: bool = True

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    @property
    def style(self) -> str:
        return SCHEDULES[self.schedule][1]

    @property
    def bubble(self) -> float:
        """The schedule's bubble fraction at this pp, vpp and micro-batch count, simulated from
        torch's action lists under unit costs (moevlm.parallel.pipeline_bubble)."""
        return schedule_bubble(self.schedule, self.pp, self.microbatches, self.vpp)

    def layer_range(self, stage: int) -> range:
        start = sum(self.layers[:stage])
        return range(start, start + self.layers[stage])

    def rank_of(self, stage: int) -> int:
        return stage_rank(self.schedule, self.pp, stage)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]

    def describe(self) -> str:
        total = sum(self.flops) or 1.0
        how = "auto (balanced by training FLOPs)" if self.auto else "explicit"
        lines = [
            f"pipeline: {self.schedule}, pp {self.pp} x vpp {self.vpp} = {self.num_stages} stages, "
            f"{self.microbatches} micro-batches per step, layers {how}: {','.join(map(str, self.layers))}"
        ]
        for s in range(self.num_stages):
            r = self.layer_range(s)
            extra = (["vision tower, embedding"] if s == 0 else []) + (
                ["norm, LM head, loss"] if s == self.num_stages - 1 else []
            )
            lines.append(
                f"  stage {s} (pp rank {self.rank_of(s)}): decoder layers {r.start}-{r.stop - 1} "
                f"({len(r)})"
                + (f" + {' + '.join(extra)}" if extra else "")
                + f", {100 * self.flops[s] / total:.1f}% of the FLOPs"
            )
        by_rank = [sum(self.flops[s] for s in self.stages_of(r)) / total for r in range(self.pp)]
        lines.append("  per pp rank: " + ", ".join(f"{100 * f:.1f}%" for f in by_rank))
        return "\n".join(lines)


# ------------------------------------------------------------------ planning
def split_pipeline(
    cfg: VLMConfig,
    *,
    pp: int,
    vpp: int | None,
    schedule: str,
    layers: str | list | tuple,
    microbatches: int,
    rows: int,
    seq_len: int,
    max_patches: int,
    image_patches: int,
    freeze_vision: bool = False,
) -> PipelineSplit:
    """Check the pipeline settings against the model and the batch, and choose the split.
    `rows` packed rows of `seq_len` tokens and `max_patches` patches form one micro-batch;
    `image_patches` is the largest image's patch count (data.image.max_pixels / patch^2)."""
    name = schedule_name(schedule)
    cls, _, rule = SCHEDULES[name]
    v = _stages_per_rank(name, rule, vpp)
    K, L = pp * v, cfg.text.num_layers
    check(
        L >= K,
        f"text.num_layers={L} < {K} pipeline stages (pp {pp} x vpp {v}): every stage needs at least one "
        "decoder layer; lower parallel.pp or parallel.vpp",
    )
    check(
        not cfg.tie_word_embeddings,
        "tied word embeddings (the LM head is the embedding) cannot be split over pipeline stages here: the "
        "embedding sits on the first stage and the head on the last; use parallel.pp=1 or an untied model",
    )
    _check_microbatches(name, pp, K, microbatches)
    costs = stage_costs(
        cfg,
        rows=rows,
        seq_len=seq_len,
        max_patches=max_patches,
        image_patches=image_patches,
        freeze_vision=freeze_vision,
    )
    auto = isinstance(layers, str) and layers.strip().lower() == "auto"
    split = (
        balance(costs, K, [stage_rank(name, pp, s) for s in range(K)])
        if auto
        else _explicit(layers, K, L)
    )
    return PipelineSplit(
        pp=pp,
        vpp=v,
        schedule=name,
        layers=split,
        flops=stage_flops(costs, split),
        microbatches=microbatches,
        auto=auto,
    )


def _stages_per_rank(name: str, rule: str, vpp: int | None) -> int:
    if vpp in (None, 0):
        return int(rule[-1])
    check(
        isinstance(vpp, int) and vpp >= 1,
        f"parallel.vpp={vpp} must be a positive integer (or null: auto)",
    )
    if rule.startswith("="):
        check(
            vpp == int(rule[1:]),
            f"parallel.pp_schedule={name} runs {rule[1:]} stage(s) per rank but parallel.vpp={vpp}; set "
            f"parallel.vpp={rule[1:]} (or null)"
            + (
                "; for several stages per rank use interleaved_1f1b, zbv or dualpipev"
                if rule == "=1"
                else ""
            ),
        )
    else:
        check(
            vpp >= 2,
            f"parallel.pp_schedule={name} needs parallel.vpp >= 2 stages per rank (vpp=1 is plain 1F1B: "
            "use parallel.pp_schedule=1f1b)",
        )
    return vpp


def _check_microbatches(name: str, pp: int, K: int, M: int) -> None:
    """torch's rules for the number of micro-batches (per data-parallel rank and step)."""
    how = (
        "raise train.global_batch_size (micro-batches per step = global_batch_size / (micro_batch_size x dp)) "
        "or lower train.micro_batch_size"
    )
    if name == "1f1b":
        check(M >= pp, f"1f1b needs at least pp={pp} micro-batches per step, got {M}; {how}")
    elif name == "dualpipev":
        check(
            M >= K, f"dualpipev needs at least {K} micro-batches per step (2 x pp), got {M}; {how}"
        )
    elif name == "interleaved_1f1b":
        rounds = max(1, M // pp)
        check(
            M % rounds == 0,
            f"interleaved_1f1b runs micro-batches in rounds of about pp={pp}: {M} micro-batches "
            f"is not a multiple of its {rounds} rounds; use a multiple of {pp}",
        )


def _explicit(layers, K: int, L: int) -> tuple[int, ...]:
    try:
        parts = [int(x) for x in (layers.split(",") if isinstance(layers, str) else layers)]
    except ValueError:
        raise ConfigError(
            f"parallel.pp_layers={layers!r}: give 'auto' or the decoder layers of every stage "
            f"as {K} comma-separated integers, e.g. '{_even_split(L, K)}'"
        ) from None
    check(
        len(parts) == K,
        f"parallel.pp_layers={layers!r} lists {len(parts)} stages but there are {K} "
        f"(pp x vpp); e.g. parallel.pp_layers='{_even_split(L, K)}'",
    )
    check(
        all(p >= 1 for p in parts),
        f"parallel.pp_layers={layers!r}: every stage needs at least one decoder layer",
    )
    check(
        sum(parts) == L,
        f"parallel.pp_layers={layers!r} sums to {sum(parts)} but the model has "
        f"text.num_layers={L}; e.g. parallel.pp_layers='{_even_split(L, K)}'",
    )
    return tuple(parts)


def _even_split(L: int, K: int) -> str:
    return ",".join(str(L // K + (i < L % K)) for i in range(K))


# ------------------------------------------------------------------ costs
@dataclass(frozen=True)
class StageCosts:
    """Training FLOPs of one micro-batch: the first stage's extra (vision), each layer, the last's extra (head)."""

    first: float
    layers: tuple[float, ...]
    last: float


def stage_costs(
    cfg: VLMConfig,
    *,
    rows: int,
    seq_len: int,
    max_patches: int,
    image_patches: int,
    freeze_vision: bool = False,
) -> StageCosts:
    docs = [seq_len] * rows
    layers = tuple(3 * layer_forward_flops(cfg, i, docs) for i in range(cfg.text.num_layers))
    vision, patch = vision_forward_flops(
        cfg, budget_grids(max_patches * rows, image_patches, cfg.vision.spatial_merge_size)
    )
    first = vision if freeze_vision else 3 * vision - patch
    return StageCosts(first=first, layers=layers, last=3 * head_forward_flops(cfg, seq_len * rows))


def budget_grids(patches: int, image_patches: int, merge: int) -> list[tuple[int, int, int]]:
    """A patch budget as square images of the largest allowed size, the remainder as one
    (1, merge, r / merge) image: (t, h, w) grids, h and w multiples of merge."""
    side = max(merge, math.isqrt(max(image_patches, merge * merge)) // merge * merge)
    n, rest = divmod(patches, side * side)
    grids = [(1, side, side)] * n
    if rest >= merge * merge:
        grids.append((1, merge, rest // merge // merge * merge))
    return grids


def stage_flops(c: StageCosts, split: tuple[int, ...]) -> tuple[float, ...]:
    out, at = [], 0
    for s, n in enumerate(split):
        f = (
            sum(c.layers[at : at + n])
            + (c.first if s == 0 else 0.0)
            + (c.last if s == len(split) - 1 else 0.0)
        )
        out.append(f)
        at += n
    return tuple(out)


def balance(c: StageCosts, K: int, ranks: list[int] | None = None) -> tuple[int, ...]:
    """The contiguous split of the layers into K stages (each >= 1 layer) that minimizes the largest
    stage cost, then the sum of squared stage costs (exact, dynamic programming).  With several
    stages per rank (`ranks[s]` = the rank of stage s), single layers are then moved (taken from
    one stage, given to another, the stages between shifting by one) while that lowers the busiest
    rank's load (then the costliest stage, then the squares): in steady state a rank runs all its
    stages for every micro-batch."""
    L = len(c.layers)
    prefix = [0.0]
    for x in c.layers:
        prefix.append(prefix[-1] + x)

    def cost(s: int, a: int, b: int) -> float:  # stage s holding layers a..b-1
        return (
            prefix[b] - prefix[a] + (c.first if s == 0 else 0.0) + (c.last if s == K - 1 else 0.0)
        )

    @lru_cache(maxsize=None)
    def best(s: int, a: int) -> tuple[float, float, tuple[int, ...]]:
        """Stages s..K-1 holding layers a..L-1: (max cost, sum of squares, split)."""
        if s == K - 1:
            x = cost(s, a, L)
            return x, x * x, (L - a,)
        options = []
        for b in range(a + 1, L - (K - 1 - s) + 1):
            x = cost(s, a, b)
            mx, sq, rest = best(s + 1, b)
            options.append((max(x, mx), sq + x * x, (b - a, *rest)))
        return min(options)

    split = best(0, 0)[2]
    if ranks is None or len(set(ranks)) == K:
        return split

    def score(sp):
        stage, at = [], 0
        for s, n in enumerate(sp):
            stage.append(cost(s, at, at + n))
            at += n
        load = [sum(x for x, r in zip(stage, ranks) if r == q) for q in sorted(set(ranks))]
        return max(load), max(stage), sum(x * x for x in stage)

    current = score(split)
    while True:
        moves = [
            tuple(n - (s == a) + (s == b) for s, n in enumerate(split))
            for a in range(K)
            for b in range(K)
            if a != b and split[a] > 1
        ]
        cand = min(moves, key=score, default=split)
        if score(cand) >= current:
            return split
        split, current = cand, score(cand)


__all__ = [
    "PipelineSplit",
    "StageCosts",
    "balance",
    "budget_grids",
    "split_pipeline",
    "stage_costs",
    "stage_flops",
]
