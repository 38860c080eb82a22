"""The candidates of a layout search: one `Layout` per setting of the parallel dims, recompute
and micro-batch, the space they are drawn from, and which of them `validate()` accepts.

    space = candidate_space(job, world=16, g=gpu("h100"))     # field -> values (less NARROWED)
    plans, invalid, layouts = enumerate_layouts(job, 16, space)
    layout.overrides()   # ["parallel.tp=2", ...]: the command line that gives it

The space and its default reduction: docs/architecture.md, "The planner".
"""

from __future__ import annotations

import copy
import re
from dataclasses import asdict, dataclass

from moevlm.errors import ConfigError
from moevlm.plan.devices import Gpu

RECOMPUTE = ("none", "selective", "full")  # less memory, more FLOPs, left to right
SCHEDULE = {1: "1f1b", 2: "interleaved_1f1b"}  # vpp -> schedule


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

    @classmethod
    def of(cls, job) -> Layout:
        """The layout `job` (a JobConfig object) sets."""
        p = job.parallel
        return cls(
            p.tp,
            p.cp,
            p.pp,
            p.vpp or 1,
            p.ep,
            p.etp,
            p.dp_mode,
            job.model.recompute,
            job.train.micro_batch_size,
            p.dp_replicate,
        )

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


# ------------------------------------------------------------------ the candidates
# The default search leaves these values out of the full space (docs/architecture.md); search's
# `full_space=True` or `fields` brings them back.
NARROWED = {"etp": [1], "dp_mode": ["fsdp"], "micro_batch_size": [1], "dp_replicate": [1]}
# "nodes": one HSDP replica per NVLink domain (world / domain replicas, each sharded within a domain)
NODES = "nodes"


def candidate_space(job, world: int, g: Gpu, full: bool = False) -> dict[str, list]:
    """The values each field takes (docs/architecture.md): the full space, or less `NARROWED`."""
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


def enumerate_layouts(job, world: int, space: dict) -> tuple[dict, list[Left], list[Layout]]:
    """(layout -> its JobPlan, the invalid ones with validate's first line, all in order)."""
    from moevlm.config import validate

    plans, invalid = {}, []
    layouts = candidates(space)
    for lay in layouts:
        try:
            plans[lay] = validate(lay.apply(job, world), world, environment=False)
        except (ConfigError, ValueError) as err:
            invalid.append(Left(lay, f"invalid: {_first_line(err)}"))
    return plans, invalid, layouts
