"""The Qwen3-VL-MoE and Qwen3.5-MoE networks, free of parallelism (docs/architecture.md)."""

from moevlm.exports import lazy_exports

__getattr__ = lazy_exports(
    __name__,
    {
        "ConfigError": "moevlm.errors",
        **dict.fromkeys(
            ("MoEConfig", "TextConfig", "VisionConfig", "VLMConfig"), "moevlm.model.config"
        ),
        **dict.fromkeys(("FlopCount", "count_flops"), "moevlm.model.flops"),
        **dict.fromkeys(("Qwen3VLMoe", "VLMOutput", "from_pretrained"), "moevlm.model.vlm"),
    },
)

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
