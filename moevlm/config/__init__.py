"""The job's configuration: the schema behind `conf/`, the checks, and the one `JobPlan` they decide.

In short:

    job = compose_job(["+experiment=h100_fsdp", "data.shards=DIR"])
    plan = validate(job, world_size=8)          # ConfigError: one line a problem
"""

from moevlm.config.dispatcher import choose_dispatcher
from moevlm.config.job_plan import JobPlan
from moevlm.config.memory import check_memory, estimate_memory, memory_limit
from moevlm.config.model_section import ModelConfig, model_config
from moevlm.config.schema import JobConfig, check_overrides, compose_job
from moevlm.config.sections import OptimConfig, ParallelConfig, TrainConfig
from moevlm.config.validation import validate

__all__ = [
    "JobConfig",
    "JobPlan",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "check_memory",
    "check_overrides",
    "choose_dispatcher",
    "compose_job",
    "estimate_memory",
    "memory_limit",
    "model_config",
    "validate",
]
