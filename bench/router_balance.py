"""Router balancing options on the embedded default job: loss curve and expert load per option.

    python bench/router_balance.py --steps 50 --out /tmp/router_balance    # every option, one run each
    python bench/router_balance.py --only default,bias                     # some of them

Each option is one `train.py` run of the embedded default (tiny model, the packaged sample images,
CPU) with `train.steps` and `train.log_every=1`, the same seed and data; the table gives the loss at a
few steps (the baseline: `default`, the reference's micro-batch loss with its coefficient) and the expert
load, max over experts / mean, per MoE layer averaged over the last half of the steps (1.0 = even).
`none` turns balancing off (model.aux_loss_coef=0) for the load without any method.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPTIONS = {
    "none": ["model.aux_loss_coef=0"],
    "default": [],
    "global_batch": ["model.moe_aux_loss=global_batch"],
    "sequence": ["model.moe_aux_loss=sequence"],
    "bias": ["model.aux_loss_coef=0", "model.moe_router_bias_rate=0.001"],
    "z_loss": ["model.moe_z_loss_coeff=0.001"],
    "force_balance": ["model.moe_router_force_balance=true"],
}


def run(name: str, steps: int, out: Path) -> list[dict]:
    run_dir = out / name
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists() or len(metrics.read_text().splitlines()) < steps:
        cmd = [sys.executable, str(REPO / "train.py"), f"train.steps={steps}", "train.log_every=1"]
        cmd += [f"train.run_dir={run_dir}", "train.progress=false", "train.resume=none"]
        cmd += ["train.require_loss_decrease=false", "train.checkpoint_at_end=false"]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        subprocess.run(
            cmd + OPTIONS[name], check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL
        )
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def table(results: dict[str, list[dict]], steps: int) -> str:
    marks = sorted({1, steps // 5, steps // 2, steps} - {0})
    head = ["option", *(f"loss@{s}" for s in marks), "aux@last", "load/layer (last half)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, recs in results.items():
        by_step = {r["step"]: r for r in recs}
        tail = [r["expert_load_by_layer"] for r in recs[len(recs) // 2 :]]
        load = [sum(col) / len(col) for col in zip(*tail)]
        aux = recs[-1].get("aux_loss")
        cells = [name, *(f"{by_step[s]['loss']:.4f}" for s in marks)]
        cells += ["-" if aux is None else f"{aux:.3f}", " / ".join(f"{x:.2f}" for x in load)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("outputs/router_balance"))
    ap.add_argument(
        "--only", default=",".join(OPTIONS), help="comma-separated: " + ",".join(OPTIONS)
    )
    a = ap.parse_args()
    results = {}
    for name in a.only.split(","):
        results[name] = run(name, a.steps, a.out)
        print(f"{name}: done", flush=True)
    print(table(results, a.steps))


if __name__ == "__main__":
    main()
