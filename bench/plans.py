"""The plans of every recipe at full size, and how plans compare with measured real steps.

    python bench/plans.py recipes              # markdown: every recipe's plan, verdicts on H100/H200/own GPU
    python bench/plans.py recipes --only h100_fsdp model.recompute=full   # one recipe, an override
    python bench/plans.py accuracy             # markdown: plan vs measured step (CPU, fp32; gloo for 4 ranks)
    python bench/plans.py device --recipe h100_1gpu   # a GPU: the plan vs torch.cuda.max_memory_allocated

`recipes` runs `moevlm.plan.report.make_plan` (what `python -m moevlm.plan` prints) for each
conf/experiment/ recipe at its launch size (one training step per rank role on fake tensors),
prints one table row per rank role, the largest communication term, the fit on H100 and H200 (and
the recipe's own GPU) and the dry run's wall time on this machine.  DeepEP and HybridEP are
modelled, never imported (moevlm.dispatch.modelled: the packages' exchange volumes and documented
buffer sizes; named in the table).

`accuracy` is the baseline comparison: the same job measured as the trainer really runs it
(`moevlm.plan.measure`: the Trainer's second step on the plan's budget micro-batches, storages
tracked, collectives counted) beside the plan, with the ratio; the 4-rank layouts run on gloo in
4 processes.

`device` is the same comparison for one recipe on this machine's device, at its real size (one
rank): the plan's peak (dry run on fake CPU tensors) beside the measured step's tracked storages and,
on CUDA, `torch.cuda.max_memory_allocated` / `max_memory_reserved` of that step.  Without a GPU it
runs on the CPU (the tracked figure only), which is how `bench/gpu_suite.sh --smoke` rehearses it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
COMMON = [
    "data.shards=sample",
    "data.num_workers=0",
    "train.steps=2",
    "train.tensorboard=false",
    "train.checkpoint_at_end=false",
    "train.checkpoint_every=0",
    "train.require_loss_decrease=false",
    "train.progress=false",
]
ONE_PROCESS = {
    "tiny": [],
    "tiny, recompute full": ["model.recompute=full"],
    "tiny, 1024-token budgets": ["data.pack.seq_len=1024", "data.pack.max_patches=1024"],
    "tiny, 1024-token budgets, recompute full": [
        "data.pack.seq_len=1024",
        "data.pack.max_patches=1024",
        "model.recompute=full",
    ],
}
FOUR_RANKS = {
    "fsdp tp2 ep2": ["parallel.tp=2", "parallel.ep=2", "parallel.dp_mode=fsdp"],
    "pp2 dp2 (fsdp)": ["parallel.pp=2", "parallel.dp_mode=fsdp"],
    "ddp ep4": ["parallel.ep=4", "parallel.dp_mode=ddp"],
    "fsdp ep4, recompute full": ["parallel.ep=4", "model.recompute=full"],
}


def recipes(only: list[str] | None = None, overrides: list[str] | None = None) -> None:
    """`only`: these recipes (default every one); `overrides`: added to each recipe's command line."""
    from moevlm.config import compose_job
    from moevlm.plan.devices import GPUS, recipe_gpu
    from moevlm.plan.report import make_plan

    names = only or sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
    print(
        "| recipe | world | rank (role) | params | grads | optimizer | activations | peak GiB | "
        "largest collective per step | bubble | H100 | H200 | own GPU | dry run s | "
        "three largest at the peak (kind, module: GiB) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---|---:|---|---|---|---:|---|")
    for name in names:
        job = compose_job([f"+experiment={name}", "data.shards=sample", *(overrides or [])])
        modelled = job.model.dispatcher in ("deepep", "hybridep")
        note = f" ({job.model.dispatcher}: modelled)" if modelled else ""
        own = recipe_gpu(name)
        world = job.parallel.world_size or 1
        t0 = time.perf_counter()
        out = make_plan(job, world, own)
        seconds = time.perf_counter() - t0
        for i, r in enumerate(out["ranks"]):
            terms = [(b, f"{g} {k}") for g, ks in r["comm_bytes"].items() for k, b in ks.items()]
            big = max(terms, default=(0, "none"))
            verdict = lambda gpu: "fits" if GPUS[gpu].fits(r["peak_bytes"]) else "**no**"  # noqa: E731
            print(
                f"| {name + note if i == 0 else ''} | {world if i == 0 else ''} | {r['rank']} "
                f"({r['role']}) | {r['params_bytes'] / GiB:.1f} | {r['grads_bytes'] / GiB:.1f} | "
                f"{r['optimizer_bytes'] / GiB:.1f} | {r['activation_peak_bytes'] / GiB:.1f} | "
                f"{r['peak_bytes'] / GiB:.1f} | {big[1]}: {big[0] / GiB:.1f} GiB | "
                f"{100 * out['bubble']:.1f}% | {verdict('h100')} | {verdict('h200')} | "
                f"{own}: {verdict(own)} | {seconds if i == 0 else r['seconds']:.0f} | "
                f"{_largest(r['attribution'])} |",
                flush=True,
            )


def _largest(attribution: dict, n: int = 3) -> str:
    """The `n` largest (kind, module) terms of a rank's peak."""
    terms = attribution.get("by_kind_and_module", [])[:n]
    return "; ".join(
        f"{t['kind']}, {t['module'] or '(outside modules)'}: {t['bytes'] / GiB:.1f}" for t in terms
    )


def _ratio(plan: float, real: float) -> str:
    return f"{plan / real:.4f}" if real else "—"


