"""Opaque backend handles behind custom ops: a `torch.library.custom_op` takes and returns tensors, not
DeepEP's or HybridEP's handle objects, so an adapter keeps each handle here under an int id carried by a
one-element int64 CPU tensor.

    id_tensor = store(buffer, handle, ...)   # the entry lives as long as id_tensor's storage
    buffer, handle, ... = lookup(id_tensor)

The entry goes when the id tensor's storage does (`weakref.finalize`; a detached alias, as selective
recompute saves, shares the storage and keeps it): after backward, or at once when nothing needs grad.
"""

from __future__ import annotations

import itertools
import weakref

import torch

HANDLES: dict[int, tuple] = {}  # handle id -> what the adapter stored
_ids = itertools.count()


def store(*entry) -> torch.Tensor:
    """Keep `entry` under a fresh id, for as long as the returned id tensor (or an alias of it) lives."""
    hid = next(_ids)
    HANDLES[hid] = entry
    id_tensor = torch.tensor([hid], dtype=torch.int64)
    weakref.finalize(id_tensor.untyped_storage(), HANDLES.pop, hid, None)
    return id_tensor


def lookup(handle_id: torch.Tensor) -> tuple:
    return HANDLES[int(handle_id[0])]
