"""Activation offloading (`model.offload_modules`): what a scope saves for backward goes to host
memory at the scope's exit and comes back, one scope ahead, in backward.

Legend: B batch, S sequence, D hidden, H/K query/kv heads, hd head dim, M dispatched rows, F expert
hidden.

    apply_offload(model, ("layer_input", "core_attn"), "cuda")   # in build_model, after recompute
    with SavedBytes(model) as meter: loss = model(**batch).loss    # device bytes held, host bytes
    meter.bytes, meter.offloaded_bytes

Scopes, each an `Offload` at a region slot of moevlm.model.strategies: layer_input (what is saved on
the storage of a decoder layer's input h (B,S,D)), core_attn (attention's core, a Gated DeltaNet's
chunked delta rule), mlp, moe_act (h (M,2F)), moe, vision.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from moevlm.model.decoder import DecoderLayer
from moevlm.model.region import Region
from moevlm.parallel.data_parallel import local_tensor
from moevlm.parallel.recompute import _METERS, _REGIONS, Recompute

MODULES = ("layer_input", "core_attn", "mlp", "moe_act", "moe", "vision")

# which (module classes, region slot) pairs each scope wraps: recompute's regions of the same name
_SCOPES = {
    "layer_input": (((DecoderLayer,), "region"),),
    **{s: _REGIONS[s] for s in ("core_attn", "mlp", "moe_act", "moe", "vision")},
}
_OUTER_FIRST = ("vision", "moe", "mlp", "core_attn", "moe_act", "layer_input")
# chosen scopes that leave nothing to offload under a recompute choice (every instance inside it)
_INSIDE_RECOMPUTE = {
    "full": ("core_attn", "mlp", "moe_act", "moe"),
    "moe": ("moe_act",),
}


# the CUDA-graph scopes (moevlm.parallel.cuda_graphs) each offload scope contains or shares code with
GRAPH_OVERLAPS = {
    "layer_input": ("attn", "moe_router", "moe_preprocess", "full_layer"),
    "core_attn": ("attn", "full_layer"),
    "mlp": ("full_layer",),
    "moe_act": ("full_layer",),
    "moe": ("moe_router", "moe_preprocess", "full_layer"),
    "vision": (),
}


def offload_setting(model_cfg) -> tuple[str, ...]:
    """The job's `model.offload_modules`."""
    return tuple(getattr(model_cfg, "offload_modules", None) or ())


def check(modules, recompute: tuple[str, tuple[str, ...]] = ("none", ())) -> str | None:
    """The reason `modules` cannot be offloaded under the recompute setting, or None."""
    modules = tuple(modules)
    bad = [m for m in modules if m not in MODULES]
    if bad:
        return f"model.offload_modules has {bad}; choose from {', '.join(MODULES)}"
    mode, chosen = recompute
    outer = ["full"] if mode == "full" else list(chosen) if mode == "selective" else []
    for r in outer:
        inside = [m for m in modules if m in _INSIDE_RECOMPUTE.get(r, ())]
        if inside:
            what = "model.recompute=full" if r == "full" else f"model.recompute_modules {r}"
            return (
                f"model.offload_modules {inside} lie inside the regions recomputed by {what}, which keep "
                "only their inputs (recomputed tensors are never offloaded); leave them out of "
                "model.offload_modules, or offload the recomputed region's inputs ("
                + ("layer_input" if r == "full" else r)
                + ")"
            )
    return None


def describe(modules) -> str:
    """For the metrics: "none" or "core_attn,layer_input"."""
    return ",".join(modules) if modules else "none"


# ------------------------------------------------------------------ install
def apply_offload(
    model: nn.Module,
    modules=(),
    device_type: str = "cpu",
    recompute: tuple[str, tuple[str, ...]] = ("none", ()),
) -> "OffloadState | None":
    """Install `Offload` regions for `modules` in `model` (after `apply_recompute`); the shared state,
    or None when nothing is offloaded."""
    modules = tuple(modules)
    reason = check(modules, recompute)
    if reason is not None:
        raise ValueError(reason)
    if not modules:
        return None
    state = OffloadState(device_type)
    names = dict(model.named_modules())
    recomputed = {  # modules whose whole forward is recomputed
        n for n, m in names.items() if isinstance(_unwrap(m._modules.get("region")), Recompute)
    }
    covered: set[int] = set()
    chosen = ((s, *pair) for s in _OUTER_FIRST if s in modules for pair in _SCOPES[s])
    for scope, classes, slot in chosen:
        for name, m in list(names.items()):
            if not isinstance(m, classes) or id(m) in covered:
                continue
            if isinstance(m._modules.get(slot), Offload) or _inside(name, slot, recomputed):
                continue
            m.add_module(slot, Offload(scope, state, inner=m._modules.get(slot)))
            if slot == "region" and scope != "layer_input":
                covered |= {id(sub) for sub in m.modules()}
    return state


