"""A Hydra sweep's run directories -> one markdown table, one row per job.

    python train.py -m +experiment=h100_1gpu data.shards=DIR train.steps=30 \\
        train.micro_batch_size=1,2 model.recompute=none,selective,full train.compile=false,true \\
        hydra.sweep.dir=sweeps/tuning
    python bench/sweep_table.py sweeps/tuning [--warmup 5] [--out table.md]

    python train.py -m +experiment=sweep_tuning data.shards=DIR hydra.sweep.dir=sweeps/tuning   # the same

(conf/experiment/sweep_tuning.yaml holds that sweep; any sweep works).  A key given on the
command line replaces the config's sweep of it: `... +experiment=sweep_tuning train.compile=true`
runs 6 of the 12 jobs, and the table lists those 6.

Design choices:
- The jobs a sweep has come from Hydra's own record, <dir>/multirun.yaml
  (written before the first job starts): its hydra.sweeper.params (a config's
  sweep) then its command-line overrides are parsed with Hydra's override
  parser and combined as Hydra's basic sweeper does (one value list per key,
  a later override of a key replacing the earlier list in its place, the
  cartesian product, first key outermost), so job N is <dir>/N and a narrowed
  sweep lists only the jobs it ran.  Numbered folders beyond them (an earlier
  sweep's, in a reused directory) are left out.
- Each job's status comes from its record, <dir>/status/N.json, written by
  train.py (moevlm.train.sweep): ok, failed or interrupted with the exit code
  and the reason (its last line of output), or running, which is shown as
  killed when its process (on this host) is gone.  A job of the plan without a
  record never started (the sweep stopped first).  Without records (an older
  sweep), a job with no directory is listed as missing and one with no
  metrics as failed, never dropped.  Without multirun.yaml (a sweep with
  train.run_dir set keeps it in hydra.sweep.dir), the jobs are the recorded
  ones, else the numbered folders, and the swept keys are the config keys
  whose values differ.
- The swept keys' values are read from each job's config.yaml (what ran), not
  from the command line.
- Figures are medians over the logged records after `--warmup` steps (compile
  and allocator warm-up stay out): tokens/s, TFLOP/s, MFU, step time and data
  wait; memory is the maximum; loss is the last.  A job that stopped before
  train.steps is marked incomplete.  Any dynamo counters the records carry
  (`recompiles`, `graph_breaks`) are shown as their last values.
- A run directory (metrics.jsonl inside) instead of a sweep gives a one-row
  table (bench/gpu_suite.sh summarises its training run so).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import socket
import statistics
import sys
from pathlib import Path

import yaml

METRICS = (
    ("tokens_per_s", "tokens/s", "median", ".0f"),
    ("tflops", "TFLOP/s", "median", ".4g"),
    ("mfu", "MFU", "median", ".3f"),
    ("step_time_s", "step s", "median", ".3f"),
    ("data_wait_frac", "data wait", "median", ".1%"),
    ("mem_gib", "peak GiB", "max", ".2f"),
    ("loss", "last loss", "last", ".4f"),
)
COUNTERS = ("recompiles", "graph_breaks")
REASON_CHARS = 160  # a failed job's reason in its cell (the status file holds it whole)


def planned_jobs(sweep_dir: Path) -> tuple[list[str], list[dict[str, str]]] | None:
    """(swept keys, each job's {key: value} as on the command line) from multirun.yaml, or None.
    As Hydra's basic sweeper: the config's sweep, then the command line, one list of values per key,
    a later override of a key replacing its earlier list in its place (`train.compile=true` narrows
    a config's `train.compile: false,true` to one value), the cartesian product in that key order."""
    path = sweep_dir / "multirun.yaml"
    if not path.is_file():
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hydra = yaml.safe_load(path.read_text()).get("hydra") or {}
    # a config's sweep: before the command line's
    params = (hydra.get("sweeper") or {}).get("params") or {}
    task = [f"{k}={v}" for k, v in params.items()] + list(
        hydra.get("overrides", {}).get("task", [])
    )
    values: dict[str, list[str]] = {}
    for o in OverridesParser.create().parse_overrides(task):
        key = o.get_key_element()
        values[key] = (
            list(o.sweep_string_iterator())
            if o.is_sweep_override()
            else [o.get_value_element_as_str()]
        )
    keys = [k for k, v in values.items() if len(v) > 1]
    lists = [[(k, v) for v in values[k]] for k in keys]
    return keys, [dict(combo) for combo in itertools.product(*lists)]


def job_status(record: dict | None, host: str = "") -> str:
    """A status file's record (moevlm.train.sweep) as the table's status cell; "" without one."""
    if not record:
        return ""
    state, code = record.get("status"), record.get("exit_code")
    if state == "ok":
        return "ok"
    if state == "running":
        pid, where = record.get("pid"), record.get("host")
        if where != (host or socket.gethostname()):
            return f"running or killed (pid {pid} on {where})"
        return (
            f"running (pid {pid})" if _alive(pid) else f"killed (pid {pid} gone, no exit recorded)"
        )
    reason = " ".join(str(record.get("reason") or "").split()).replace("|", "\\|")
    if len(reason) > REASON_CHARS:
        reason = reason[: REASON_CHARS - 3] + "..."
    return f"{state} (exit {code}: {reason})" if reason else f"{state} (exit {code})"


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def read_statuses(root: Path) -> dict[int, dict]:
    """Job number -> its status record (<root>/status/<job>.json, written by moevlm.train.sweep)."""
    out = {}
    for path in sorted((root / "status").glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if path.stem.isdigit() and isinstance(record, dict):
            out[int(path.stem)] = record
    return out


def flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        out.update(flat(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def read_job(job_dir: Path) -> dict:
    """{config: flat dict or None, records: [metrics dicts]}."""
    cfg_path, met_path = job_dir / "config.yaml", job_dir / "metrics.jsonl"
    config = flat(yaml.safe_load(cfg_path.read_text())) if cfg_path.is_file() else None
    records = []
    if met_path.is_file():
        for line in met_path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill
    return {"config": config, "records": [r for r in records if "step" in r]}


def summarise(records: list[dict], warmup: int) -> dict:
    kept = [r for r in records if r["step"] > warmup] or records[-1:]
    out = {}
    for key, _, how, _ in METRICS:
        vals = [float(r[key]) for r in kept if r.get(key) is not None]
        vals = [v for v in vals if not math.isnan(v)] if how != "last" else vals
        out[key] = (
            None
            if not vals
            else statistics.median(vals)
            if how == "median"
            else max(vals)
            if how == "max"
            else vals[-1]
        )
    for key in COUNTERS:
        vals = [r[key] for r in records if r.get(key) is not None]
        out[key] = vals[-1] if vals else None
    return out


def _cell(v, fmt: str) -> str:
    if v is None:
        return "n/a"
    try:
        return format(float(v), fmt)
    except (TypeError, ValueError):
        return str(v)


def build_table(sweep_dir: Path, warmup: int = 3) -> str:
    sweep_dir = Path(sweep_dir)
    if (sweep_dir / "metrics.jsonl").is_file():  # one run, not a sweep: a one-row table
        return _one_run(sweep_dir, warmup)
    numbered = sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()),
        key=lambda p: int(p.name),
    )
    jobs = {int(p.name): read_job(p) for p in numbered}
    statuses = read_statuses(sweep_dir)
    plan = planned_jobs(sweep_dir)
    if plan is not None:  # this sweep's jobs: a folder beyond them is an earlier sweep's
        keys, wanted = plan
        ids = list(range(len(wanted)))
    else:
        configs = [j["config"] for j in jobs.values() if j["config"]]
        every = sorted(set().union(*configs)) if configs else []
        keys = [
            k for k in every if k != "train.run_dir" and len({repr(c.get(k)) for c in configs}) > 1
        ]
        wanted, ids = [], sorted(statuses or jobs)
    jobs = {i: j for i, j in jobs.items() if i in ids}
    counters = [
        c
        for c in COUNTERS
        if any(r.get(c) is not None for j in jobs.values() for r in j["records"])
    ]
    head = ["job", *keys, "status", "steps", *[m[1] for m in METRICS], *counters]
    lines = [
        f"sweep {sweep_dir} ({len(ids)} jobs; medians after step {warmup})",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(keys + ["job", "status"]) + "---:|" * (1 + len(METRICS) + len(counters)),
    ]
    for i in ids:
        job = jobs.get(i, {"config": None, "records": []})
        cfg = job["config"] or {}
        asked = wanted[i] if i < len(wanted) else {}
        values = [
            str(cfg.get(k, asked.get(k, "?"))) if cfg else str(asked.get(k, "?")) for k in keys
        ]
        total = cfg.get("train.steps")
        done = max((r["step"] for r in job["records"]), default=0)
        if status := job_status(statuses.get(i)):
            pass
        elif statuses:  # the sweep recorded its jobs: one without a record never started
            status = "not run (the sweep stopped before it)"
        elif i not in jobs:
            status = "missing (no run dir: failed before it started, or the sweep stopped)"
        elif not job["records"]:
            status = "failed (no metrics)"
        elif total is not None and done < total:
            status = f"incomplete ({done}/{total} steps)"
        else:
            status = "ok"
        fig = summarise(job["records"], warmup) if job["records"] else {}
        cells = [_cell(fig.get(k), fmt) for k, _, _, fmt in METRICS] + [
            _cell(fig.get(c), "d") for c in counters
        ]
        lines.append("| " + " | ".join([str(i), *values, status, str(done), *cells]) + " |")
    return "\n".join(lines)


def _one_run(run_dir: Path, warmup: int) -> str:
    job = read_job(run_dir)
    fig = summarise(job["records"], warmup) if job["records"] else {}
    done = max((r["step"] for r in job["records"]), default=0)
    head = ["run", "steps", *[m[1] for m in METRICS]]
    cells = [_cell(fig.get(k), fmt) for k, _, _, fmt in METRICS]
    return "\n".join(
        [
            f"run {run_dir} (medians after step {warmup})",
            "",
            "| " + " | ".join(head) + " |",
            "|---|" + "---:|" * (1 + len(METRICS)),
            "| " + " | ".join([run_dir.name, str(done), *cells]) + " |",
        ]
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "sweep_dir",
        type=Path,
        help="the sweep directory (hydra.sweep.dir, or train.run_dir of a sweep)",
    )
    ap.add_argument(
        "--warmup", type=int, default=3, help="records up to this step are left out of the medians"
    )
    ap.add_argument("--out", type=Path, help="also write the table to this file")
    args = ap.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(
            f"{args.sweep_dir} is not a directory: give the sweep directory (hydra.sweep.dir)",
            file=sys.stderr,
        )
        return 2
    text = build_table(args.sweep_dir, args.warmup)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
