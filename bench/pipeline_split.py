"""The pipeline split a recipe gets: `parallel.pp_layers=auto` beside the even split.

For a recipe (`+experiment=NAME`, any overrides) and several pipeline layouts,
prints the decoder layers per stage and every stage's (and rank's) share of the
training FLOPs per micro-batch, as `moevlm.parallel.pipeline_split` counts them
(the MFU convention of `moevlm.model.flops`, the vision tower charged to stage
0 at the recipe's patch budget, the LM head to the last stage), and the largest
stage over the mean.  Baseline: the even split (layers / stages, the remainder
on the first stages), what a framework without a vision-aware split gives.
Pure arithmetic: no device, no process group.

    python bench/pipeline_split.py --experiment gb200_3d --layouts 2 4 2x2:interleaved_1f1b 2x2:zbv
"""

from __future__ import annotations

import argparse

from moevlm.config import compose_job, validate
from moevlm.parallel.pipeline_split import stage_costs, stage_flops


def layout(spec: str) -> tuple[int, int, str]:
    """'4' -> pp 4 1f1b; '2x2:zbv' -> pp 2, vpp 2, zbv."""
    dims, _, schedule = spec.partition(":")
    pp, _, vpp = dims.partition("x")
    return int(pp), int(vpp or 1), schedule or "1f1b"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="gb200_3d")
    ap.add_argument(
        "--world", type=int, default=None, help="processes (default: the recipe's world_size)"
    )
    ap.add_argument("--layouts", nargs="+", default=["2", "4", "2x2:interleaved_1f1b", "2x2:zbv"])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data.pack.max_patches=4096")
    args = ap.parse_args()
    print("| layout | split | FLOP share per stage | per pp rank | max stage / mean |")
    print("|---|---|---|---|---|")
    for spec in args.layouts:
        pp, vpp, schedule = layout(spec)
        job = compose_job(
            [
                f"+experiment={args.experiment}",
                "data.shards=unused",
                f"parallel.pp={pp}",
                f"parallel.vpp={vpp}",
                f"parallel.pp_schedule={schedule}",
                *args.overrides,
            ]
        )
        world = args.world or job.parallel.world_size
        plan = validate(job, world, environment=False).pipeline
        d, t = job.data, job.train
        costs = stage_costs(
            validate(job, world, environment=False).model,
            rows=t.micro_batch_size,
            seq_len=d.pack.seq_len,
            max_patches=d.pack.max_patches,
            image_patches=d.image.max_pixels // d.image.patch_size**2,
            freeze_vision=job.model.freeze_vision,
        )
        K, L = plan.num_stages, len(costs.layers)
        even = tuple(L // K + (i < L % K) for i in range(K))
        for name, split in (("even", even), ("auto", plan.layers)):
            flops = stage_flops(costs, split)
            total = sum(flops)
            ranks = [sum(flops[s] for s in plan.stages_of(r)) / total for r in range(pp)]
            print(
                f"| pp{pp} vpp{vpp} {schedule}, {name} | {','.join(map(str, split))} | "
                f"{', '.join(f'{100 * f / total:.1f}%' for f in flops)} | "
                f"{', '.join(f'{100 * r:.1f}%' for r in ranks)} | {max(flops) / (total / K):.3f} |"
            )
    print(
        f"\nper micro-batch: vision tower {costs.first / 1e12:.1f} TFLOP = {costs.first / costs.layers[-1]:.1f} "
        f"decoder layers ({costs.layers[-1] / 1e12:.2f} TFLOP each), LM head {costs.last / 1e12:.1f} TFLOP"
    )


if __name__ == "__main__":
    main()
