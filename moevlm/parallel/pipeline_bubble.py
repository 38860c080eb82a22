"""The pipeline bubble of a torch.distributed.pipelining schedule, simulated from torch's own
per-rank action lists under unit costs (F = 1, B = 2, I = 1, W = 1; communication free), so a plan
can report the idle fraction of the schedule a job will run.

    schedule_bubble("1f1b", pp=4, microbatches=8)            # 3/11 = 0.2727...
    run = simulate_schedule("zbv", pp=4, microbatches=8, vpp=2)
    run.bubble, run.makespan, run.busy, run.placement        # exact Fraction and the details

bubble = sum over ranks (makespan - busy_r) / (num_ranks * makespan).  torch refusing a
configuration raises `ScheduleRefused`, incomplete or deadlocked action lists `InvalidSchedule`
(both ValueError).  The method: docs/architecture.md, "Pipeline split and schedule".
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from moevlm.parallel.pipeline_schedules import SCHEDULES, schedule_name

COST = {"F": 1, "B": 2, "I": 1, "W": 1}


class ScheduleError(ValueError):
    """A schedule configuration has no simulated bubble. `reason` is the cause on one line,
    without the configuration, for callers (the bench's table) that show the configuration
    themselves; the message adds which configuration it was."""

    def __init__(self, reason: str, where: str | None = None):
        super().__init__(reason if where is None else f"{where}: {reason}")
        self.reason = reason


class ScheduleRefused(ScheduleError):
    """torch's schedule class refuses the configuration (too few micro-batches, a stages-per-rank
    count the schedule does not run, ...); `reason` is torch's exception, type and message."""


class InvalidSchedule(ScheduleError):
    """torch's action lists are incomplete or deadlock under the dependencies (a torch bug)."""


@dataclass(frozen=True)
class Op:
    """One compute action of a stage: kind F, B, I or W, for micro-batch `mb`."""

    kind: str
    stage: int
    mb: int


@dataclass(frozen=True)
class ScheduleRun:
    """One simulated step of a schedule: makespan and busy time per rank in per-stage cost
    units, the stages each rank holds, and whether torch's 1F1B off-by-one was repaired."""

    schedule: str
    pp: int
    vpp: int
    microbatches: int
    makespan: int
    busy: tuple[int, ...]
    placement: dict[int, list[int]]
    repaired_1f1b: bool = False

    @property
    def bubble(self) -> Fraction:
        """Idle time over ranks x makespan, exact."""
        return Fraction(sum(self.makespan - b for b in self.busy), self.pp * self.makespan)


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


def torch_rank_ops(schedule: str, pp: int, microbatches: int, vpp: int) -> list[list[Op]]:
    """Each rank's ordered compute ops, as torch's schedule class generates them; raises
    ScheduleRefused when the class rejects the configuration."""
    from torch.distributed.pipelining import schedules as pp_schedules

    try:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    except ImportError as exc:  # private module; present in torch 2.11 and 2.13
        import torch

        raise ImportError(
            f"torch {torch.__version__} has no pipelining._schedule_visualizer.get_schedule_ops; "
            "simulating a pipeline schedule needs torch >= 2.11"
        ) from exc

    name = schedule_name(schedule)
    schedule_cls = getattr(pp_schedules, SCHEDULES[name][0])
    try:
        ranks = get_schedule_ops(schedule_cls, pp, microbatches, num_stages_per_rank=vpp)
    except Exception as exc:  # torch refuses this configuration (ValueError or AssertionError)
        reason = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        raise ScheduleRefused(
            reason, f"torch refuses {_where(name, pp, microbatches, vpp)}"
        ) from exc
    return [[op for a in actions for op in _leaves(a)] for actions in ranks]


