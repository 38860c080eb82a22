"""Pipeline bubble fraction of torch.distributed.pipelining schedules, simulated, as a table.

The simulation (torch's own per-rank action lists replayed with unit costs F = 1, B = 2, I = 1,
W = 1, communication free; the repair of torch's 1F1B off-by-one; the completeness and deadlock
checks) lives in `moevlm/parallel/pipeline_bubble.py` (the method: docs/architecture.md,
"Pipeline split and schedule"); the planner reports the same number. This script runs it over a
grid of configurations and prints one row per configuration: the bubble, the makespan in
per-stage units (not comparable across vpp; the bubble is), the busy time per rank (3 * vpp * m
on every rank for all five schedules) and a note when torch refuses the configuration, when its
action lists are invalid, or when the 1F1B repair was applied.

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

from moevlm.parallel.pipeline_bubble import InvalidSchedule, ScheduleRefused, simulate_schedule


def _formula_single(p: int, m: int, v: int) -> Fraction:
    return Fraction(p - 1, m + p - 1)


def _formula_interleaved(p: int, m: int, v: int) -> Fraction:
    return Fraction(p - 1, v * m + p - 1)


# schedule name (moevlm.parallel.pipeline_schedules.SCHEDULES) -> (default stages per rank, textbook
# formula)
SCHEDULES = {
    "gpipe": (1, _formula_single),
    "1f1b": (1, _formula_single),
    "interleaved_1f1b": (2, _formula_interleaved),
    "zbv": (2, None),
    "dualpipev": (2, None),
}
MUST_MATCH_FORMULA = ("gpipe", "1f1b")


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


def bubble_row(name: str, pp: int, m: int, vpp: int) -> Row:
    """One table row: the simulated bubble beside the formula, or why there is none."""
    formula_fn = SCHEDULES[name][1]
    row = Row(name, pp, vpp, m)
    row.formula = float(formula_fn(pp, m, vpp)) if formula_fn else None
    try:
        run = simulate_schedule(name, pp, m, vpp)
    except ScheduleRefused as exc:
        row.note = "torch refused: " + exc.reason
        return row
    except InvalidSchedule as exc:
        row.note = f"invalid schedule: {exc.reason}"
        return row
    if run.repaired_1f1b:
        row.note = f"torch IR off by one (last rank lists F1..F{m}); repaired"
    if name in MUST_MATCH_FORMULA:
        assert run.bubble == formula_fn(pp, m, vpp), (name, pp, m, run.bubble)
    row.bubble, row.makespan, row.busy_per_rank = float(run.bubble), run.makespan, list(run.busy)
    row.placement = run.placement
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
                vpps = args.vpp if name == "interleaved_1f1b" else [SCHEDULES[name][0]]
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
