"""How a config field declares what it accepts: `one_of(...)` types, and tests of numbers.

    dp_mode: one_of("fsdp", "ddp") = field(default="fsdp", metadata={"help": ...})
    recompute: one_of(*MODES, checked_by=recompute.check) = ...   # its owner words the refusal
    allowed(ParallelConfig)["dp_mode"]      # ("fsdp", "ddp")

Hydra sees `str`; `allowed` and the reference see the values; `moevlm.config.validation` refuses any
other value of a field that names no `checked_by`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Annotated, Callable, Literal, Union, get_args, get_origin, get_type_hints


@dataclass(frozen=True)
class CheckedBy:
    """The function that refuses a value outside the field's choices, in its own words."""

    function: Callable | str


def one_of(*values: str, checked_by: Callable | str | None = None):
    """A string field that takes one of `values` (each item, for a list of it); `checked_by`: the
    function (or its dotted name, where importing it would be circular) that refuses other values."""
    if checked_by is None:
        return Annotated[str, Literal[values]]
    return Annotated[str, Literal[values], CheckedBy(checked_by)]


def choices(tp) -> tuple[str, ...]:
    """The values a `one_of` type (also inside Optional[...] or list[...]) allows; () for any value."""
    if get_origin(tp) is Annotated:
        for extra in tp.__metadata__:
            if get_origin(extra) is Literal:
                return tuple(get_args(extra))
    if get_origin(tp) in (Union, list, tuple):
        for arg in get_args(tp):
            if found := choices(arg):
                return found
    return ()


def checked_elsewhere(tp) -> bool:
    """Whether a `one_of` type (also inside Optional[...] or list[...]) names its own checker."""
    if get_origin(tp) is Annotated:
        return any(isinstance(extra, CheckedBy) for extra in tp.__metadata__)
    return any(checked_elsewhere(arg) for arg in get_args(tp))


def allowed(cls: type) -> dict[str, tuple[str, ...]]:
    """Field name -> the values it allows, for every `one_of` field of the dataclass `cls`."""
    hints = get_type_hints(cls, include_extras=True)
    return {f.name: values for f in dataclasses.fields(cls) if (values := choices(hints[f.name]))}


def is_real(value) -> bool:
    """A finite int or float (not bool, not NaN, not +-inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
