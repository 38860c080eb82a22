"""Does a checkpoint fit what is loaded into it?  Key and shape checks on DCP's metadata, before any
tensor is read, so a mismatch names its keys instead of failing deep inside DCP.

Keys are compared by dotted prefix (DCP may flatten the two sides to different depths); a pipeline
rank's saved key is unexpected only when no rank's model has it; extra saved optimizer entries are
ignored, as DCP does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from moevlm.train.integrity import CheckpointError

SHOW = 5  # keys named in an error message


def _prefixes(keys: Iterable[str]) -> set[str]:
    """Every dotted prefix of every key ("a.b.c" -> "a", "a.b", "a.b.c")."""
    out = set()
    for key in keys:
        parts = key.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


def _flat_keys(prefix: str, value: Any) -> Iterator[str]:
    """Dotted keys of the leaves of nested dicts/lists, roughly as DCP flattens them."""
    if isinstance(value, Mapping):
        items: Iterable[tuple[Any, Any]] = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        yield prefix
        return
    for key, item in items:
        yield from _flat_keys(f"{prefix}.{key}", item)


def _uncovered(keys: set[str], other: set[str]) -> list[str]:
    """Keys of `keys` with no key of `other` equal, above or below them (flattening depth may differ)."""
    below = _prefixes(other)
    return sorted(k for k in keys if k not in below and not _prefixes([k]) & other)


def check_model_keys(
    model_sd: Mapping[str, Any],
    saved: Mapping[str, Any],
    path: Path,
    every_rank: Iterable[str] | None = None,
) -> None:
    """Name missing/unexpected keys and wrong shapes.  `every_rank`: the model keys of all ranks
    (a pipeline rank holds part of the model; a saved key is unexpected only if no rank has it)."""
    expected = {f"model.{k}" for k in model_sd}
    everyone = expected if every_rank is None else {f"model.{k}" for k in every_rank}
    saved_model = {k for k in saved if k.startswith("model.")}
    missing = [k[6:] for k in _uncovered(expected, saved_model)]
    unexpected = [k[6:] for k in _uncovered(saved_model, everyone)]
    shapes = _shape_mismatches(model_sd, saved)
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"model does not match checkpoint {path}: {len(missing)} missing {missing[:SHOW]}, "
            f"{len(unexpected)} unexpected {unexpected[:SHOW]}, {len(shapes)} with another shape "
            f"{shapes[:SHOW]} (at most {SHOW} of each shown)"
        )


def check_optimizer_keys(optim_sd: Mapping[str, Any], saved: Mapping[str, Any], path: Path) -> None:
    """Every optimizer entry to load must be saved (extra saved entries are ignored, as DCP does)."""
    saved_optim = {k for k in saved if k.startswith("optim.")}
    if not saved_optim:
        raise CheckpointError(f"checkpoint {path} has no optimizer state; load with optimizer=None")
    missing = [k[6:] for k in _uncovered(set(_flat_keys("optim", optim_sd)), saved_optim)]
    if missing:
        hint = ""
        if any(k.endswith("initial_lr") for k in missing):
            hint = (
                "; initial_lr is added by an LR scheduler: create it before loading exactly when "
                "the saving run had one"
            )
        raise CheckpointError(
            f"optimizer does not match checkpoint {path}: {len(missing)} missing {missing[:SHOW]}{hint}"
        )


def _shape_mismatches(model_sd: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    """Tensors whose global shape (DTensor.shape is global) differs from the saved one."""
    out = []
    for key, value in model_sd.items():
        meta = saved.get(f"model.{key}")
        if (
            isinstance(value, torch.Tensor)
            and hasattr(meta, "size")
            and tuple(meta.size) != tuple(value.shape)
        ):
            out.append(f"{key}: saved {tuple(meta.size)}, model {tuple(value.shape)}")
    return out


def require(names: Iterable[str], saved: Mapping[str, Any], prefix: str, path: Path) -> None:
    absent = [n for n in names if f"{prefix}.{n}" not in saved]
    if absent:
        have = sorted(
            {k[len(prefix) + 1 :].split(".")[0] for k in saved if k.startswith(prefix + ".")}
        )
        raise CheckpointError(f"checkpoint {path} has no {prefix} value(s) {absent}; it has {have}")
