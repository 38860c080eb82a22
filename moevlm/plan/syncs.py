"""Device-to-host reads in a training step: every op whose result the host must wait for.

    with PlanMode() as mode, SyncCounter("cuda") as syncs:    # entered above the fake mode
        model(**inputs)                                         # a forward (fake CUDA: no backward)
    syncs.records, syncs.by_line()                          # Sync(op, where, function), counts per line
    SyncCounter("cuda", strict=True)                        # SyncError at the first, naming its line

An op is a sync when torch tags its output data-dependent (`.item()`, `bool(t)`, `.tolist()`,
`equal`) or its output shape dynamic (`nonzero`, `masked_select`, `unique`, `bincount`, a boolean
index, `repeat_interleave` without `output_size`, `one_hot` without `num_classes`), or it copies a
device tensor to the host blocking, and one of its tensors is on the step's device (docs/plans.md).
"""

from __future__ import annotations

import collections
import os
import sys
import sysconfig
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from moevlm.plan.fake import _arguments, _leaves, fake_device

aten = torch.ops.aten
_DEVICE = torch.ops.prim.device.default
_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_COPIES = (aten._to_copy.default, aten.copy_.default)
_ITEM = aten._local_scalar_dense.default
_TOLIST = FakeTensor.tolist.__code__
# where the harness and torch live: a record names the first frame outside them
_SKIP = (
    os.path.dirname(torch.__file__) + os.sep,
    sysconfig.get_paths()["stdlib"] + os.sep,
    os.path.join(os.path.dirname(__file__), "syncs.py"),
    os.path.join(os.path.dirname(__file__), "fake.py"),
    os.path.join(os.path.dirname(__file__), "environments.py"),
    "<",  # <frozen runpy>, <string>
)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


class SyncError(RuntimeError):
    """A device-to-host read under `SyncCounter(strict=True)`."""


class Sync(NamedTuple):
    op: str  # aten.nonzero.default
    where: str  # moevlm/model/vlm.py:123, relative to the repository where it is inside it
    function: str


def needs_host(func, args, kwargs) -> bool:
    """Whether the op's result (or its output's size) is read from its inputs' values on the host."""
    if func in _COPIES:
        return not _arguments(func, args, kwargs).get("non_blocking", False)
    if not any(tag in func.tags for tag in _TAGS):
        return False
    named = _arguments(func, args, kwargs)
    if func is aten.index.Tensor:  # a boolean mask: its count of True is the output's size
        masks = (i for i in named.get("indices") or () if isinstance(i, torch.Tensor))
        return any(i.dtype in (torch.bool, torch.uint8) for i in masks)
    if func is aten.repeat_interleave.Tensor:
        return named.get("output_size") is None
    if func is aten.one_hot.default:
        return named.get("num_classes", -1) == -1
    return True


def _device(t: torch.Tensor) -> torch.device:
    return fake_device(t) if isinstance(t, FakeTensor) else t.device


def caller(skip: tuple[str, ...] = _SKIP) -> tuple[str, str]:
    """(file:line, function) of the innermost frame outside torch, the standard library and this
    harness: the model's line that asked for the value."""
    frame = start = sys._getframe(1)
    # a dispatch mode's handler (recompute's) forwards the op: the line that asked is further out
    while frame is not None and (
        frame.f_code.co_filename.startswith(skip) or frame.f_code.co_name == "__torch_dispatch__"
    ):
        frame = frame.f_back
    frame = frame or start
    name = frame.f_code.co_filename
    shown = name[len(_ROOT) :] if name.startswith(_ROOT) else name
    return f"{shown}:{frame.f_lineno}", frame.f_code.co_name


def _listing_frame():
    """The outermost `FakeTensor.tolist` call on the stack, if any."""
    frame, found = sys._getframe(2), None
    while frame is not None:
        if frame.f_code is _TOLIST:
            found = frame
        frame = frame.f_back
    return found


