"""train.cuda_graph=step against the eager step, same job, same process: median step time, tokens/s,
MFU and the trainer's peak memory of the steps after the capture, and the ratio
(moevlm.train.step_graph).

    python bench/step_graph.py [--steps 20] [--warmup 3] [--rows text|images|videos] KEY=VALUE...  # CUDA

Both runs build the masks a captured step builds (static, device-only), read the same rows from the
same loader seed and log every step (`--rows`: text rows, the default, or text rows with images
or with videos); the graph run's first `warmup` steps (eager) and its capture
step are left out of its medians, the same steps of the eager run out of its.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROWS = {
    "text": ["data.pack.max_patches=0", "data.pack.max_videos=0", "data.pack.oversize=truncate"],
    "images": ["data.pack.max_videos=0"],
    "videos": ["data.pack.max_patches=0", "data.pack.oversize=truncate"],
}


def run(
    overrides: list[str], steps: int, warmup: int, graphed: bool, root: Path, rows: str = "text"
) -> dict:
    from moevlm.config import compose_job
    from moevlm.parallel.compile import use_static_masks
    from moevlm.train.trainer import Trainer

    name = "graph" if graphed else "eager"
    mode = ["train.cuda_graph=step", f"train.cuda_graph_warmup={warmup}"] if graphed else []
    job = compose_job(
        [*overrides, *ROWS[rows], *mode, f"train.steps={steps}", "train.log_every=1"]
        + [f"train.run_dir={root / name}", "train.checkpoint_at_end=false"]
        + ["train.require_loss_decrease=false", "train.tensorboard=false"]
    )
    trainer = Trainer(job)
    use_static_masks(trainer.model)
    code = trainer.run()
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    lines = (root / name / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines][warmup + 1 :]
    med = {
        k: statistics.median(float(r[k] or 0) for r in recs)
        for k in ("step_time_s", "tokens_per_s", "mfu")
    }
    # the trainer's peak per logged step (a replay's: its capture's)
    peak = max(float(r["mem_gib"]) for r in recs)
    return {"mode": name, "exit": int(code), "steps": len(recs), "peak_gib": peak, **med}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rows", choices=sorted(ROWS), default="text")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/step_graph.py needs a CUDA device (CUDA graphs)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(a.overrides, a.steps, a.warmup, g, Path(tmp), a.rows) for g in (False, True)]
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {a.rows} rows; "
        f"job: {' '.join(a.overrides)}"
    )
    print("| mode | exit | steps | median step s | tokens/s | MFU | peak GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['exit']} | {r['steps']} | {r['step_time_s']:.4f} | {r['tokens_per_s']:.0f} | "
            f"{r['mfu']:.3f} | {r['peak_gib']:.2f} |"
        )
    eager, graph = rows
    print(f"graph/eager: {eager['step_time_s'] / graph['step_time_s']:.2f}x step speed")
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
