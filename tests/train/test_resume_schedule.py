"""Resuming with another `train.steps`: the lr schedule is rescaled to the new length (the position kept,
the lr following a fresh schedule of the new length from there), said in one log line; the same length
resumes exactly as before; fewer steps than the checkpoint's is refused before anything is moved."""

from __future__ import annotations

import json

import pytest
import torch

from moevlm.config import OptimConfig, compose_job
from moevlm.errors import ConfigError
from moevlm.train.optim import LRSchedule, build_scheduler, fit_resumed_schedule
from moevlm.train.trainer import Trainer

FAST = [
    "data.num_workers=1",
    "data.streams=1",
    "train.log_every=1",
    "train.tensorboard=false",
    "train.require_loss_decrease=false",
    "train.global_batch_size=1",
]


def scheduler(o: OptimConfig, steps: int):
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=o.lr)
    return opt, build_scheduler(opt, o, steps)


def taken(o: OptimConfig, steps: int, n: int) -> dict:
    """The scheduler state after `n` updates of a `steps`-long run."""
    opt, sched = scheduler(o, steps)
    for _ in range(n):
        opt.step()
        sched.step()
    return sched.state_dict()


def resumed(o: OptimConfig, state: dict, steps: int):
    """As the trainer resumes: built from the config for `steps`, then the checkpoint's state loaded."""
    opt, sched = scheduler(o, steps)
    sched.load_state_dict(state)
    return opt, sched, fit_resumed_schedule(sched, o, steps)


def lrs_from(opt, sched, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize(
    "o",
    [
        OptimConfig(lr=1e-2, schedule="cosine", warmup_steps=1, min_lr_ratio=0.1),
        OptimConfig(
            lr=1e-2, schedule="wsd", warmup_steps=1, decay_fraction=0.5, decay_shape="cosine"
        ),
    ],
    ids=["cosine", "wsd"],
)
def test_a_longer_run_follows_the_new_curve_from_the_resumed_step(o):
    state = taken(o, 4, 2)
    # the checkpoint records the length the schedule was built for
    assert state["schedule"]["steps"] == 4
    opt, sched, lines = resumed(o, state, 8)
    fresh = LRSchedule(o, 8)
    # updates 3..8, exactly
    assert lrs_from(opt, sched, 6) == [o.lr * fresh(s) for s in range(2, 8)]
    before = o.lr * LRSchedule(o, 4)(2)
    assert lines == [
        f"train.steps changed from 4 to 8: the {o.schedule} lr schedule is rescaled to 8 steps; the "
        f"next update's lr is {o.lr * fresh(2):.3e} (was {before:.3e})"
    ]
    # its next checkpoint records the new length
    assert sched.state_dict()["schedule"]["steps"] == 8


def test_same_length_old_state_and_other_fields():
    o = OptimConfig(lr=1e-2, schedule="cosine", warmup_steps=1)
    state = taken(o, 6, 3)
    opt, sched, lines = resumed(o, state, 6)
    ref_opt, ref = scheduler(o, 6)
    for _ in range(3):
        ref_opt.step()
        ref.step()
    # unchanged: as before
    assert lines == [] and lrs_from(opt, sched, 3) == lrs_from(ref_opt, ref, 3)
    # a state that does not record its length: assumed unchanged, with a note
    del state["schedule"]["steps"]
    _, _, lines = resumed(o, state, 6)
    assert lines == [
        "note: the checkpoint does not record its lr schedule's length; assumed train.steps=6, as now"
    ]
    # another warmup in the config: the checkpoint's schedule is kept, and said
    state = taken(o, 6, 3)
    opt, sched, lines = resumed(OptimConfig(lr=1e-2, schedule="cosine", warmup_steps=4), state, 6)
    assert lines == [
        "note: optim.warmup_steps=4 differs from the resumed schedule's 1: the checkpoint's is kept"
    ]
    assert opt.param_groups[0]["lr"] == 1e-2 * LRSchedule(o, 6)(3)


def test_trainer_extends_a_run_and_refuses_to_shorten_below_the_checkpoint(tmp_path, capsys):
    """A 4-step wsd run checkpointed at 2, resumed with train.steps=8: the logged lr of steps 3..8 is a
    fresh 8-step schedule's and one line says so; train.steps below the checkpoint's step is refused
    (exit 2 in train.py) with the checkpoints left in place."""
    run_dir = tmp_path / "run"
    sched = ["optim.schedule=wsd", "optim.warmup_steps=1", "optim.decay_fraction=0.5"]
    common = FAST + sched + [f"train.run_dir={run_dir}", "train.checkpoint_every=2"]
    assert Trainer(compose_job(common + ["train.steps=4"])).run() == 0
    ck = run_dir / "checkpoints"
    job = compose_job(common + ["train.steps=8", f"train.resume={ck / 'step_00000002'}"])
    trainer = Trainer(job)
    out = capsys.readouterr().out
    fresh = LRSchedule(job.optim, 8)
    assert (
        f"train.steps changed from 4 to 8: the wsd lr schedule is rescaled to 8 steps; the next update's lr is "
        f"{job.optim.lr * fresh(2):.3e} (was {job.optim.lr * LRSchedule(job.optim, 4)(2):.3e})"
    ) in out
    assert trainer.run() == 0
    lr = {
        r["step"]: r["lr"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }
    assert [lr[s] for s in range(3, 9)] == pytest.approx(
        [job.optim.lr * fresh(s - 1) for s in range(3, 9)], rel=1e-12
    )
    before = sorted(p.name for p in ck.iterdir())
    record = (run_dir / "config.yaml").read_text()
    with pytest.raises(ConfigError) as err:
        # resume=auto: the newest checkpoint is at step 8
        Trainer(compose_job(common + ["train.steps=5"]))
    assert str(err.value) == (
        f"train.steps=5 is below step 8 of the checkpoint to resume ({ck / 'step_00000008'}): "
        "set train.steps >= 8 to continue it, or train.resume=none (or another train.run_dir) "
        "to start over"
    )
    assert sorted(p.name for p in ck.iterdir()) == before
    assert (run_dir / "config.yaml").read_text() == record  # the refused relaunch wrote no config
