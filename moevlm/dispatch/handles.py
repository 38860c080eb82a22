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


def register_combine_autograd(combine_op, backward_op) -> None:
    """Autograd of a `combine_op(y, handle_id, num_tokens)` exchange: the gradient of y is
    `backward_op(grad, handle_id, rows of y)`, a cached dispatch on the same handle."""

    def setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])
        ctx.num_rows = inputs[0].shape[0]

    def grad(ctx, grad_out):
        (handle_id,) = ctx.saved_tensors
        return backward_op(grad_out, handle_id, ctx.num_rows), None, None

    combine_op.register_autograd(grad, setup_context=setup)
