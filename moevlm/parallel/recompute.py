"""Recompute (activation checkpointing): `apply_recompute(model, mode, modules)` installs
`Recompute` regions, recomputed in backward from their inputs; `SavedBytes` measures what is kept.

Legend: T tokens, D hidden, M dispatched rows, F expert hidden.

    apply_recompute(model, "selective", ("core_attn", "moe_act"))   # in build_model, after TP/EP
    apply_recompute(model, "full", collectives="reissue")            # the exchanges run again in backward
    with SavedBytes(model) as meter: loss = model(**batch).loss      # measure what forward keeps
    meter.bytes                                                      # activations held for backward

Modes: none; full (each decoder layer and vision block whole); selective, the regions in `modules`:
core_attn (the attention core; a Gated DeltaNet layer's chunked delta rule), layernorm, mlp, moe_act,
moe, vision.  Collectives (`COMM_NAMESPACES`): `save` (the
default) keeps their outputs, so backward never issues a collective twice; `reissue` recomputes them
like any op, as Megatron's full recompute does: a region then keeps only its inputs (under full
recompute with expert parallelism, not each layer's dispatched rows) and backward exchanges again.
Why: docs/architecture.md.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from moevlm.model.attention import CoreAttention
from moevlm.model.decoder import DecoderLayer, RMSNorm
from moevlm.model.gated_deltanet import GatedDeltaNet
from moevlm.model.moe import DenseMLP, Experts, MoEBlock
from moevlm.model.region import Region
from moevlm.model.vision import VisionBlock, VisionMLP

MODES = ("none", "selective", "full")
MODULES = ("core_attn", "layernorm", "mlp", "moe_act", "moe", "vision")
# a region's collective outputs: kept, or issued again in backward
COLLECTIVES = ("save", "reissue")
COMM_NAMESPACES = (
    "_c10d_functional",
    "_c10d_functional_autograd",
    "moevlm_deepep",
    "moevlm_hybridep",
)  # + DeepEP's, HybridEP's ops

# which (module classes, region slot) pairs each choice wraps (the slot `region` is the module's whole
# forward; a Gated DeltaNet layer's core is its chunked delta rule); `full` is decoder layers + vision blocks
_REGIONS = {
    "core_attn": (((CoreAttention,), "region"), ((GatedDeltaNet,), "core_region")),
    "layernorm": (((RMSNorm, nn.LayerNorm), "region"),),
    "mlp": (((DenseMLP, VisionMLP), "region"),),
    "moe_act": (((Experts,), "act_region"),),
    "moe": (((MoEBlock,), "region"),),
    "vision": (((VisionBlock,), "region"),),
    "full": (((DecoderLayer, VisionBlock), "region"),),
}
_OUTER_FIRST = ("full", "vision", "moe", "mlp", "core_attn", "moe_act", "layernorm")


def describe(mode: str, modules=(), collectives: str = "save") -> str:
    """What ran, for the metrics: "none", "full", "selective:core_attn,moe_act", and "+reissue" where
    the regions' collectives run again in backward."""
    out = f"selective:{','.join(modules)}" if mode == "selective" else mode
    return out + "+reissue" if collectives == "reissue" and mode != "none" else out


def recompute_setting(model_cfg) -> tuple[str, tuple[str, ...]]:
    """(mode, modules) from the job's `model` section; modules only count for `selective`."""
    mode = model_cfg.recompute
    return mode, tuple(model_cfg.recompute_modules or ()) if mode == "selective" else ()


def check(mode: str, modules, collectives: str = "save") -> str | None:
    """The reason `mode`/`modules`/`collectives` cannot run, or None."""
    if mode not in MODES:
        return f"model.recompute={mode!r}; choose one of {', '.join(MODES)}"
    if collectives not in COLLECTIVES:
        return (
            f"model.recompute_collectives={collectives!r}; choose one of {', '.join(COLLECTIVES)}"
        )
    bad = [m for m in modules if m not in MODULES]
    if bad:
        return f"model.recompute_modules has {bad}; choose from {', '.join(MODULES)}"
    if mode == "selective" and not modules:
        return (
            "model.recompute=selective with no model.recompute_modules; name at least one of "
            + ", ".join(MODULES)
        )
    return None


