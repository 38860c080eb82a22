"""The Qwen3-VL-MoE and Qwen3.5-MoE networks, free of parallelism (docs/architecture.md)."""

from moevlm.errors import ConfigError
from moevlm.model.config import MoEConfig, TextConfig, VisionConfig, VLMConfig
from moevlm.model.flops import FlopCount, count_flops
from moevlm.model.vlm import Qwen3VLMoe, VLMOutput, from_pretrained

__all__ = [
    "ConfigError",
    "FlopCount",
    "MoEConfig",
    "Qwen3VLMoe",
    "TextConfig",
    "VLMConfig",
    "VLMOutput",
    "VisionConfig",
    "count_flops",
    "from_pretrained",
]
