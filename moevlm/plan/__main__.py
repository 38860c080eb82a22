"""`python -m moevlm.plan`: a job's memory and communication per rank, from one dry-run step.

    python -m moevlm.plan +experiment=gb200_3d                    # the recipe's launch size and GPU
    python -m moevlm.plan +experiment=h100_fsdp --gpu h200 --json
    python -m moevlm.plan +experiment=h100_fsdp parallel.ep=4 model.recompute=full --world 16
    python -m moevlm.plan +experiment=h100_fsdp --world 64 --search              # the top 10 layouts
    python -m moevlm.plan +experiment=h100_fsdp --world 16 --search --only pp=1 --only dp_mode=fsdp,ddp
    python -m moevlm.plan +experiment=h100_fsdp --world 64 parallel.dp_replicate=8   # HSDP: 8 replicas

The job is composed and validated as `train.py` composes it (the same overrides; `data.shards`
defaults to the sample set, since a plan reads no data).  For each distinct rank role of the layout
(every pipeline rank's stages differ; the ranks of one stage hold the same shapes under balanced
routing) one training step runs on fake tensors (`moevlm.plan.dry_run`); each collective's group is
reported with its size, its link and its bytes on the wire (`comm_groups`).  Exit status: 0 when every
rank fits the GPU, 9 when one does not, 2 for a config error (`moevlm.train.exit_codes`).

`--search` ranks the layouts of the job on `--world` GPUs instead (`moevlm.plan.search`: the
candidate space, the extrapolated dry runs, the step time model and what overlaps): the top
`--top` that fit, then every other candidate grouped by the reason it was left out.  `--only
FIELD=V1,V2` sets the values a field of the space takes (tp, cp, pp, vpp, ep, etp, dp_mode,
recompute, micro_batch_size, dp_replicate (a number, or nodes: one HSDP replica per NVLink domain);
repeatable), `--full-space` searches the whole space rather than the
default reduction.  Exit status: 0 when a layout fits, 9 when none does.
"""

from __future__ import annotations

import argparse
import json
import sys

from moevlm.plan.devices import gpu as find_gpu
from moevlm.train.exit_codes import ExitCode

GiB = 2**30


