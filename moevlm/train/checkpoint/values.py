"""An `extra` or `per_rank` checkpoint value as DCP tensors, and back, never through pickle.

    parts = stored_value(scheduler, "extra.scheduler")   # {"": JSON as uint8, "0": tensor, ...}
    put(group, "scheduler", parts)                       # keys "scheduler", "scheduler.0", ...

A value is None, bool, int, float, str, list, tuple, dict, tensors and ndarrays (an object's
state_dict() if it has one).  `<key>` is a uint8 tensor holding it as UTF-8 JSON, `<key>.<i>` the
i-th tensor or ndarray inside it.  JSON stands for what it cannot say itself with one-key objects:
{"__tuple__": [...]}, {"__dict__": [[key, value], ...]} (keys that are not strings),
{"__tensor__": i}, {"__ndarray__": i, "dtype": "<u4", "shape": [...]}.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moevlm.train.integrity import CheckpointError, one_line

_TAGS = ("__tuple__", "__dict__", "__tensor__", "__ndarray__")


def _encode(value: Any, tensors: list[torch.Tensor], where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, np.generic) and not isinstance(value, np.object_):
        return _encode(value.item(), tensors, where)
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().to("cpu", copy=True).contiguous())
        return {"__tensor__": len(tensors) - 1}
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        raw = np.frombuffer(np.ascontiguousarray(value).tobytes(), dtype=np.uint8).copy()
        tensors.append(torch.from_numpy(raw))
        return {
            "__ndarray__": len(tensors) - 1,
            "dtype": value.dtype.str,
            "shape": list(value.shape),
        }
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors, where) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors, where) for v in value]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and not (
            len(value) == 1 and next(iter(value)) in _TAGS
        ):
            return {k: _encode(v, tensors, where) for k, v in value.items()}
        return {
            "__dict__": [
                [_encode(k, tensors, where), _encode(v, tensors, where)] for k, v in value.items()
            ]
        }
    raise TypeError(
        f"checkpoint value {where} holds a {type(value).__name__}: checkpoints store None, bool, "
        "int, float, str, list, tuple, dict, tensors and ndarrays (give the object a state_dict())"
    )


def _decode(obj: Any, tensors: Mapping[int, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1 and "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if len(obj) == 1 and "__dict__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__dict__"]}
    if len(obj) == 1 and "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if obj.keys() == {"__ndarray__", "dtype", "shape"}:
        dtype = np.dtype(str(obj["dtype"]))
        if dtype.hasobject:
            raise ValueError(f"ndarray of dtype {dtype} (Python objects)")
        raw = tensors[obj["__ndarray__"]].numpy().tobytes()
        return np.frombuffer(raw, dtype=dtype).reshape([int(n) for n in obj["shape"]]).copy()
    return {k: _decode(v, tensors) for k, v in obj.items()}


def stored_value(value: Any, where: str) -> dict[str, torch.Tensor]:
    """{"": JSON tensor, "0": first tensor, ...}: what `value` (its state_dict() if it has one)
    becomes under the key `where` and `where.<i>`."""
    if hasattr(value, "state_dict"):
        value = value.state_dict()
    tensors: list[torch.Tensor] = []
    text = json.dumps(_encode(value, tensors, where), separators=(",", ":"))
    blob = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    return {"": blob, **{str(i): t for i, t in enumerate(tensors)}}


def value_template(saved: Mapping[str, Any], key: str, path: Path) -> dict[str, torch.Tensor]:
    """Empty tensors for what `stored_value` wrote under `key`, from the checkpoint's index; a value
    stored any other way (a pickle: older moevlm, or not moevlm) is refused, never unpickled."""
    md = saved[key]
    if not (
        isinstance(md, TensorStorageMetadata)
        and md.properties.dtype == torch.uint8
        and len(md.size) == 1
    ):
        raise CheckpointError(
            f"checkpoint {path}: {key} is not stored as JSON but as a pickled Python object (a "
            "checkpoint written by an older moevlm, or not by moevlm); this version never unpickles "
            "checkpoint content: resume it with the moevlm version that wrote it, or start fresh "
            "(train.resume=none, or another train.run_dir)"
        )
    out = {"": torch.empty(tuple(md.size), dtype=torch.uint8)}
    for k, m in saved.items():
        i = k[len(key) + 1 :]
        if k.startswith(key + ".") and i.isdigit():
            if not isinstance(m, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint {path}: {k} is not a tensor; refused")
            out[i] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    return out


def put(group: dict, name: str, parts: Mapping[str, torch.Tensor]) -> None:
    for i, t in parts.items():
        group[f"{name}.{i}" if i else name] = t


def loaded_value(group: Mapping[str, Any], name: str, key: str, path: Path) -> Any:
    """The value `stored_value` wrote, from the tensors DCP filled in `group` (keys as `put`)."""
    tensors = {
        int(k[len(name) + 1 :]): t
        for k, t in group.items()
        if k.startswith(name + ".") and k[len(name) + 1 :].isdigit()
    }
    try:
        return _decode(json.loads(bytes(group[name].numpy()).decode()), tensors)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path}: {key} is not a value this version reads ({one_line(e)}); refused"
        ) from None


def restore(target: Any, value: Any) -> Any:
    """Load into `target` if it has load_state_dict (and return it), else return the value."""
    if hasattr(target, "load_state_dict"):
        target.load_state_dict(value)
        return target
    return value
