"""The planner's report of one job: every rank role's memory and communication from one dry-run
step, against a GPU, as the dict `--json` prints and as markdown.

    out = make_plan(job, world=16, gpu_name="h100")   # {"fits", "ranks": [...], "bubble", ...}
    print(format_plan(out))                           # tables per rank role, then the verdict

A rank role: pipeline rank 0, a middle one and the last (every pipeline rank's stages differ; the
ranks of one stage hold the same shapes under balanced routing).
"""

from __future__ import annotations

from moevlm.plan.devices import gpu as find_gpu

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
    from moevlm.config import validate
    from moevlm.plan.dry_run import dry_run

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
    (`moevlm.plan.step_time.wire_bytes`).  The groups are rank 0's (a later stage's have the same size)."""
    from moevlm.plan.step_time import group_ranks, link_gbps, wire_bytes

    out = {}
    for group, kinds in comm_bytes.items():
        n = len(group_ranks(group, dims))
        link = "nvlink" if link_gbps(group, dims, device) == device.nvlink_gbps else "network"
        out[group] = {
            "ranks": n,
            "link": link,
            "wire_bytes": {k: wire_bytes(k, b, n) for k, b in kinds.items()},
        }
    return out


def format_attribution(r: dict, top: int = 8) -> list[str]:
    """The rank's peak by kind, by module and its largest storages (kind, module, the op that made
    them), as markdown lines."""
    a = r.get("attribution")
    if not a:
        return []
    g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    peak = r["peak_bytes"] or 1
    kinds = " · ".join(f"{k} {g(b)}" for k, b in a["by_kind"].items())
    lines = [
        "",
        f"the peak of rank {r['rank']} ({r['role']}), {g(r['peak_bytes'])} GiB, by kind (GiB): {kinds}",
        "",
        "| largest at the peak: kind | module | made by | phase | GiB | share |",
        "|---|---|---|---|---:|---:|",
    ]
    for x in a["top"][:top]:
        lines.append(
            f"| {x['kind']} | {x['module'] or '(outside modules)'} | {x['op']} | {x['phase']} | "
            f"{g(x['bytes'])} | {100 * x['bytes'] / peak:.1f}% |"
        )
    lines += ["", "| by module (every kind) | GiB | share |", "|---|---:|---:|"]
    for m, b in list(a["by_module"].items())[:top]:
        lines.append(f"| {m} | {g(b)} | {100 * b / peak:.1f}% |")
    return lines


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
        lines += format_attribution(r)
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
