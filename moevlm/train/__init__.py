"""Training: config schema + validation (config.py), the loop (trainer.py),
AdamW and schedules (optim.py), DCP checkpoints (checkpoint.py), metrics and
logging (metrics.py).  `train.py` at the repository root composes the Hydra
config and runs `Trainer(job).run()`."""
