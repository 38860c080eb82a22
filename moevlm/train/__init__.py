"""Training loop, optimizer/schedule, DCP checkpoints, metrics (trainer issue)."""
