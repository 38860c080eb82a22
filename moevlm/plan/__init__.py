"""The planner: a job at its real size without its hardware.  Fake tensors (`moevlm.plan.fake`),
one training step per rank role (`moevlm.plan.dry_run`), the per-rank report
(`moevlm.plan.report`), the layout search (`moevlm.plan.search`) and its command line
(`python -m moevlm.plan`, `moevlm.plan.cli`)."""
