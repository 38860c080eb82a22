"""The job's configuration, in three modules by responsibility, gathered here for importers:

- moevlm.train.schema: the typed dataclasses behind `conf/` (Hydra's ConfigStore), `compose_job`,
  and `model_config`, the model config a job's `model` section composes (each model field names
  the VLMConfig field it sets: one tree, no copy table);
- moevlm.train.validate: `validate()`, every check that needs no allocation, and the `Plan` it
  derives (the dispatcher that `model.dispatcher=auto` resolves to included);
- moevlm.train.memory: `check_memory()` / `estimate_memory()`, the model state per rank against
  the device's memory.

The data's own checks sit beside its config (moevlm.data.config), the model's in
VLMConfig.validate.
"""

from moevlm.train.memory import (
    BYTES_FROZEN,
    BYTES_TRAINED,
    MEMORY_NOTE,
    MemoryEstimate,
    check_memory,
    estimate_memory,
    memory_limit,
)
from moevlm.train.schema import (
    CHOICES,
    JobConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    check_overrides,
    compose_job,
    in_job_keys,
    model_config,
    model_fields,
    register_configs,
)
from moevlm.train.validate import _check_profile  # noqa: F401  (tests check it alone)
from moevlm.train.validate import (
    CP_ATTN_BACKENDS,
    DISPATCHER_NAMES,
    GATED_DISPATCHERS,
    Plan,
    environment_checks,
    resolve_dispatcher,
    validate,
)

__all__ = [
    "BYTES_FROZEN",
    "BYTES_TRAINED",
    "CHOICES",
    "CP_ATTN_BACKENDS",
    "DISPATCHER_NAMES",
    "GATED_DISPATCHERS",
    "JobConfig",
    "MEMORY_NOTE",
    "MemoryEstimate",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "Plan",
    "TrainConfig",
    "check_memory",
    "check_overrides",
    "compose_job",
    "environment_checks",
    "estimate_memory",
    "in_job_keys",
    "memory_limit",
    "model_config",
    "model_fields",
    "register_configs",
    "resolve_dispatcher",
    "validate",
]
