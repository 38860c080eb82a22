"""Training: a run set up in stages (setup.py), the loop (trainer.py), AdamW and schedules
(optim.py), DCP checkpoints (checkpoint/), metrics and logging (metrics.py, report.py), faults and
exit codes.  `train.py` at the repository root composes the Hydra config (moevlm.config) and runs
`Trainer(job).run()`."""
