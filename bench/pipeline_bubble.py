"""Pipeline bubble fraction of torch.distributed.pipelining schedules, simulated.

Method. For each schedule, torch's own per-rank action lists are built without a
process group by `torch.distributed.pipelining._schedule_visualizer.
get_schedule_ops` (it instantiates the schedule class on mock stages and returns
`pipeline_order`, the compute-only IR every rank derives). Placeholders (None)
and non-compute actions (REDUCE_GRAD, sends/receives) are dropped; an
OVERLAP_F_B action is split into its sub-actions, run back to back, because
that is what `_PipelineScheduleRuntime` does with it unless a custom overlap
function is registered. One known torch bug is repaired, and flagged in the
row's note: Schedule1F1B's IR numbers the last rank's forwards 1..m
(see `repair_1f1b_last_rank`). Each rank then runs its list in order: an action starts
when the rank is free and its dependencies have finished, wherever they ran:

    F(s, m)       needs F(s-1, m)                       (s > 0)
    B/I(s, m)     needs F(s, m) and B/I(s+1, m)         (s < last; the last
                                                         stage needs only F)
    W(s, m)       needs I(s, m)

Receives are waited on lazily, just before the consuming compute (as in the
runtime), so each sub-action of an OVERLAP_F_B waits only on its own inputs.
(Gating the whole OVERLAP_F_B on all its sub-actions' inputs, as the
visualizer's own `add_schedule_op_spacing` does, adds p-1 units to DualPipeV's
makespan.) Every (stage, micro-batch) must appear exactly once as F and as B or
I+W; a list that fails this, or deadlocks, is reported in the row's note.

Cost model. Per stage action: F = 1, B = 2, I = 1, W = 1 (a full backward
equals I + W); communication is free. The makespan is in these per-stage units,
so it is not comparable across different vpp (a stage of an interleaved
schedule holds 1/vpp of a rank's layers); the bubble fraction is.

    bubble = sum over ranks (makespan - busy_r) / (num_ranks * makespan)

busy/rank is the same on every rank for all five schedules: 3 * vpp * m.

Baseline. The textbook formulas are printed beside the simulation:
GPipe and 1F1B (p-1)/(m+p-1), interleaved 1F1B (p-1)/(v*m+p-1). For GPipe and
1F1B the simulation must reproduce the formula exactly; the script asserts it,
as a check of the simulator. ZBV and DualPipeV have no such closed form here.

    python bench/pipeline_bubble.py --pp 2 4 --microbatches 8 [--json out.json]
"""

import argparse
import json
from dataclasses import asdict, dataclass, field
from fractions import Fraction

import torch
from torch.distributed.pipelining import schedules as pp_schedules

try:
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
except ImportError as exc:  # private module; present in torch 2.11 and 2.13
    raise SystemExit(
        f"torch {torch.__version__} has no pipelining._schedule_visualizer."
        "get_schedule_ops; this benchmark needs torch >= 2.11."
    ) from exc

COST = {"F": 1, "B": 2, "I": 1, "W": 1}


def _formula_single(p: int, m: int, v: int) -> Fraction:
    return Fraction(p - 1, m + p - 1)


def _formula_interleaved(p: int, m: int, v: int) -> Fraction:
    return Fraction(p - 1, v * m + p - 1)


# config name -> (torch class name, default stages per rank, textbook formula)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1, _formula_single),
    "1f1b": ("Schedule1F1B", 1, _formula_single),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, _formula_interleaved),
    "zbv": ("ScheduleZBVZeroBubble", 2, None),
    "dualpipev": ("ScheduleDualPipeV", 2, None),
}
MUST_MATCH_FORMULA = ("gpipe", "1f1b")


class ScheduleError(Exception):
    """torch's action lists are incomplete or cannot run under the dependencies."""


@dataclass(frozen=True)
class Op:
    kind: str  # F, B, I or W
    stage: int
    mb: int


@dataclass
class Row:
    schedule: str
    pp: int
    vpp: int
    microbatches: int
    bubble: float | None = None
    formula: float | None = None
    makespan: int | None = None
    busy_per_rank: list[int] = field(default_factory=list)
    placement: dict[int, list[int]] = field(default_factory=dict)
    note: str = ""


def _leaves(action) -> list[Op]:
    """Compute leaves of one torch _Action (sub-actions of OVERLAP_F_B in order)."""
    if action is None:
        return []
    if action.sub_actions is not None:
        return [op for sub in action.sub_actions for op in _leaves(sub)]
    kind = action.computation_type.value
    if kind not in COST:
        return []  # REDUCE_GRAD, UNSHARD, SEND_*/RECV_*: not compute
    return [Op(kind, action.stage_index, action.microbatch_index)]


def torch_rank_ops(name: str, pp: int, m: int, vpp: int) -> list[list[Op]]:
    """Each rank's ordered compute ops, as torch's schedule class generates them."""
    schedule_cls = getattr(pp_schedules, SCHEDULES[name][0])
    ranks = get_schedule_ops(schedule_cls, pp, m, num_stages_per_rank=vpp)
    return [[op for a in actions for op in _leaves(a)] for actions in ranks]


