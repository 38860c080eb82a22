"""What a transformers user needs beside the weights: tokenizer files, chat template, image processor.

    write_processor_files(out_dir, tokenizer="shards/tokenizer.json", image=cfg.data.image,
                          source="hf_in")          # the checkpoint the run started from, if any

Written after `moevlm.parallel.save_hf` (config.json and the safetensors), so that
`AutoTokenizer.from_pretrained` and the image processor load the folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from moevlm.data.config import ImageConfig
from moevlm.data.text import IMAGE_PLACEHOLDER

COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)

_VISION = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | replace('" + IMAGE_PLACEHOLDER + "', '" + _VISION + "') }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}" + _VISION + "{%- else -%}{{ item['text'] }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "<|im_end|>{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}{%- endif -%}"
)


def write_processor_files(
    out_dir: str | Path,
    *,
    tokenizer: str | Path,
    image: ImageConfig,
    source: str | Path | None = None,
) -> list[str]:
    """Tokenizer, chat template and image-processor files in `out_dir`; returns the names written."""
    out_dir, tokenizer = Path(out_dir), Path(tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer, out_dir / "tokenizer.json")  # the one the run trained with
    written = ["tokenizer.json"]
    for folder in [Path(source)] if source else []:  # then the checkpoint's own files
        for name in COPIED:
            if (folder / name).is_file() and not (out_dir / name).exists():
                shutil.copyfile(folder / name, out_dir / name)
                written.append(name)
    for name, content in (
        ("tokenizer_config.json", tokenizer_config()),
        ("preprocessor_config.json", preprocessor_config(image)),
    ):
        if not (out_dir / name).exists():
            (out_dir / name).write_text(json.dumps(content, indent=2) + "\n")
            written.append(name)
    return written


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": 262144,
        "chat_template": CHAT_TEMPLATE,
    }


def preprocessor_config(image: ImageConfig) -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": image.patch_size,
        "temporal_patch_size": image.temporal_patch_size,
        "merge_size": image.merge_size,
        "min_pixels": image.min_pixels,
        "max_pixels": image.max_pixels,
        "size": {"shortest_edge": image.min_pixels, "longest_edge": image.max_pixels},
        "image_mean": list(image.mean),
        "image_std": list(image.std),
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_resize": True,
        "do_convert_rgb": True,
    }