def apply_recompute(
    model: nn.Module, mode: str = "none", modules=(), collectives: str = "save"
) -> None:
    """Install `Recompute` regions at the chosen points of `model` (built, parallelized or not);
    `collectives`: save their outputs or reissue them in backward (module docstring)."""
    reason = check(mode, tuple(modules), collectives)
    if reason is not None:
        raise ValueError(reason)
    if mode == "none":
        return
    choices = ["full"] if mode == "full" else [c for c in _OUTER_FIRST if c in modules]
    covered: set[int] = set()  # modules inside an already-wrapped region
    for classes, slot in (pair for choice in choices for pair in _REGIONS[choice]):
        for m in list(model.modules()):
            if (
                isinstance(m, classes)
                and id(m) not in covered
                and not isinstance(m._modules.get(slot), Recompute)
            ):
                m.add_module(slot, Recompute(reissue=collectives == "reissue"))
                if slot == "region":
                    covered |= {id(sub) for sub in m.modules()}


class Recompute(Region):
    """A region recomputed in backward: torch's non-reentrant checkpoint with the selective cache that
    keeps collective outputs (`reissue`: recomputes them too); plain when autograd is off."""

    def __init__(self, reissue: bool = False):
        super().__init__()
        self.reissue = reissue

    def extra_repr(self) -> str:
        return "collectives reissued in backward" if self.reissue else ""

    def forward(self, fn, *args):
        # the checkpoint saves its tensor inputs through the saved-tensor hooks active here (SavedBytes's,
        # or an enclosing offload scope's), so a meter sees them there
        if not torch.is_grad_enabled():
            return fn(*args)
        if self.reissue:  # nothing kept but the inputs: torch's plain non-reentrant checkpoint
            return checkpoint(fn, *args, use_reentrant=False)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=_sac_contexts)


def save_communication(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """The selective-checkpoint policy: keep every collective's output, recompute the rest."""
    if func.namespace in COMM_NAMESPACES:
        # torch >= 2.13 hands the policy the op's output (measuring only)
        out = getattr(ctx, "op_output", None)
        if not ctx.is_recompute and out is not None:
            for meter in _METERS:
                meter.hold(out if isinstance(out, (tuple, list)) else (out,))
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# Runtime ops of module hooks (FSDP2's unshard/reshard, profiler annotations) may run a different number of
# times in forward and in recomputation; they are not the region's computation, so the selective cache neither
# stores nor replays them (otherwise its per-op counters go out of step: "... not found in storage").
_PASS_THROUGH = ("profiler", "fsdp", "c10d")


@functools.cache
def _pass_through(cls):
    class PassThrough(cls):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in _PASS_THROUGH:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    PassThrough.__name__ = "PassThrough" + cls.__name__
    return PassThrough


def _with_pass_through(mode):
    """A copy of torch's selective-checkpoint mode `mode` (same state) whose class lets _PASS_THROUGH ops by."""
    cls = _pass_through(type(mode))
    copy = cls.__new__(cls)
    copy.__dict__.update(mode.__dict__)
    return copy


def _sac_contexts():
    caching, cached = create_selective_checkpoint_contexts(save_communication)
    return _with_pass_through(caching), _with_pass_through(cached)


# ------------------------------------------------------------------ measuring
# active meters (a measurement tool: tests and bench/recompute_memory.py)
_METERS: list["SavedBytes"] = []


class SavedBytes:
    """Bytes of the distinct storages one forward keeps for backward (docs/architecture.md)."""

    def __init__(self, model: nn.Module):
        self._params = {  # a DTensor parameter (FSDP, TP) by its local shard
            getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in model.parameters()
        }
        # storage pointer -> a tensor on it (kept alive: no reuse)
        self._held: dict[int, torch.Tensor] = {}
        # offloaded tensors (kept alive: no reuse) -> their host copies' bytes
        self._offloaded: dict[tuple, tuple[torch.Tensor, int]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._held.values())

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of the distinct host copies the offload scopes made in this forward."""
        return sum(n for _, n in self._offloaded.values())

    @property
    def offloaded_storage_bytes(self) -> int:
        """Bytes of the distinct device storages something was offloaded from and nothing else holds
        (what offloading freed on the device)."""
        seen = {k[0]: t for k, (t, _) in self._offloaded.items() if k[0] not in self._held}
        return sum(t.untyped_storage().nbytes() for t in seen.values())

    def offload(self, t: torch.Tensor, host: torch.Tensor) -> None:
        """`t` (saved in an offload scope) now lives in `host`; its storage counts on the device only
        if some other saved reference holds it (`hold`)."""
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        self._offloaded.setdefault(key, (t, host.untyped_storage().nbytes()))

    def hold(self, *groups) -> None:
        for group in groups:
            for t in group:
                t = getattr(t, "elem", t)  # an AsyncCollectiveTensor's data
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in self._params and ptr != 0:
                        self._held.setdefault(ptr, t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.hold((t,))
        return t

    def __enter__(self) -> "SavedBytes":
        _METERS.append(self)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        _METERS.remove(self)
