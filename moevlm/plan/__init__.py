"""Plans of a job at its real size without its hardware: fake tensors (`moevlm.plan.fake`) and one
training step per rank role (`moevlm.plan.dry_run`)."""
