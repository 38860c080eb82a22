"""What a checkpoint records of the launch that wrote it (in its marker), and what a resume changes.

    record = launch_record(job, model_cfg, tokenizer_path)   # {"config", "architecture", "tokenizer"}
    CheckpointManager(..., record=record)                     # written into every marker
    changes = resume_changes(read_marker(path), record)       # [Change(key, old, new, refused)]

Each change is one line `resume: <key>: <old> -> <new>`.  Refused unless train.resume_allow_changes
names its class: `tokenizer` (another vocabulary: the same ids would mean other text) and
`architecture` (the model's config.json form: family, shapes, routing; the weights would mean other
things, and a changed shape fails at load anyway).  Everything else (global_batch_size, seq_len,
max_pixels, precision, lr, ...) is noted only: the weights mean the same under it (why:
docs/checkpoints.md, "Resuming with changes").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from moevlm.config.sections import RESUME_CHANGES

# the classes train.resume_allow_changes may name: what a resume refuses unless told
REFUSED = RESUME_CHANGES
# keys that differ between launches of one run by design: never compared
IGNORED = {"train.resume", "train.resume_allow_changes"}


def tokenizer_fingerprint(path: str) -> dict[str, str]:
    """A tokenizer.json's identity: sha256 over its vocabulary, merges and added tokens (what decides
    the ids; indentation and other fields do not count), and its path."""
    if not path:
        return {}
    data = json.loads(Path(path).read_text())
    ids = {
        "vocab": data.get("model", {}).get("vocab"),
        "merges": data.get("model", {}).get("merges"),
        "added_tokens": data.get("added_tokens"),
    }
    digest = hashlib.sha256(json.dumps(ids, sort_keys=True).encode()).hexdigest()
    return {"path": str(path), "sha256": digest}


def launch_record(job, model_cfg, tokenizer_path: str) -> dict[str, Any]:
    """What this launch's checkpoints record: its config (resolved), the model's architecture and the
    tokenizer's fingerprint."""
    arch = model_cfg.to_hf("float32")
    arch.get("text_config", {}).pop("router_aux_loss_coef", None)  # a training option
    return {
        "config": OmegaConf.to_container(job, resolve=True),
        "architecture": arch,
        "tokenizer": tokenizer_fingerprint(tokenizer_path),
    }


@dataclass
class Change:
    key: str  # a config key (train.global_batch_size), architecture.<field>, or tokenizer
    old: Any
    new: Any
    kind: str | None  # the class it belongs to in REFUSED, None: noted only

    def line(self) -> str:
        return f"resume: {self.key}: {_shown(self.old)} -> {_shown(self.new)}"


def resume_changes(marker: dict, record: dict) -> list[Change]:
    """Every difference between the launch that wrote checkpoint `marker` and this one (`record`);
    [] when the checkpoint records none (an older version wrote it)."""
    out = [
        Change(key, old, new, None)
        for key, old, new in _differences(marker.get("config"), record["config"])
        if key not in IGNORED
    ]
    out += [
        Change(f"architecture.{key}", old, new, "architecture")
        for key, old, new in _differences(marker.get("architecture"), record["architecture"])
    ]
    old_tok, new_tok = marker.get("tokenizer") or {}, record["tokenizer"]
    if old_tok and new_tok and old_tok["sha256"] != new_tok["sha256"]:
        out.append(Change("tokenizer", _tok(old_tok), _tok(new_tok), "tokenizer"))
    return out


def refusal(path: Path, changes: list[Change], allowed: list[str]) -> str | None:
    """The one line refusing `changes` of a class train.resume_allow_changes does not name."""
    refused = [c for c in changes if c.kind is not None and c.kind not in allowed]
    if not refused:
        return None
    kinds = sorted({c.kind for c in refused})
    return (
        f"checkpoint {path} was written with another {' and '.join(kinds)} ("
        + "; ".join(f"{c.key}: {_shown(c.old)} -> {_shown(c.new)}" for c in refused[:4])
        + (f"; {len(refused) - 4} more above" if len(refused) > 4 else "")
        + "): resuming would change what the model sees or computes; resume with the checkpoint's, "
        "start over (train.resume=none, or another train.run_dir), or accept it with "
        f"train.resume_allow_changes=[{','.join(kinds)}]"
    )


def _differences(saved: dict | None, now: dict) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, value now) where they differ; [] when nothing was saved."""
    old, new = _flat(saved), _flat(now)
    if not old:
        return []
    return [(k, old.get(k), new.get(k)) for k in sorted(old | new) if old.get(k) != new.get(k)]


def _tok(fp: dict) -> str:
    return f"sha256 {fp['sha256'][:12]} ({fp['path']})"


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree} if prefix else {}
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def _shown(v: Any) -> str:
    """A value as the command line writes it (null, true, "" for an empty string, lists as JSON)."""
    if v is None or v == "" or isinstance(v, (bool, list, dict)):
        return json.dumps(v)
    return str(v)