def repair_1f1b_last_rank(rank_ops: list[list[Op]], m: int) -> bool:
    """Undo an off-by-one in torch's Schedule1F1B._get_pipeline_order (2.11, 2.13).

    With no warm-up forwards, the last rank's IR bumps the forward counter before its first use
    and lists F1..F{m} instead of F0..F{m-1}. The imperative `_step_microbatches` that actually
    runs 1F1B is unaffected (one warm-up forward on the last stage, then B0 F1 B1 ...), which is
    what the shift gives. Returns whether the bug was present and repaired.
    """
    last = rank_ops[-1]
    if sorted(op.mb for op in last if op.kind == "F") != list(range(1, m + 1)):
        return False
    rank_ops[-1] = [Op("F", op.stage, op.mb - 1) if op.kind == "F" else op for op in last]
    return True


def check_complete(rank_ops: list[list[Op]], num_stages: int, m: int) -> None:
    """Every (stage, mb) has one F and either one B or one I and one W; else InvalidSchedule."""
    seen = [op for ops in rank_ops for op in ops]
    if len(seen) != len(set(seen)):
        raise InvalidSchedule("an action appears twice")
    done = set(seen)
    for s in range(num_stages):
        for mb in range(m):
            has_b = Op("B", s, mb) in done
            has_iw = Op("I", s, mb) in done and Op("W", s, mb) in done
            if Op("F", s, mb) not in done or has_b == has_iw:
                raise InvalidSchedule(f"stage {s} mb {mb}: missing or doubled F/B/I/W")


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
    """Run every rank's list in order; return (makespan, busy time per rank). A rank blocked on
    an input is revisited in the next sweep; no progress in a sweep is a deadlock."""
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
        raise InvalidSchedule("deadlock: " + "; ".join(stuck))
    return max(free), busy


def simulate_schedule(schedule: str, pp: int, microbatches: int, vpp: int = 1) -> ScheduleRun:
    """Build torch's action lists for the schedule, repair and check them, and run them with the
    unit costs. `schedule` is a name of pipeline_schedules.SCHEDULES or one of its aliases; `vpp` is
    the stages per rank (1 for gpipe and 1f1b, 2 for zbv and dualpipev, >= 2 for
    interleaved_1f1b). Raises ScheduleRefused or InvalidSchedule (both ValueError)."""
    name = schedule_name(schedule)
    rank_ops = torch_rank_ops(name, pp, microbatches, vpp)
    repaired = name == "1f1b" and repair_1f1b_last_rank(rank_ops, microbatches)
    try:
        check_complete(rank_ops, pp * vpp, microbatches)
        makespan, busy = simulate(rank_ops, pp * vpp)
    except InvalidSchedule as exc:
        where = f"torch's action lists for {_where(name, pp, microbatches, vpp)}"
        raise InvalidSchedule(exc.reason, where) from exc
    return ScheduleRun(
        schedule=name,
        pp=pp,
        vpp=vpp,
        microbatches=microbatches,
        makespan=makespan,
        busy=tuple(busy),
        placement={r: sorted({op.stage for op in ops}) for r, ops in enumerate(rank_ops)},
        repaired_1f1b=repaired,
    )


def schedule_bubble(schedule: str, pp: int, microbatches: int, vpp: int = 1) -> float:
    """The bubble fraction (idle share of ranks x step time, in [0, 1)) of `schedule` on `pp`
    ranks with `microbatches` micro-batches and `vpp` stages per rank, from torch's own action
    lists under unit costs (see the module docstring). Raises ValueError (ScheduleRefused) when
    torch refuses the configuration, with torch's reason."""
    return float(simulate_schedule(schedule, pp, microbatches, vpp).bubble)


def _where(name: str, pp: int, microbatches: int, vpp: int) -> str:
    return f"{name} with pp={pp}, microbatches={microbatches}, vpp={vpp}"


__all__ = [
    "COST",
    "InvalidSchedule",
    "Op",
    "ScheduleError",
    "ScheduleRefused",
    "ScheduleRun",
    "check_complete",
    "repair_1f1b_last_rank",
    "schedule_bubble",
    "simulate",
    "simulate_schedule",
    "torch_rank_ops",
]