def role_ranks(plan) -> list[int]:
    """One rank per distinct role: pipeline rank 0, a middle one, the last (pp is the outermost
    dimension, so pipeline rank k starts at k x world / pp)."""
    dims = plan.dims
    stages = sorted({0, dims.pp // 2, dims.pp - 1}) if dims.pp > 2 else list(range(dims.pp))
    return [k * (dims.world // dims.pp) for k in stages]


def pipeline_bubble(plan) -> float:
    """The idle share of the schedule's time, simulated on torch's own schedule (0 without stages)."""
    return plan.pipeline.bubble if plan.pipeline is not None else 0.0


def make_plan(job, world: int, gpu_name: str) -> dict:
    """The plan of every rank role of `job` on `world` ranks against the GPU `gpu_name` (a dict: the
    JSON `--json` prints)."""
    from moevlm.plan.dry_run import dry_run
    from moevlm.config import validate

    plan = validate(job, world, environment=False)
    device = find_gpu(gpu_name)
    ranks = []
    for rank in role_ranks(plan):
        r = dry_run(job, world=world, rank=rank).as_dict()
        r["fits"] = device.fits(r["peak_bytes"])
        r["comm_groups"] = comm_groups(r["comm_bytes"], plan.dims, device, rank)
        ranks.append(r)
    return {
        "world": world,
        "layout": plan.dims.describe(),
        "micro_batches": plan.grad_accum,
        "gpu": gpu_name,
        "gpu_name": device.name,
        "device_memory_bytes": device.memory_bytes,
        "usable_bytes": device.memory_bytes - device.headroom_bytes,
        "bubble": pipeline_bubble(plan),
        "schedule": plan.pipeline.schedule if plan.pipeline else None,
        "fits": all(r["fits"] for r in ranks),
        "ranks": ranks,
    }


def comm_groups(comm_bytes: dict, dims, device, rank: int = 0) -> dict:
    """Per group of `comm_bytes`: its size (`ranks`), its link (`nvlink` or `network`, as the search's
    time model takes it) and per collective the bytes one GPU sends on the wire
    (`moevlm.plan.search.wire_bytes`).  The groups are rank 0's (a later stage's have the same size)."""
    from moevlm.plan.search import _group_ranks, link_gbps, wire_bytes

    out = {}
    for group, kinds in comm_bytes.items():
        n = len(_group_ranks(group, dims))
        link = "nvlink" if link_gbps(group, dims, device) == device.nvlink_gbps else "network"
        out[group] = {
            "ranks": n,
            "link": link,
            "wire_bytes": {k: wire_bytes(k, b, n) for k, b in kinds.items()},
        }
    return out


def format_plan(out: dict) -> str:
    g = lambda b: f"{b / GiB:.1f}"  # noqa: E731
    lines = [
        f"plan: {out['world']} x {out['gpu_name']} ({out['layout']}); {out['micro_batches']} "
        f"micro-batches per step; usable memory {g(out['usable_bytes'])} GiB of "
        f"{g(out['device_memory_bytes'])} GiB",
        "",
        "| rank | role | params GiB | grads GiB | optimizer GiB | activations GiB | peak GiB | fits |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in out["ranks"]:
        lines.append(
            f"| {r['rank']} | {r['role']} | {g(r['params_bytes'])} | {g(r['grads_bytes'])} | "
            f"{g(r['optimizer_bytes'])} | {g(r['activation_peak_bytes'])} | {g(r['peak_bytes'])} | "
            f"{'yes' if r['fits'] else 'NO'} |"
        )
    if any(r.get("optimizer_offload") for r in out["ranks"]):
        how = {
            "host": "host AdamW: fp32 masters, gradient buffers and AdamW state in host memory",
            "fsdp": "FSDP2 CPU offload: parameter shards, their gradients and AdamW state in host memory",
        }[out["ranks"][0]["optimizer_offload"]]
        lines += [
            "",
            f"optimizer offload ({how}; the peak above is the device's):",
            "",
            "| rank | off the device GiB | host memory GiB | host->device GiB per step | "
            "device->host GiB per step |",
            "|---:|---:|---:|---:|---:|",
        ]
        for r in out["ranks"]:
            lines.append(
                f"| {r['rank']} | {g(r['offloaded_bytes'])} | {g(r['optimizer_host_bytes'])} | "
                f"{g(r['h2d_bytes'])} | {g(r['d2h_bytes'])} |"
            )
    if any(r.get("activation_offload_bytes") for r in out["ranks"]):
        lines += [
            "",
            "activation offload (model.offload_modules): the peaks above count what stays on the device; "
            "the offloaded activations are in host memory",
            "",
            "| rank | copied to host per step GiB | host memory GiB (pinned) |",
            "|---:|---:|---:|",
        ]
        lines += [
            f"| {r['rank']} | {g(r['activation_offload_bytes'])} | {g(r['activation_host_bytes'])} |"
            for r in out["ranks"]
        ]
    for r in out["ranks"]:
        lines += ["", f"communication per step, rank {r['rank']} ({r['role']}):", ""]
        lines += [
            "| group | ranks | link | collective | GiB per step | wire GiB per GPU |",
            "|---|---:|---|---|---:|---:|",
        ]
        for group, kinds in r["comm_bytes"].items():
            info = r["comm_groups"][group]
            for kind, b in kinds.items():
                lines.append(
                    f"| {group} | {info['ranks']} | {info['link']} | {kind} | {b / GiB:.3f} "
                    f"| {info['wire_bytes'][kind] / GiB:.3f} |"
                )
        if not r["comm_bytes"]:
            lines.append("| (none: one rank) | | | | | |")
    if out["schedule"]:
        lines += [
            "",
            f"pipeline bubble ({out['schedule']}): {100 * out['bubble']:.1f}% of the step",
        ]
    worst = max(out["ranks"], key=lambda r: r["peak_bytes"])
    if out["fits"]:
        verdict = (
            f"verdict: fits {out['gpu_name']}: the fullest rank ({worst['rank']}) peaks at "
            f"{g(worst['peak_bytes'])} GiB of {g(out['usable_bytes'])} GiB usable"
        )
    else:
        verdict = (
            f"verdict: does NOT fit {out['gpu_name']}: rank {worst['rank']} peaks at "
            f"{g(worst['peak_bytes'])} GiB, {g(worst['peak_bytes'] - out['usable_bytes'])} GiB over "
            f"the {g(out['usable_bytes'])} GiB usable; recompute (model.recompute=full), shorter "
            "budgets (data.pack.*), or more sharding (parallel.ep, parallel.pp, more ranks) lower it"
        )
    seconds = sum(r["seconds"] for r in out["ranks"])
    lines += ["", verdict, f"(dry run: {seconds:.1f} s for {len(out['ranks'])} rank role(s))"]
    return "\n".join(lines)


def parse_only(items: list[str]) -> dict[str, list]:
    """`--only FIELD=V1,V2` options as search's `fields` (numbers as ints, "tp" for etp kept)."""
    fields: dict[str, list] = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--only {item!r}: expected FIELD=V1,V2 (e.g. --only pp=1,2)")
        fields[name.strip()] = [
            int(v) if v.strip().isdigit() else v.strip() for v in values.split(",")
        ]
    return fields


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


def main(argv: list[str] | None = None) -> int:
    from moevlm.errors import ConfigError
    from moevlm.config import check_overrides, compose_job

    ap = argparse.ArgumentParser(
        prog="python -m moevlm.plan", description=__doc__.split("\n")[0], add_help=True
    )
    ap.add_argument("--world", type=int, default=None, help="ranks (default parallel.world_size)")
    ap.add_argument(
        "--gpu", default=None, help="h100 | h200 | b200 | gb200 (default from the recipe)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--search", action="store_true", help="rank the layouts on --world GPUs")
    ap.add_argument("--top", type=int, default=10, help="--search: layouts to rank (10)")
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="FIELD=V1,V2",
        help="--search: a field's values",
    )
    ap.add_argument("--full-space", action="store_true", help="--search: no default reduction")
    ap.add_argument(
        "--max-dry-runs", type=int, default=None, help="--search: stop after this many dry runs"
    )
    args, overrides = ap.parse_known_args(argv)
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
        gpu_name = args.gpu or next(
            (k for k in ("gb200", "b200", "h200", "h100") if experiment.startswith(k)), "h100"
        )
        find_gpu(gpu_name)
        world = args.world or job.parallel.world_size or 1
        if args.search:
            text, fits = run_search(job, world, gpu_name, args)
        else:
            out = make_plan(job, world, gpu_name)
            text, fits = json.dumps(out) if args.json else format_plan(out), out["fits"]
    except (ConfigError, ValueError) as err:
        print(f"config error: {err}", file=sys.stderr)
        return ExitCode.CONFIG
    print(text)
    return ExitCode.OK if fits else ExitCode.DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main())
