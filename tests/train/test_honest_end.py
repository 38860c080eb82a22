"""A ruined model never exits 0: skipped steps are logged and marked, the count of non-finite steps in a
row survives a relaunch, the loss check reads only this launch's updates, and weights that are not
finite are never checkpointed nor resumed."""

from __future__ import annotations

import json

import pytest
import torch
from test_trainer import FAST

from moevlm.config import compose_job
from moevlm.train.checkpoint import CheckpointError, CheckpointManager, rng_state
from moevlm.train.exit_codes import ExitCode
from moevlm.train.trainer import NonFiniteWeights, Trainer


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_huge_lr_stops_non_zero_and_a_relaunch_keeps_counting(tmp_path):
    common = [o for o in FAST if not o.startswith("train.log_every")] + [
        f"train.run_dir={tmp_path}",
        "optim.lr=1e9",  # step 1 updates; every later gradient is non-finite
        "train.max_nonfinite_steps=3",
        "train.log_every=4",
        "train.checkpoint_every=100",
    ]
    first = Trainer(compose_job(common + ["train.steps=8"]))
    assert first.run() == ExitCode.NONFINITE and first.step == 4
    assert len(first.updated_losses) == 1  # the loss check would read step 1 only
    recs = records(tmp_path)
    # steps 2..4 were skipped: each logged at once (not only every 4th), marked; the stop step too
    assert [(r["step"], r.get("updated", True)) for r in recs] == [
        (1, True),
        (2, False),
        (3, False),
        (4, False),
    ]
    assert [(r["steps_in_window"], r["skipped_steps_in_window"]) for r in recs[1:]] == [(1, 1)] * 3
    assert CheckpointManager(tmp_path / "checkpoints").latest().name == "step_00000004"
    # relaunched for 2 more steps: the in-a-row count goes on from 3, so step 5 stops it again (it
    # used to restart from 0 and end "ok" after two more skipped steps)
    again = Trainer(compose_job(common + ["train.steps=6"]))
    assert again.in_a_row == 3
    assert again.run() == ExitCode.NONFINITE and again.step == 5 and again.updated_losses == []
    assert records(tmp_path)[-1]["step"] == 5 and records(tmp_path)[-1]["updated"] is False


def test_non_finite_weights_are_never_checkpointed_nor_resumed(tmp_path, capsys):
    common = FAST + [f"train.run_dir={tmp_path}", "train.checkpoint_every=1"]
    assert Trainer(compose_job(common + ["train.steps=2"])).run() == 0
    ck = CheckpointManager(tmp_path / "checkpoints")
    trainer = Trainer(compose_job(common + ["train.steps=4"]))  # resumed at step 2
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float("nan"))
    trainer.step = 3
    with pytest.raises(NonFiniteWeights, match="no checkpoint of them is written"):
        trainer.save()
    assert ck.latest().name == "step_00000002"
    # a checkpoint of NaN weights, as an older version could write it: refused on resume
    counters = {"step": 3, "nonfinite_steps": 0, "in_a_row": 0, "losses": list(trainer.losses)}
    ck.save(
        3,
        model=trainer.model,
        optimizer=trainer.opt,
        extra={"scheduler": trainer.sched, "counters": counters},
        per_rank={"data": trainer.loader.state_dict(), "rng": rng_state()},
    )
    trainer.close()
    with pytest.raises(CheckpointError, match="step_00000003 holds non-finite weights"):
        Trainer(compose_job(common + ["train.steps=4"]))
    # the run stopping on them ends non-zero without writing them (the end-of-run check)
    trainer = Trainer(
        compose_job(common + ["train.steps=3", "train.resume=" + str(ck.step_dir(2))])
    )

    def ruin(module, args, out):  # an update gone wrong: the weights themselves become NaN
        next(trainer.model.parameters()).data.fill_(float("nan"))
        return out

    trainer.model.lm_head.register_forward_hook(ruin)
    assert trainer.run() == ExitCode.NONFINITE
    assert "the weights are non-finite" in capsys.readouterr().out
    assert ck.latest().name == "step_00000002"  # step 3 of this run was not written