def _unwrap(region):
    return region.inner if isinstance(region, Offload) else region


def _inside(name: str, slot: str, recomputed: set[str]) -> bool:
    """Whether slot `slot` of module `name` runs inside a recomputed region (its own whole forward when
    the slot is a part of it, or an ancestor's)."""
    if slot != "region" and name in recomputed:
        return True
    parts = name.split(".") if name else []
    return any(".".join(parts[:i]) in recomputed for i in range(len(parts)))


def set_chains(stages) -> None:
    """Each pipeline stage module's scopes form their own prefetch chains (docs/architecture.md)."""
    for i, stage in enumerate(stages):
        for m in stage.modules():
            if isinstance(m, Offload):
                m.chain = i


# ------------------------------------------------------------------ host memory, streams
_HOST_ALLOCATIONS = [0]  # > 0 while a host copy is being allocated (the planner's tracker reads it)


def allocating_host() -> bool:
    return _HOST_ALLOCATIONS[0] > 0


@contextlib.contextmanager
def _host_allocation():
    _HOST_ALLOCATIONS[0] += 1
    try:
        yield
    finally:
        _HOST_ALLOCATIONS[0] -= 1


def _host_buffer(t: torch.Tensor, pin: bool) -> torch.Tensor:
    with _host_allocation():
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)


