"""Optional Weights & Biases logging: the scalars TensorBoard gets, with the same tags, from rank 0.

    python train.py train.wandb=offline                       # no network: <run_dir>/wandb, `wandb sync` later
    torchrun ... train.py train.wandb=online train.wandb_project=qwen3-vl   # after `wandb login`

`wandb` is imported only when turned on.  The W&B run id is derived from the run directory's path
(WANDB_RUN_ID overrides), so a relaunch continues the same W&B run; entity, name, tags and group
are W&B's own environment variables.  A failed init or log call prints one line and turns W&B off
for the rest of the run.  Why: docs/architecture.md.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path


def run_id(run_dir: Path) -> str:
    """The W&B run id of a run dir: stable across relaunches of the same run dir (letters and digits only)."""
    return "moevlm-" + hashlib.sha1(str(Path(run_dir).absolute()).encode()).hexdigest()[:16]


def run_name(run_dir: Path) -> str:
    """The run dir's last two parts: `2026-05-01/12-00-00`, `runs/a`, `<sweep dir>/3`."""
    return "/".join(Path(run_dir).absolute().parts[-2:])


class WandbLog:
    """A started W&B run: `log(scalars, step)` and `finish()`; a failure turns it off with one line."""

    def __init__(self, run):
        self.run = run

    def log(self, scalars: dict, step: int) -> None:
        if self.run is None:
            return
        try:
            self.run.log(scalars, step=step)
        except Exception as err:
            self.run = None
            _say_off("logging failed", err)

    def finish(self) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        try:
            run.finish()
        except Exception as err:
            _say_off("finish failed", err)


def _say_off(what: str, err: Exception) -> None:
    first = str(err).splitlines()[0] if str(err) else ""
    print(
        f"W&B {what} ({type(err).__name__}: {first}); W&B is off for the rest of this run, metrics.jsonl and "
        "TensorBoard go on (`wandb login`, or train.wandb=offline)",
        file=sys.stderr,
        flush=True,
    )


def start_wandb(job, run_dir: Path, rank: int) -> WandbLog | None:
    """The trainer's W&B run: rank 0 only; None when train.wandb=disabled or the run cannot start."""
    t = job.train
    if rank != 0 or t.wandb == "disabled":
        return None
    from omegaconf import OmegaConf

    try:
        import wandb

        run = wandb.init(
            project=t.wandb_project,
            name=None if os.environ.get("WANDB_NAME") else run_name(run_dir),
            id=os.environ.get("WANDB_RUN_ID") or run_id(run_dir),
            resume="allow",
            mode=t.wandb,
            dir=str(run_dir),
            config=OmegaConf.to_container(job, resolve=True),
        )
    except Exception as err:  # not logged in, no network (online), a bad project name
        _say_off("could not start", err)
        return None
    return WandbLog(run)
