"""A recipe scaled down to a few CPU processes with one override, its parallel shape kept.

    torchrun --standalone --nproc-per-node 8 train.py +experiment=gb200_3d +scale=cpu

`conf/scale/cpu.yaml` swaps the groups (tiny model, sample set, CPU settings) and sets
`parallel.scale_to`; `scale_down` (the first step of moevlm.config.validation) rewrites what a group
file cannot compute: dp, ep if it must, the global batch, the data streams, the layers a pipeline
needs.  Every change is one line of `JobPlan.notes`.
"""

from __future__ import annotations

from moevlm.errors import check
from moevlm.parallel.pipeline_schedules import SCHEDULES, schedule_name

SCALE_PRESET = "tiny"


def scale_down(job, launched: int, build_model) -> list[str]:
    """Rewrite `job` (in place) to the scaled-down layout when `parallel.scale_to` is set; returns the
    one-line report (empty when not scaling).  Idempotent: a scaled job scales to itself.
    `build_model(job.model) -> VLMConfig` gives the model the layout must fit."""
    p, t, m = job.parallel, job.train, job.model
    s = p.scale_to
    if s is None:
        return []
    check(
        isinstance(s, int) and not isinstance(s, bool) and s >= 1,
        f"parallel.scale_to={s!r} must be a positive number of processes, or null (no scaling)",
    )
    check(
        t.global_batch_size == 0 or _is_scaled(job),
        f"train.global_batch_size={t.global_batch_size} is set after +scale=cpu, which derives "
        "it: put +scale=cpu after +experiment=NAME on the command line (the later one wins) and leave the batch "
        "to the scale",
    )
    stage = p.tp * p.cp * p.pp
    check(
        stage <= s,
        f"the recipe's tp x cp x pp = {p.tp} x {p.cp} x {p.pp} = {stage} processes do not fit in "
        f"parallel.scale_to={s}; raise parallel.scale_to to {stage} (its shape is kept, never reshaped)",
    )
    check(
        not p.world_size or p.world_size % stage == 0,
        f"parallel.world_size={p.world_size} is not divisible by tp x cp x pp = {stage}",
    )
    recipe = {
        "world": p.world_size,
        "dp": p.dp if p.dp not in (-1, None) else max(1, (p.world_size or launched) // stage),
        "ep": p.ep,
    }
    dp = min(recipe["dp"], s // stage)
    stages = p.pp * _stages_per_rank(p.pp_schedule, p.vpp) if p.pp > 1 else 1
    model = build_model(m)
    if model.text.num_layers < stages:  # every pipeline stage holds a decoder layer
        m.num_layers = stages
    experts = model.moe.num_experts
    p.ep = max(
        [
            e
            for e in range(1, p.ep + 1)
            if (not experts or experts % e == 0) and (p.tp * p.cp * dp) % (e * p.etp) == 0
        ]
        or [p.ep]
    )  # none fits: ParallelDims says why
    p.dp, p.world_size = dp, dp * stage
    # HSDP replicas: the recipe's, or its largest divisor that still divides dp and edp
    edp = p.tp * p.cp * dp // (p.ep * p.etp)
    recipe["dp_replicate"] = p.dp_replicate
    if p.dp_replicate > 1:
        p.dp_replicate = max(
            r
            for r in range(1, p.dp_replicate + 1)
            if p.dp_replicate % r == 0 and dp % r == 0 and edp % r == 0
        )
    micro = 2 * stages if p.pp > 1 else 2
    t.global_batch_size = t.micro_batch_size * dp * micro
    job.data.streams = (
        0  # the default: layout independent, so every scaled recipe reads the same rows
    )
    line = _report(job, s, recipe, micro)
    check(
        launched == p.world_size,
        f"+scale lays this recipe out for {p.world_size} processes ({line}) but {launched} were launched; launch "
        f"torchrun --standalone --nproc-per-node {p.world_size} train.py with the same overrides",
    )
    return [line]


def _is_scaled(job) -> bool:
    """A job `scale_down` already rewrote (validated twice): its batch is the derived one."""
    p, t = job.parallel, job.train
    stages = p.pp * _stages_per_rank(p.pp_schedule, p.vpp) if p.pp > 1 else 1
    return (
        p.world_size is not None
        and p.dp not in (-1, None)
        and p.world_size == p.dp * p.tp * p.cp * p.pp
        and t.global_batch_size == t.micro_batch_size * p.dp * (2 * stages if p.pp > 1 else 2)
    )


def _stages_per_rank(schedule: str, vpp) -> int:
    rule = SCHEDULES[schedule_name(schedule)][2]
    return vpp if vpp not in (None, 0) else int(rule[-1])


def _report(job, s: int, recipe: dict, micro: int) -> str:
    p, t, m = job.parallel, job.train, job.model
    was = lambda now, then: f"{now}" if then in (None, now) else f"{then}->{now}"  # noqa: E731
    kept = (
        f"tp {p.tp} cp {p.cp} pp {p.pp} etp {p.etp}"
        + (f" pp_schedule {p.pp_schedule}" + (f" vpp {p.vpp}" if p.vpp else "") if p.pp > 1 else "")
        + f" dp_mode {p.dp_mode} dispatcher {m.dispatcher}"
    )
    layers = (
        f", model.num_layers {m.num_layers} (one per pipeline stage)"
        if m.num_layers is not None
        else ""
    )
    return (
        f"scale (parallel.scale_to={s}): {SCALE_PRESET} model on {p.world_size} process"
        f"{'es' if p.world_size > 1 else ''}: world_size {was(p.world_size, recipe['world'])}, "
        f"dp {was(p.dp, recipe['dp'])}, ep {was(p.ep, recipe['ep'])}"
        + (
            f", dp_replicate {was(p.dp_replicate, recipe['dp_replicate'])}"
            if recipe["dp_replicate"] > 1
            else ""
        )
        + f"{layers}; global_batch_size "
        f"{t.global_batch_size} ({micro} micro-batches x {t.micro_batch_size} row x dp {p.dp}), data.streams "
        f"{job.data.streams}; kept {kept}"
    )


__all__ = ["SCALE_PRESET", "scale_down"]