def accuracy() -> None:
    from moevlm.config import compose_job
    from moevlm.plan.dry_run import dry_run
    from moevlm.plan.measure import measure_trainer_step

    print(
        "| job | ranks | rank | params (plan = real) | peak plan MiB | peak real MiB | plan/real | "
        "collective bytes plan = real |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---|")
    for name, extra in ONE_PROCESS.items():
        d = tempfile.mkdtemp()
        job = compose_job(COMMON + [f"train.run_dir={d}", "train.global_batch_size=2", *extra])
        plan, real = dry_run(job, bf16=False), measure_trainer_step(job)
        print(
            f"| {name} | 1 | 0 | {plan.params_bytes == real['params_bytes']} | "
            f"{plan.peak_bytes / 2**20:.2f} | {real['peak_bytes'] / 2**20:.2f} | "
            f"{_ratio(plan.peak_bytes, real['peak_bytes'])} | {plan.comm_bytes == real['comm_bytes']} |",
            flush=True,
        )
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp()
    mp.spawn(_four_ranks, args=(tmp,), nprocs=4, join=True)
    for name in FOUR_RANKS:
        for rank in range(4):
            real = json.loads(Path(f"{tmp}/{_slug(name)}.{rank}.json").read_text())
            plan = dry_run(_four_rank_job(name, f"{tmp}/plan"), rank=rank, bf16=False)
            same = plan.comm_bytes == real["comm_bytes"]
            total = sum(b for ks in real["comm_bytes"].values() for b in ks.values())
            print(
                f"| {name} | 4 | {rank} | {plan.params_bytes == real['params_bytes']} | "
                f"{plan.peak_bytes / 2**20:.2f} | {real['peak_bytes'] / 2**20:.2f} | "
                f"{_ratio(plan.peak_bytes, real['peak_bytes'])} | {same} ({total / 2**20:.1f} MiB) |",
                flush=True,
            )


def device(recipe: str | None, overrides: list[str]) -> None:
    """The plan of `recipe` (None: the embedded default) beside its measured step on this machine."""
    import torch

    from moevlm.config import compose_job
    from moevlm.plan.dry_run import dry_run
    from moevlm.plan.measure import measure_trainer_step

    d = tempfile.mkdtemp()
    args = [f"+experiment={recipe}"] if recipe else []
    job = compose_job(args + COMMON + [f"train.run_dir={d}", *overrides])
    cuda = torch.cuda.is_available() and job.train.device in ("auto", "cuda")
    where = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})" if cuda else "CPU"
    print(
        f"device: {where}; torch {torch.__version__}; job {recipe or 'the embedded default'} "
        f"{' '.join(overrides)}; precision {job.train.precision}; "
        f"micro-batches per step {job.train.global_batch_size // job.train.micro_batch_size}"
    )
    t0 = time.perf_counter()
    plan = dry_run(job)
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    real = measure_trainer_step(job)
    real_s = time.perf_counter() - t0
    cuda_max = real.get("cuda_max_allocated_bytes")
    reserved = real.get("cuda_max_reserved_bytes")
    gib = lambda b: f"{b / GiB:.2f}" if b else "n/a"  # noqa: E731
    print(
        "\n| job | params plan = real | optimizer plan = real | peak plan GiB | peak tracked GiB | "
        "cuda max allocated GiB | cuda max reserved GiB | plan/tracked | plan/cuda allocated | "
        "dry run s | measured s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {recipe or 'default'} | {plan.params_bytes == real['params_bytes']} | "
        f"{plan.optimizer_bytes == real['optimizer_bytes']} | {gib(plan.peak_bytes)} | "
        f"{gib(real['peak_bytes'])} | {gib(cuda_max)} | {gib(reserved)} | "
        f"{_ratio(plan.peak_bytes, real['peak_bytes'])} | "
        f"{_ratio(plan.peak_bytes, cuda_max) if cuda_max else 'n/a'} | {plan_s:.1f} | {real_s:.1f} |",
        flush=True,
    )


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _four_rank_job(name: str, run_dir: str):
    from moevlm.config import compose_job

    return compose_job(
        COMMON
        + [f"train.run_dir={run_dir}", "parallel.world_size=4", "data.streams=4"]
        + ["train.global_batch_size=8", *FOUR_RANKS[name]]
    )


def _four_ranks(rank: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    from moevlm.plan.measure import measure_trainer_step

    os.environ.update(WORLD_SIZE="4", RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=4)
    torch.set_num_threads(1)
    for name in FOUR_RANKS:
        got = measure_trainer_step(_four_rank_job(name, f"{tmp}/{_slug(name)}"))
        Path(f"{tmp}/{_slug(name)}.{rank}.json").write_text(json.dumps(got))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no interpreter finalization under live gloo threads (see bench/dispatch.py)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["recipes", "accuracy", "device"])
    ap.add_argument(
        "--only", metavar="R1,R2", help="recipes: these only, comma-separated (default all)"
    )
    ap.add_argument(
        "--recipe", help="device: the conf/experiment/ recipe (default: the embedded default job)"
    )
    ap.add_argument(
        "overrides",
        nargs="*",
        help="recipes, device: config overrides added to the job(s), e.g. model.recompute=full",
    )
    return ap


def main() -> None:
    # intermixed: overrides may follow --recipe (gpu_suite.sh passes them so)
    args = parser().parse_intermixed_args()
    only = args.only.split(",") if args.only else None
    if args.what == "recipes":
        recipes(only, args.overrides)
    elif args.what == "device":
        device(args.recipe, args.overrides)
    else:
        accuracy()


if __name__ == "__main__":
    main()
