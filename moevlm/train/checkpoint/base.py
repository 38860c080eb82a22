"""The frozen base a LoRA checkpoint's adapters belong to (model.lora_rank > 0): named in the marker
when it is saved, compared when it is loaded.

    base = base_identity(hf_checkpoint, seed, model_cfg)   # {"source": ..., "sha256": ...}
    check_base(read_marker(path), base, path)              # CheckpointError naming both

From a Hugging Face folder: its path and a sha256 over its config.json and, per safetensors file
(sorted by name), the name, the size and 8 blocks of 64 KiB at evenly spaced offsets, so a few MiB
are read whatever the model's size (why: docs/architecture.md, "Checkpoints").  Drawn from the seed
(no folder): the seed and the architecture (the config.json form), from which the base is drawn.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moevlm.train.integrity import CheckpointError

BLOCKS, BLOCK = 8, 1 << 16


def base_identity(hf_checkpoint: str, seed: int, model_cfg) -> dict[str, Any]:
    """What the frozen weights of this run are: read from `hf_checkpoint`, or drawn from `seed`."""
    h = hashlib.sha256()
    if hf_checkpoint:
        folder = Path(hf_checkpoint)
        config = folder / "config.json"
        h.update(config.read_bytes() if config.is_file() else b"")
        for f in sorted(folder.glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
            h.update(_sampled_bytes(f))
        return {"source": f"hf_checkpoint={hf_checkpoint}", "sha256": h.hexdigest()}
    hf = model_cfg.to_hf("float32")
    hf.get("text_config", {}).pop("router_aux_loss_coef", None)  # a training option
    h.update(json.dumps({"seed": seed, "config": hf}, sort_keys=True).encode())
    return {"source": f"seed={seed} (no hf_checkpoint)", "sha256": h.hexdigest()}


def _sampled_bytes(path: Path) -> bytes:
    """BLOCKS blocks of BLOCK bytes at evenly spaced offsets (the first at 0, the last at the end)."""
    size = path.stat().st_size
    out = []
    with open(path, "rb") as f:
        for i in range(BLOCKS):
            f.seek(max(0, (size - BLOCK) * i // (BLOCKS - 1)))
            out.append(f.read(BLOCK))
    return b"".join(out)


def check_base(marker: Mapping[str, Any], mine: dict | None, path: Path) -> None:
    """A CheckpointError unless checkpoint `path` (its marker) holds what this run trains: adapters
    of this run's base, or (no LoRA: `mine` None) the whole model."""
    saved = marker.get("base")
    if mine is None and saved is not None:
        raise CheckpointError(
            f"checkpoint {path} holds LoRA adapters only (its base: {saved['source']}); resume it "
            "with its run's model.lora_* options, or start over (train.resume=none)"
        )
    if mine is None or saved == mine:
        return
    if saved is None:
        raise CheckpointError(
            f"checkpoint {path} holds a whole model, not LoRA adapters: resume it with "
            "model.lora_rank=0, or start the LoRA run fresh (train.resume=none, model.hf_checkpoint)"
        )
    raise CheckpointError(
        f"checkpoint {path} holds LoRA adapters of another base: saved with {saved['source']} "
        f"(sha256 {saved['sha256'][:16]}), this run's base is {mine['source']} (sha256 "
        f"{mine['sha256'][:16]}); resume with the checkpoint's base, or start over (train.resume=none)"
    )