# ------------------------------------------------------------------ state, groups, entries
class CudaStreams:
    """Every CUDA stream call the offload makes, in one place (tests stand in for it on the CPU to check
    the order of the calls: tests/parallel/test_activation_offload.py)."""

    pin = True  # host copies in pinned memory

    def __init__(self):
        self._side: dict[int, Any] = {}

    def current(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def side(self, device: torch.device):
        """The copies' stream of `device` (one per device)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._side:
            self._side[index] = torch.cuda.Stream(device=index)
        return self._side[index]

    def using(self, stream):
        return torch.cuda.stream(stream)

    def wait_stream(self, waiter, other) -> None:
        waiter.wait_stream(other)

    def record_stream(self, t: torch.Tensor, stream) -> None:
        t.record_stream(stream)

    def record_event(self, stream, timing: bool = False):
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream)
        return event

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)


class OffloadState:
    """Shared by every `Offload` of a model: the run's device type, the side streams, the open chains,
    and (with `timing`, CUDA) timing events for tests and benchmarks: `events` holds
    (kind, scope call, start, end) with kind `d2h` / `h2d` (a copy, on the side stream), `exit` (the
    scope's forward ended, on the compute stream) or `need` (backward first needs the scope's
    tensors, on the compute stream; start = end); scope calls are numbered in forward order."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.streams: CudaStreams | None = CudaStreams() if device_type == "cuda" else None
        # chain -> (its last group, the regions that opened in it)
        self._tails: dict[int, tuple["_Group", set[int]]] = {}
        self.timing = False
        self.events: list[tuple[str, int, Any, Any]] = []
        self.calls = 0  # scope calls opened (numbers them)

    @property
    def cuda(self) -> bool:
        return self.streams is not None

    def open(self, region: "Offload", args, owner: nn.Module | None = None) -> "_Group":
        tail, seen = self._tails.get(region.chain, (None, set()))
        if id(region) in seen:  # this scope ran already in the chain: the next forward
            tail, seen = None, set()
        seen.add(id(region))
        group = _Group(self, region, args, tail, owner)
        group.serial, self.calls = self.calls, self.calls + 1
        self._tails[region.chain] = (group, seen)
        return group

    def mark(self, device: torch.device, kind: str, serial: int) -> None:
        """With `timing` on CUDA: an event on the compute stream now."""
        if self.cuda and self.timing:
            ev = self.streams.record_event(self.streams.current(device), timing=True)
            self.events.append((kind, serial, ev, ev))

    @contextlib.contextmanager
    def copying(self, device: torch.device, kind: str, serial: int, after=None):
        """A copy's stream (CUDA: the side stream, timed with `timing`), which first waits for the
        stream `after` (the producers'); nothing on the CPU.  The timed start follows that wait."""
        if not self.cuda:
            yield None
            return
        streams = self.streams
        side = streams.side(device)
        with streams.using(side):
            if after is not None:
                streams.wait_stream(side, after)
            start = streams.record_event(side, timing=True) if self.timing else None
            yield side
            if start is not None:
                self.events.append((kind, serial, start, streams.record_event(side, timing=True)))


class _Entry:
    """One device storage (of one dtype) a scope saved tensors on: the span of it those tensors cover is
    copied as a whole, so every saved view comes back with its own offset, shape and strides on one new
    storage, as views of one storage (the kernels of backward see the layouts they saw: a CPU kernel
    takes another, differently rounded path for another layout).  On the device until the scope
    commits, then on the host (offloaded) or kept."""

    __slots__ = (
        "group", "base", "device", "lo", "hi", "host", "device_flat", "refs", "unpacked", "kept",
        "__weakref__",
    )  # fmt: skip

    def __init__(self, group: "_Group", t: torch.Tensor):
        self.group, self.base, self.device = group, t.detach(), t.device
        self.lo, self.hi = t.storage_offset(), t.storage_offset()
        self.host = self.device_flat = None
        self.refs, self.unpacked, self.kept = 0, 0, False

    def add(self, t: torch.Tensor) -> "_View":
        offset = t.storage_offset()
        extent = offset + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        self.lo, self.hi = min(self.lo, offset), max(self.hi, extent)
        self.refs += 1
        return _View(self, offset, tuple(t.shape), tuple(t.stride()))

    def span(self) -> torch.Tensor:
        """The covered span of the device storage, 1-D."""
        return self.base.as_strided((self.hi - self.lo,), (1,), self.lo)


class _View:
    """What autograd holds for one saved tensor of an entry."""

    __slots__ = ("entry", "offset", "shape", "stride")

    def __init__(self, entry: _Entry, offset: int, shape, stride):
        self.entry, self.offset, self.shape, self.stride = entry, offset, shape, stride

    def on(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.as_strided(self.shape, self.stride, self.offset - self.entry.lo)


class _Group:
    """The tensors one call of one scope saved, and its place in the prefetch chain."""

    def __init__(
        self, state: OffloadState, region: "Offload", args, prev: "_Group | None", owner=None
    ):
        self.state, self.region, self.prev, self.owner = state, region, prev, owner
        self.pending: dict[tuple, _Entry] | None = {}
        self.entries: list[weakref.ref] = []
        self.loaded = False  # its own tensors copied back
        self.prefetched = False  # the previous scope's copy started
        self.event = None
        self.serial = 0
        inputs = list(_tensors(args))
        self.keep_ptrs = {_ptr(t) for t in inputs if not t.requires_grad}
        # layer_input: only the storage of the scope's first input, the one carrying the gradient (h)
        self.only_ptrs = {_ptr(inputs[0])} if region.scope == "layer_input" and inputs else None
        self._param_ptrs: set[int] | None = None

    # ---- forward
    def pack(self, t: torch.Tensor):
        if self.pending is None or not self._offloadable(t):
            for meter in _METERS:
                meter.hold((t,))
            return t
        key = (_ptr(t), t.dtype)
        entry = self.pending.get(key)
        if entry is None:
            entry = self.pending[key] = _Entry(self, t)
        return entry.add(t)

    def _offloadable(self, t: torch.Tensor) -> bool:
        if not (type(t) is torch.Tensor or _is_fake(t)) or isinstance(t, nn.Parameter):
            return False
        if t.device.type != self.state.device_type or t.numel() == 0:
            return False
        ptr = _ptr(t)
        if self.only_ptrs is not None:
            return ptr in self.only_ptrs
        if ptr in self.keep_ptrs or _is_param_cast(t):
            return False
        if self._param_ptrs is None:
            params = () if self.owner is None else self.owner.parameters()
            self._param_ptrs = {_ptr(local_tensor(p)) for p in params}
        return ptr not in self._param_ptrs

    def commit(self, out) -> None:
        """At the scope's exit: offload every pending storage but the outputs'."""
        pending, self.pending = self.pending, None
        out_ptrs = {_ptr(t) for t in _tensors(out)}
        moving = []
        for entry in pending.values():
            self.entries.append(weakref.ref(entry))
            if _ptr(entry.base) in out_ptrs:
                entry.kept = True
                for meter in _METERS:
                    meter.hold((entry.base,))
            else:
                moving.append(entry)
        if not moving:
            return
        device = moving[0].device
        self.state.mark(device, "exit", self.serial)
        streams = self.state.streams
        hosts = [_host_buffer(e.span(), pin=streams is not None and streams.pin) for e in moving]
        # the compute stream, taken before `copying` makes the side stream current
        compute = streams.current(device) if streams is not None else None
        with self.state.copying(device, "d2h", self.serial, after=compute) as side:
            for entry, host in zip(moving, hosts):
                host.copy_(entry.span(), non_blocking=side is not None)
                if side is not None:  # its memory stays until the copy has read it
                    streams.record_stream(entry.base, side)
        for entry, host in zip(moving, hosts):
            for meter in _METERS:
                meter.offload(entry.base, host)
            entry.host, entry.base = host, None

    def abandon(self) -> None:
        self.pending = None

    # ---- backward
    def unpack(self, view):
        if not isinstance(view, _View):
            return view
        entry = view.entry
        if entry.kept:
            return view.on(entry.span())
        self.load()
        flat = entry.device_flat
        if flat is None:  # all unpacked before (a second backward): again from the host
            flat = self._to_device(entry)
        else:
            entry.unpacked += 1
            if entry.unpacked >= entry.refs:
                entry.device_flat = None  # autograd holds the views now; freed after their use
        streams = self.state.streams
        if streams is not None:
            stream = streams.current(flat.device)
            if self.event is not None:
                streams.wait_event(stream, self.event)
            streams.record_stream(flat, stream)
        return view.on(flat)

    def load(self) -> None:
        """Copy this scope's tensors back (once), then start the copy of the scope before it (prefetch:
        one scope ahead, not the whole chain)."""
        if not self.prefetched and self.state.timing:
            self.state.mark(torch.device(self.state.device_type), "need", self.serial)
        self._load_own()
        if not self.prefetched:
            self.prefetched = True
            prev, self.prev = self.prev, None
            if prev is not None:
                prev._load_own()

    def _load_own(self) -> None:
        if self.loaded:
            return
        self.loaded = True
        entries = [
            e
            for e in (r() for r in self.entries)
            if e is not None and not e.kept and e.device_flat is None
        ]
        if not entries:
            return
        with self.state.copying(entries[0].device, "h2d", self.serial) as side:
            for e in entries:
                e.device_flat = self._to_device(e, side is not None)
            if side is not None:
                self.event = self.state.streams.record_event(side)

    def _to_device(self, entry: _Entry, on_side: bool = False) -> torch.Tensor:
        """The entry's span on its device again: on the side stream (`on_side`, asynchronous), or on the
        compute stream after the side stream's work (the copy to host) and synchronously."""
        streams = self.state.streams
        if streams is not None and not on_side:
            streams.wait_stream(streams.current(entry.device), streams.side(entry.device))
        flat = torch.empty(entry.host.shape, dtype=entry.host.dtype, device=entry.device)
        return flat.copy_(entry.host, non_blocking=on_side)


# ------------------------------------------------------------------ the region
class Offload(Region):
    """A scope whose saved activations go to host memory in forward and come back in backward
    (docs/architecture.md); wraps the region already at its slot (`inner`: a Recompute) if any."""

    def __init__(self, scope: str, state: OffloadState, inner=None):
        super().__init__()
        self.scope = scope
        self.chain = 0
        object.__setattr__(self, "state", state)  # shared, not a submodule
        if inner is not None:
            self.inner = inner

    def extra_repr(self) -> str:
        return f"scope={self.scope}"

    def forward(self, fn, *args):
        inner = self._modules.get("inner")
        run = fn if inner is None else functools.partial(inner, fn)
        if not torch.is_grad_enabled():
            return run(*args)
        # the module whose forward this is (a bound method's owner; a plain function has no weights)
        owner = getattr(fn, "__self__", None)
        group = self.state.open(self, args, owner if isinstance(owner, nn.Module) else None)
        try:
            with torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack):
                out = run(*args)
        except BaseException:
            group.abandon()
            raise
        group.commit(out)
        return out


# ------------------------------------------------------------------ helpers
def _ptr(t: torch.Tensor) -> int:
    """The storage's identity (its StorageImpl; a fake tensor's too)."""
    return t.untyped_storage()._cdata


def _is_fake(t) -> bool:
    return isinstance(t, FakeTensor)


def _is_param_cast(t: torch.Tensor) -> bool:
    """A dtype cast of a parameter (autocast's weight copies): alive for the forward anyway."""
    fn = t.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt)


def _tensors(obj, depth: int = 0):
    """The tensors in (nested tuples, lists, dicts, dataclass-like objects of) `obj`."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 3 or obj is None or isinstance(obj, (str, int, float, bool)):
        return
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, nn.Module):
        for x in vars(obj).values():
            yield from _tensors(x, depth + 1)


__all__ = [
    "MODULES",
    "Offload",
    "OffloadState",
    "allocating_host",
    "apply_offload",
    "check",
    "describe",
    "offload_setting",
    "set_chains",
]
