"""`python -m moevlm.plan`: a job's memory and communication per rank, from one dry-run step.

    python -m moevlm.plan +experiment=gb200_3d                    # the recipe's launch size and GPU
    python -m moevlm.plan +experiment=h100_fsdp --gpu h200 --json
    python -m moevlm.plan +experiment=h100_fsdp --world 64 --search              # the top 10 layouts
    python -m moevlm.plan +experiment=h100_fsdp --world 16 --search --only pp=1 --only dp_mode=fsdp,ddp
    python -m moevlm.plan +experiment=h100_fsdp --fit             # the cheapest changes that make it fit
    python -m moevlm.plan +experiment=h100_1gpu --strict-syncs    # the step's device-to-host reads

The job is composed and validated as `train.py` composes it (`data.shards` defaults to the sample
set: a plan reads no data); the plan is `moevlm.plan.report`'s, the search `moevlm.plan.search`'s.
Exit status: 0 when every rank fits the GPU (--search: a layout fits; --fit: as it is or with the
proposal), 9 when not, 2 for a config error (`moevlm.train.exit_codes`); --strict-syncs: 1 when the
step reads the device from the host (`moevlm.plan.syncs`), --syncs: 0.  Every option: docs/plans.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import NamedTuple

from moevlm.plan.candidates import NODES, RECOMPUTE
from moevlm.plan.devices import gpu as find_gpu
from moevlm.plan.devices import recipe_gpu
from moevlm.plan.report import format_plan, make_plan
from moevlm.train.exit_codes import ExitCode

# the words --only takes beside positive numbers, by field (moevlm.plan.candidates)
WORDS = {
    "etp": ("tp",),
    "dp_replicate": (NODES,),
    "dp_mode": ("fsdp", "ddp"),
    "recompute": RECOMPUTE,
}
NO_NUMBERS = ("dp_mode", "recompute")
SYNCS_FOUND = 1  # --strict-syncs: the step has a device-to-host read


def parse_only(items: list[str]) -> dict[str, list]:
    """`--only FIELD=V1,V2` options as search's `fields` (numbers as ints, "tp" for etp kept); a value
    the field cannot take is a ValueError naming what it takes (an unknown field is search's)."""
    fields: dict[str, list] = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip()
        if not sep or not values:
            raise ValueError(f"--only {item!r}: expected FIELD=V1,V2 (e.g. --only pp=1,2)")
        words = WORDS.get(name, ())
        out = []
        for v in (v.strip() for v in values.split(",")):
            number = v.isdigit() and int(v) >= 1 and name not in NO_NUMBERS
            if not number and v not in words:
                takes = [] if name in NO_NUMBERS else ["positive whole numbers"]
                raise ValueError(
                    f"--only {item!r}: {name} takes {' or '.join([*takes, *map(repr, words)])}, "
                    f"not {v!r}"
                )
            out.append(int(v) if number else v)
        fields[name] = out
    return fields


def positive(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, not {text!r}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse whose refusals are one `config error:` line and exit 2 (no usage block)."""

    def error(self, message: str):
        print(f"config error: {self.prog}: {message} (--help lists the options)", file=sys.stderr)
        raise SystemExit(ExitCode.CONFIG)


def run_search(job, world: int, gpu_name: str, args) -> tuple[str, bool]:
    """The search's report (markdown or JSON) and whether a layout fits."""
    from moevlm.plan.search import format_search, search

    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    result = search(
        job,
        world,
        gpu_name,
        top=args.top,
        full_space=args.full_space,
        fields=parse_only(args.only),
        max_dry_runs=args.max_dry_runs,
        progress=progress,
    )
    text = json.dumps(result.as_dict()) if args.json else format_search(result)
    return text, bool(result.top)


def run_fit(job, world: int, gpu_name: str, args, overrides: list[str]) -> tuple[str, bool]:
    """The fit check's report (markdown or JSON) and whether the job fits, as it is or changed."""
    from moevlm.plan.fit import fit, format_fit

    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    result = fit(job, world, gpu_name, progress=progress)
    world_arg = [f"--world {world}"] if args.world else []
    command = " ".join([*(o for o in overrides if o != "data.shards=sample"), *world_arg])
    command += f" --gpu {gpu_name}"
    text = json.dumps(result.as_dict()) if args.json else format_fit(result, command)
    return text, result.fits


class StepSyncs(NamedTuple):
    """A step's device-to-host reads (`moevlm.plan.syncs`)."""

    records: list  # moevlm.plan.syncs.Sync of the micro-batches run (the last run's)
    lines: list[tuple[str, str, int]]  # (line, ops, count per step), as SyncCounter.by_line
    micro_batches: int
    world: int
    how: str
    seconds: float

    @property
    def count(self) -> int:
        return sum(n for _, _, n in self.lines)


def _syncs_run(job, plan, world: int, micro_batches: int):
    """A SyncCounter over `micro_batches` of the step's dry run."""
    from moevlm.plan.dry_run import run_micro_batches
    from moevlm.plan.syncs import SyncCounter

    counter = SyncCounter("cpu")
    run_micro_batches(job, plan, world, micro_batches, counter)
    return counter


def step_syncs(job, world: int | None = None, every_micro_batch: bool = False) -> StepSyncs:
    """The device-to-host reads of rank 0's whole training step (its micro-batches, the backward,
    the gradient clipping and the optimizer step) at the job's real size: the fake-world dry run
    (`moevlm.plan.dry_run`) on fake CPU tensors, the host's told apart as docs/plans.md says.  As
    the dry run does, not every micro-batch runs: steps of m1 and m2 micro-batches (2 and 3; with
    pipeline stages 2 pp x vpp and that + pp, past the schedule's warm-up) give each line's count
    a + b m, taken at the step's M when every b is whole (else every micro-batch runs)."""
    from moevlm.config import validate
    from moevlm.plan.dry_run import short_steps

    world = world or job.parallel.world_size or 1
    plan = validate(job, world, environment=False)
    M, p = plan.grad_accum, plan.pipeline
    m1, m2 = short_steps(p) if p is not None else (2, 3)
    t0, lines = time.perf_counter(), None
    if not every_micro_batch and M > m2:
        runs = [_syncs_run(job, plan, world, m) for m in (m1, m2)]
        counts = [{(w, ops): n for w, ops, n in r.by_line()} for r in runs]
        lines = _extrapolated(*counts, m1, m2, M)
        how = f"rank 0 of {world}, {m1} and {m2} micro-batches on fake CPU tensors, extrapolated"
    if lines is None:
        runs = [_syncs_run(job, plan, world, M)]
        lines = runs[0].by_line()
        how = f"rank 0 of {world}, fake-world dry run on fake CPU tensors"
    seconds = time.perf_counter() - t0
    return StepSyncs(runs[-1].records, lines, M, world, how, seconds)


def _extrapolated(c1: dict, c2: dict, m1: int, m2: int, M: int) -> list | None:
    """Each line's count at M from its counts at m1 and m2 micro-batches (a + b m); None when a
    line's b is not whole (the micro-batches do not repeat each other's reads)."""
    out = []
    for key in c1.keys() | c2.keys():
        b, rest = divmod(c2.get(key, 0) - c1.get(key, 0), m2 - m1)
        if rest or b < 0:
            return None
        out.append((*key, c1.get(key, 0) + b * (M - m1)))
    return sorted(out, key=lambda x: (-x[2], x[0]))


def format_syncs(found: StepSyncs) -> str:
    """The report: the reads per step, grouped by line, the most first."""
    n = found.count
    head = (
        f"device-to-host syncs per training step: {n} ({found.micro_batches} micro-batches; "
        f"{found.how}; {found.seconds:.1f} s)"
    )
    if not n:
        return head
    width = max(len(w) for w, _, _ in found.lines)
    rows = [f"  {'count':>5}  {'line':<{width}}  ops"]
    rows += [f"  {c:>5}  {w:<{width}}  {ops}" for w, ops, c in found.lines]
    return "\n".join([head, *rows])


def run_syncs(job, world: int, args) -> int:
    """Prints the step's device-to-host reads (`moevlm.plan.syncs`); the exit status by them."""
    found = step_syncs(job, world)
    if args.json:
        records = [r._asdict() for r in found.records]
        print(json.dumps({**found._asdict(), "count": found.count, "records": records}))
    else:
        print(format_syncs(found))
    return SYNCS_FOUND if args.strict_syncs and found.count else ExitCode.OK


def modelled_notes(job, world: int) -> dict[str, str]:
    """The lines a plan adds for what it models instead of running: the job's dispatcher where its
    package is not imported (deepep, hybridep), the Gated DeltaNet layers' kernel (fla)."""
    from moevlm.config import validate

    plan, notes = validate(job, world, environment=False), {}
    spec = plan.dispatcher
    if spec.for_plan().modelled:
        notes["dispatcher_note"] = (
            f"dispatcher: {spec.name} is modelled (the deep_ep package is not imported by a plan): "
            "its exchanges at the package's volumes, its buffers at their documented sizes, counted "
            "in the peaks above (moevlm.dispatch.modelled)"
        )
    if "linear_attention" in plan.model.text.layer_types:
        notes["gdn_note"] = (
            "gated deltanet: its chunked delta rule is planned as flash-linear-attention's kernel runs "
            "it in bf16 (moevlm.model.gdn_modelled); without that package on the GPU the layers keep "
            "more"
        )
    return notes


def main(argv: list[str] | None = None) -> int:
    from moevlm.config import check_overrides, compose_job
    from moevlm.errors import ConfigError

    ap = Parser(prog="python -m moevlm.plan", description=__doc__.split("\n")[0], add_help=True)
    ap.add_argument(
        "--world", type=positive, default=None, help="ranks (default parallel.world_size)"
    )
    ap.add_argument(
        "--gpu", default=None, help="h100 | h200 | b200 | gb200 (default from the recipe)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--search", action="store_true", help="rank the layouts on --world GPUs")
    ap.add_argument("--top", type=positive, default=10, help="--search: layouts to rank (10)")
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="FIELD=V1,V2",
        help="--search: a field's values",
    )
    ap.add_argument("--full-space", action="store_true", help="--search: no default reduction")
    ap.add_argument(
        "--max-dry-runs",
        type=positive,
        default=None,
        help="--search: stop after this many dry runs",
    )
    ap.add_argument(
        "--fit",
        nargs="?",
        const="",
        default=None,
        metavar="GPU",
        help="the cheapest changes that make the job fit GPU (default --gpu), with their costs",
    )
    ap.add_argument(
        "--strict-syncs",
        action="store_true",
        help="the step's device-to-host reads by line; exit 1 when there is one",
    )
    ap.add_argument("--syncs", action="store_true", help="--strict-syncs' report, exit 0")
    args, overrides = ap.parse_known_args(argv)
    if args.fit and "=" in args.fit:  # `--fit model.x=y`: an override, not a GPU
        overrides, args.fit = [*overrides, args.fit], ""
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        ap.error(f"unknown option(s): {' '.join(bad)}")
    if not any(o.startswith("data.shards=") for o in overrides):
        overrides = [*overrides, "data.shards=sample"]  # a plan reads no data
    try:
        check_overrides(overrides)
        job = compose_job(overrides)
        experiment = next(
            (o.split("=", 1)[1] for o in overrides if o.startswith("+experiment=")), ""
        )
        gpu_name = args.fit or args.gpu or recipe_gpu(experiment)
        find_gpu(gpu_name)
        world = args.world or job.parallel.world_size or 1
        if args.strict_syncs or args.syncs:
            return run_syncs(job, world, args)
        if args.fit is not None:
            text, fits = run_fit(job, world, gpu_name, args, overrides)
        elif args.search:
            text, fits = run_search(job, world, gpu_name, args)
        else:
            out = make_plan(job, world, gpu_name)
            notes = modelled_notes(job, world)
            out.update(notes)
            text = json.dumps(out) if args.json else format_plan(out)
            lines = "\n".join(notes.values())
            if lines and not args.json:
                text = text.replace("\nverdict:", f"\n{lines}\n\nverdict:", 1)
            fits = out["fits"]
    except (ConfigError, ValueError) as err:
        print(f"config error: {err}", file=sys.stderr)
        return ExitCode.CONFIG
    print(text)
    return ExitCode.OK if fits else ExitCode.DOES_NOT_FIT