class SyncCounter(TorchDispatchMode):
    """Records each device-to-host read of the ops below it (enter it above `PlanMode`).  On fake
    CUDA a tensor's device type says where it is; on a CPU step (`device_type="cpu"`) the host's
    tensors are those `_HostCopies` finds and what is computed from them alone (docs/plans.md)."""

    def __init__(self, device_type: str = "cuda", strict: bool = False):
        super().__init__()
        self.device_type, self.strict = device_type, strict
        self.records: list[Sync] = []
        self._list_frame = None  # the tolist() whose element reads are one read, recorded
        self._host = WeakIdKeyDictionary()  # a CPU step's fake tensors made from host ones only
        self._copies = None  # a CPU step's _HostCopies

    def on_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if self.device_type == "cpu":
            return isinstance(t, FakeTensor) and t not in self._host
        # a fake `cuda` tensor made without an index lands on meta on a CPU-only build
        return _device(t).type in (self.device_type, "meta")

    def on_host(self, t) -> bool:
        """A host tensor (a copy's destination)."""
        return not self.on_device(t) if self.device_type == "cpu" else _device(t).type == "cpu"

    def record(self, op: str) -> None:
        where, function = caller()
        self.records.append(Sync(op, where, function))
        if self.strict:
            raise SyncError(
                f"device-to-host read: {op} at {where} (in {function}); "
                "a training step must not wait on the device (docs/plans.md)"
            )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE and isinstance(args[0], FakeTensor):
            return fake_device(args[0])
        if needs_host(func, args, kwargs) and self._reads_device(func, args, kwargs):
            listing = _listing_frame() if func is _ITEM else None
            if listing is None:
                self.record(str(func))
            elif listing is not self._list_frame:  # a fake tensor's tolist reads each element
                self._list_frame = listing
                self.record("Tensor.tolist")
        out = func(*args, **kwargs)
        if self.device_type == "cpu":
            self._follow_host(args, kwargs, out)
        return out

    def _follow_host(self, args, kwargs, out) -> None:
        """On a CPU step, what is made from host tensors only (the loader's real ones; the fake mode
        makes an op's output on them fake) is on the host too."""
        tensors = [a for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if tensors and not any(self.on_device(t) for t in tensors):
            for o in _leaves(out):
                if isinstance(o, FakeTensor):
                    self._host[o] = True

    def _reads_device(self, func, args, kwargs) -> bool:
        named = _arguments(func, args, kwargs)
        if func is aten.copy_.default:
            return self.on_device(named["src"]) and self.on_host(named["self"])
        if func is aten._to_copy.default:  # a CPU step's copies stay on its device
            to = named.get("device")
            host = to is not None and torch.device(to).type == "cpu" != self.device_type
            return host and self.on_device(named["self"])
        tensors = [a for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        return any(self.on_device(t) for t in tensors)

    def __enter__(self):
        if self.device_type == "cpu":
            self._copies = _HostCopies(self).__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out, self._list_frame = super().__exit__(*exc), None
        if self._copies is not None:
            self._copies, copies = None, self._copies
            copies.__exit__(*exc)
        return out

    def by_line(self) -> list[tuple[str, str, int]]:
        """(file:line, ops, count) per line, the most first, then by line."""
        counts = collections.Counter(r.where for r in self.records)
        ops: dict[str, set] = collections.defaultdict(set)
        for r in self.records:
            ops[r.where].add(r.op.removeprefix("aten.").removesuffix(".default"))
        return sorted(
            ((w, ", ".join(sorted(ops[w])), n) for w, n in counts.items()),
            key=lambda x: (-x[2], x[0]),
        )


class _HostCopies(TorchFunctionMode):
    """A CPU step's host tensors, seen at the torch call (on the CPU the copies dispatch nothing):
    `.cpu()` / `.to("cpu")` of a device tensor is a read and makes a host alias; `.to(device)` of a
    host tensor makes a device alias (a copy to the device); a factory without `device` (or with
    "cpu") makes a host tensor, as on a GPU."""

    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        on_device, host = self.counter.on_device, self.counter._host
        if func in _FACTORIES:
            to = kwargs.get("device")
            if isinstance(out, torch.Tensor) and (to is None or to == "cpu"):
                host[out] = True
        elif func is torch.Tensor.cpu or (func is torch.Tensor.to and _named_host(args, kwargs)):
            if on_device(args[0]):
                if not kwargs.get("non_blocking", False):
                    self.counter.record(f"Tensor.{func.__name__}")
                out = out.view_as(out) if out is args[0] else out
                host[out] = True
        elif func is torch.Tensor.to and isinstance(args[0], FakeTensor) and not on_device(args[0]):
            if _device_arg(args, kwargs) is not None and out is args[0]:
                out = out.view_as(out)  # to the device: not in `host`
        return out


# factories that make a host tensor unless given a device, as on a GPU
_FACTORIES = frozenset(
    getattr(torch, name)
    for name in "arange zeros ones empty full tensor as_tensor randn rand randint linspace eye".split()
)


def _device_arg(args, kwargs):
    """The device a `Tensor.to` call names, if any."""
    return next(
        (a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))), None
    )


def _named_host(args, kwargs) -> bool:
    """`Tensor.to("cpu")`: the host named as a string (a `torch.device` on a CPU step is the step's)."""
    return isinstance(to := _device_arg(args, kwargs), str) and torch.device(to).type == "cpu"
