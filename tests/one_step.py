"""One training step of the embedded default through the real Trainer per setting, for tests that
compare what a setting logs against a run without it."""

import json


def first_records(tmp_path, settings: dict, look=None) -> dict:
    """{name: the first metrics.jsonl record} of a one-step run per `settings` entry (name -> extra
    overrides), each in its own run dir under `tmp_path`; `look(name, trainer)` sees each trainer
    before it runs."""
    from moevlm.config import compose_job
    from moevlm.train.trainer import Trainer

    recs = {}
    for name, extra in settings.items():
        run_dir = tmp_path / name.split(":")[0]
        job = compose_job(
            [
                "data.num_workers=0",
                "data.streams=1",
                "train.log_every=1",
                "train.tensorboard=false",
                "train.steps=1",
                "train.global_batch_size=1",
                f"train.run_dir={run_dir}",
                "train.checkpoint_at_end=false",
                "train.require_loss_decrease=false",
                "train.progress=false",
                *extra,
            ]
        )
        trainer = Trainer(job)
        if look is not None:
            look(name, trainer)
        assert trainer.run() == 0
        recs[name] = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    return recs