def repair_1f1b_last_rank(rank_ops: list[list[Op]], m: int) -> bool:
    """Undo an off-by-one in torch's Schedule1F1B._get_pipeline_order (2.11, 2.13).

    With no warm-up forwards, the last rank's IR bumps the forward counter before
    its first use and lists F1..F{m} instead of F0..F{m-1}. The imperative
    `_step_microbatches` that actually runs 1F1B is unaffected (one warm-up
    forward on the last stage, then B0 F1 B1 ...), which is what the shift gives.
    Returns whether the bug was present and repaired.
    """
    last = rank_ops[-1]
    if sorted(op.mb for op in last if op.kind == "F") != list(range(1, m + 1)):
        return False
    rank_ops[-1] = [Op("F", op.stage, op.mb - 1) if op.kind == "F" else op for op in last]
    return True


def check_complete(rank_ops: list[list[Op]], num_stages: int, m: int) -> None:
    """Every (stage, mb) has one F and either one B or one I and one W."""
    seen = [op for ops in rank_ops for op in ops]
    if len(seen) != len(set(seen)):
        raise ScheduleError("an action appears twice")
    done = set(seen)
    for s in range(num_stages):
        for mb in range(m):
            has_b = Op("B", s, mb) in done
            has_iw = Op("I", s, mb) in done and Op("W", s, mb) in done
            if Op("F", s, mb) not in done or has_b == has_iw:
                raise ScheduleError(f"stage {s} mb {mb}: missing or doubled F/B/I/W")


def _deps(op: Op, last: int) -> list[tuple[str, int, int]]:
    """Completion keys op waits on; 'G' = input grad of (stage, mb), from B or I."""
    if op.kind == "F":
        return [("F", op.stage - 1, op.mb)] if op.stage > 0 else []
    if op.kind == "W":
        return [("G", op.stage, op.mb)]
    deps = [("F", op.stage, op.mb)]
    return deps + ([("G", op.stage + 1, op.mb)] if op.stage < last else [])


def _done_key(op: Op) -> tuple[str, int, int]:
    return ("F" if op.kind == "F" else "G" if op.kind in ("B", "I") else "W", op.stage, op.mb)


def simulate(rank_ops: list[list[Op]], num_stages: int) -> tuple[int, list[int]]:
    """Run every rank's list in order; return (makespan, busy time per rank)."""
    n = len(rank_ops)
    end: dict[tuple[str, int, int], int] = {}
    free, pos, busy = [0] * n, [0] * n, [0] * n
    progress = True
    while progress:
        progress = False
        for r, ops in enumerate(rank_ops):
            while pos[r] < len(ops):
                op = ops[pos[r]]
                deps = _deps(op, num_stages - 1)
                if any(d not in end for d in deps):
                    break  # blocked on another rank; come back next sweep
                start = max([free[r]] + [end[d] for d in deps])
                free[r] = end[_done_key(op)] = start + COST[op.kind]
                busy[r] += COST[op.kind]
                pos[r] += 1
                progress = True
    stuck = [f"rank {r} at {rank_ops[r][pos[r]]}" for r in range(n) if pos[r] < len(rank_ops[r])]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(stuck))
    return max(free), busy


def bubble_row(name: str, pp: int, m: int, vpp: int) -> Row:
    formula_fn = SCHEDULES[name][2]
    row = Row(name, pp, vpp, m)
    row.formula = float(formula_fn(pp, m, vpp)) if formula_fn else None
    try:
        rank_ops = torch_rank_ops(name, pp, m, vpp)
    except Exception as exc:  # torch refuses this configuration
        row.note = "torch refused: " + f"{type(exc).__name__}: {exc}".replace("\n", " ")
        return row
    if name == "1f1b" and repair_1f1b_last_rank(rank_ops, m):
        row.note = f"torch IR off by one (last rank lists F1..F{m}); repaired"
    try:
        check_complete(rank_ops, pp * vpp, m)
        makespan, busy = simulate(rank_ops, pp * vpp)
    except ScheduleError as exc:
        row.note = f"invalid schedule: {exc}"
        return row
    bubble = Fraction(sum(makespan - b for b in busy), pp * makespan)
    if name in MUST_MATCH_FORMULA:
        assert bubble == formula_fn(pp, m, vpp), (name, pp, m, bubble)
    row.bubble, row.makespan, row.busy_per_rank = float(bubble), makespan, busy
    row.placement = {r: sorted({op.stage for op in ops}) for r, ops in enumerate(rank_ops)}
    return row


def markdown(rows: list[Row]) -> str:
    def fmt(x):
        return "—" if x is None else f"{x:.4f}"

    head = (
        "| schedule | pp | vpp | microbatches | bubble (sim) | formula "
        "| makespan | busy/rank | note |"
    )
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        busy = "—" if not r.busy_per_rank else "/".join(map(str, sorted(set(r.busy_per_rank))))
        mk = "—" if r.makespan is None else str(r.makespan)
        lines.append(
            f"| {r.schedule} | {r.pp} | {r.vpp} | {r.microbatches} | {fmt(r.bubble)} "
            f"| {fmt(r.formula)} | {mk} | {busy} | {r.note} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline ranks")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8])
    ap.add_argument(
        "--vpp",
        type=int,
        nargs="+",
        default=[2],
        help="stages per rank for interleaved_1f1b (zbv/dualpipev are fixed at 2)",
    )
    ap.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args()

    rows = []
    for pp in args.pp:
        for m in args.microbatches:
            for name in args.schedules:
                vpps = args.vpp if name == "interleaved_1f1b" else [SCHEDULES[name][1]]
                rows.extend(bubble_row(name, pp, m, v) for v in vpps)
    print(
        f"torch {torch.__version__}; costs F=1 B=2 I=1 W=1, comms free; "
        "makespan in per-stage units (compare bubble, not makespan, across vpp)\n"
    )
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": [asdict(r) for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
