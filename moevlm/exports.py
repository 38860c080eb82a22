"""A package's exported names imported on first use (PEP 562), so that importing one light module
of a package (a data worker's `moevlm.model.rope`) does not import the whole package.

    __getattr__ = lazy_exports(__name__, {"Qwen3VLMoe": "moevlm.model.vlm", ...})
"""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, where: dict[str, str]):
    """The package's `__getattr__`: each name in `where` from its module, kept once read."""

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
