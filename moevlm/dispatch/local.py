"""The local dispatcher (expert parallel size 1) in the registry: the model's own single-process
dispatcher (`moevlm.model.dispatcher.LocalDispatcher`)."""

from __future__ import annotations

from moevlm.dispatch.base import register_dispatcher
from moevlm.model.dispatcher import LocalDispatcher

register_dispatcher(LocalDispatcher)

__all__ = ["LocalDispatcher"]
