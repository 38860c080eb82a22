"""Tensors without memory that still know the values a training step reads on the host.

Legend: T tokens, E experts, K top-k.

    with fake_world(world=8, rank=3), PlanMode() as mode:      # the fake process group at any size
        model = ...; x = mode.fake(real_cpu_tensor, device)    # small integer tensors keep their values
        with StorageTracker() as mem, CollectiveCounter(names) as comm:
            loss = model(x).sum(); loss.backward()
        mem.peak_bytes, comm.bytes                              # storages and collectives actually issued

Routing is balanced and the world symmetric (moevlm.plan.environments: the process group, CUDA).
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    is_fake,
)
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from moevlm.parallel.offload import allocating_host
from moevlm.plan.attribution import Attribution, local_shard

aten = torch.ops.aten
# elements: ids, counts, routing maps (524,288 at most in a recipe's host reads); never activations or
# the attention's document masks (no host read needs them; a fifth of a recipe's dry run at 2^25)
SHADOW_LIMIT = 1 << 23
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
_DEVICE = torch.ops.prim.device.default  # `t.device` of a fake tensor, asked several times per op
_ITEM = aten._local_scalar_dense.default
_LIKE_FACTORIES = (aten.zeros_like.default, aten.ones_like.default, aten.full_like.default)


def _leaves(x) -> list:
    """The leaves of an op's arguments or outputs: tuples, lists and dicts of tensors and scalars (a
    cheaper walk than pytree's, on the path of every op)."""
    out = []
    stack = [x]
    while stack:
        v = stack.pop()
        if isinstance(v, (list, tuple)):
            stack.extend(reversed(v))
        elif isinstance(v, dict):
            stack.extend(reversed(list(v.values())))
        else:
            out.append(v)
    return out


def _keeps_value(out) -> bool:
    """Whether an op's output gets a shadow: a small integer tensor among its outputs, or a scalar."""
    tensors = [o for o in _leaves(out) if isinstance(o, torch.Tensor)]
    return not tensors or any(_shadowable(o) for o in tensors)


def _shadowable(t) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and not t.is_floating_point()
        and not t.is_complex()
        and t.numel() <= SHADOW_LIMIT
    )


_PLAIN_SCALARS = frozenset(
    {
        int,
        float,
        bool,
        str,
        type(None),
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
    }
)


def _dense(t: FakeTensor) -> bool:
    return t.layout == torch.strided and not t._has_symbolic_sizes_strides


class PlanMode(FakeTensorMode):
    """FakeTensorMode with host values for small integer tensors (docs/architecture.md)."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        self.shadow = WeakIdKeyDictionary()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # see _Observer: a plan never compiles

    def _fake_op(self, func, types, args, kwargs):
        """FakeTensorMode's op, called without its `__torch_dispatch__`'s wrappers (a per-op statistics
        counter and the Dynamo guard, which a plan, never compiled, does not need)."""
        return self.dispatch(func, types, args, kwargs)

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects) -> None:
        """FakeTensorMode's op-cache key, built cheaper for what a plan passes: a dense fake tensor of
        this mode (no symbolic sizes: a plan has no shape environment) is one tuple of what its output
        depends on; its memory format, which the base class also derives, follows from its sizes and
        strides.  Anything else (nested containers, dicts, other tensors) goes to the base class."""
        if isinstance(args, dict):
            super()._prep_args_for_hash(result, args, state, id_hashed_objects)
            return
        if isinstance(args, (list, tuple)):
            result.append(type(args))
            result.append(len(args))
        for a in args:
            if type(a) is FakeTensor and a.fake_mode is self and a.constant is None and _dense(a):
                result.append(
                    (
                        a.dtype,
                        tuple(a.shape),
                        a.stride(),
                        a.fake_device,
                        a.storage_offset(),
                        a.untyped_storage().nbytes(),
                        a.requires_grad,
                        a.is_conj(),
                        a.is_neg(),
                        a.is_inference(),
                    )
                )
            elif type(a) in _PLAIN_SCALARS:
                result.append(type(a))
                result.append(a)
            else:
                super()._prep_args_for_hash(result, (a,), state, id_hashed_objects)

    def fake(self, t: torch.Tensor, device: torch.device) -> FakeTensor:
        """A fake copy of the real tensor `t` on `device`, its value kept when it is small and integer."""
        f = self.from_tensor(t).to(device)
        if _shadowable(t):
            with no_dispatch():  # a real copy: under this mode a clone would be fake
                self.shadow[f] = t.clone()
        return f

    def value(self, t):
        if isinstance(t, FakeTensor):
            return self.shadow.get(t)
        if isinstance(t, torch.Tensor) and not is_fake(t) and t.device.type != "meta":
            return t  # a real tensor: its own value
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and isinstance(args[0], FakeTensor):
            return fake_device(args[0])
        if func is _ITEM:  # .item(), and .tolist() element by element: the value, when it is known
            known = self.value(args[0])
            if known is not None:
                return known.item()
        kwargs = kwargs or {}
        if func is _WAIT_TENSOR:  # the real op returns its input (the collective's own output)
            return args[0]
        if func.namespace in _COLLECTIVE_NAMESPACES:
            out = self._fake_op(func, types, args, kwargs)
            self._collective_shadow(func, args, kwargs, out)
            return out
        if func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            return self._grouped_mm_other_dtype(types, args, kwargs)
        tensors = [a for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        factory = not tensors
        try:
            out = self._fake_op(func, types, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            known = None if factory else self._run_on_shadows(func, args, kwargs, tensors)
            if known is None:
                raise
            out = self._fake_like(known, args, kwargs)
        else:  # the value where it is kept: not for an output over SHADOW_LIMIT (a document mask)
            keep = not factory and _keeps_value(out)
            known = self._run_on_shadows(func, args, kwargs, tensors) if keep else None
        if isinstance(known, (bool, int, float)):  # bool(), is_nonzero, equal: the value itself
            return known
        if factory and _shadowable(out) and torch.Tag.nondeterministic_seeded not in func.tags:
            # zeros, ranges: small, so made for real
            known = self._run_on_shadows(func, args, kwargs, tensors)
        elif func in _LIKE_FACTORIES and known is None and _shadowable(out):
            with no_dispatch():  # zeros_like(x): the value does not depend on x's
                like = torch.empty(args[0].shape, dtype=args[0].dtype)
                known = func(like, *args[1:], **{**kwargs, "device": torch.device("cpu")})
        if known is not None:
            for o, r in zip(_leaves(out), _leaves(known)):
                if isinstance(o, FakeTensor) and _shadowable(r):
                    self.shadow[o] = r
        elif func is aten.topk.default:
            self._balanced_routing(args, out)
        elif func._schema.is_mutable:  # written with unknown values: what was known is not any more
            for i, a in enumerate(func._schema.arguments):
                v = args[i] if i < len(args) else kwargs.get(a.name)
                if a.is_write and isinstance(v, FakeTensor):
                    self.shadow.pop(v, None)
        return out

    def _grouped_mm_other_dtype(self, types, args, kwargs):
        """`torch._grouped_mm` in fp32, which the CPU kernel takes and the fake one (CUDA's rules:
        bf16 only) refuses: the output of the same shape in the inputs' dtype (a plan in fp32 is a
        check against a real CPU run)."""
        dtype = args[0].dtype

        def as_bf16(t):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                return t
            return self._fake_op(
                aten.empty_strided.default,
                (),
                (t.shape, t.stride()),
                {"dtype": torch.bfloat16, "device": t.device},
            )

        shaped = self._fake_op(
            aten._grouped_mm.default, types, tuple(as_bf16(a) for a in args), kwargs
        )
        return self._fake_op(
            aten.empty_strided.default,
            (),
            (shaped.shape, shaped.stride()),
            {"dtype": dtype, "device": shaped.device},
        )

    def _run_on_shadows(self, func, args, kwargs, tensors):
        """The op on the inputs' values (CPU), or None when an input's value is unknown or large."""
        for a in tensors:  # most ops stop at their first input (an activation: no value)
            v = self.value(a)
            if v is None or not (_shadowable(v) or v.numel() <= 1):
                return None

        def real(a):
            if isinstance(a, torch.Tensor):
                return self.value(a)
            if isinstance(a, torch.device) and a.type != "cpu":
                return torch.device("cpu")
            return a

        r_args, r_kwargs = tree_map(real, (args, kwargs))
        try:
            with no_dispatch():
                return func(*r_args, **r_kwargs)
        except Exception:  # an op the CPU refuses: the fake result stands, without a value
            return None

    def _fake_like(self, known, args, kwargs):
        """Fake outputs shaped like the values of an op whose shape depends on them (nonzero, masks)."""
        devices = [a.device for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        device = devices[0] if devices else torch.device("cpu")

        def fake(r):
            if not isinstance(r, torch.Tensor):
                return r
            return self._fake_op(
                aten.empty_strided.default,
                (),
                (r.shape, r.stride()),
                {"dtype": r.dtype, "device": device},
            )

        return tree_map(fake, known)

    def _balanced_routing(self, args, out) -> None:
        self.shadow[out[1]] = balanced_choices(args[0].shape, args[1])

    def _collective_shadow(self, func, args, kwargs, out) -> None:
        """Received values under the symmetric world (docs/architecture.md); unknown where the rule or
        the reduction is not one of these (a later host read of them then fails loudly)."""
        named = _arguments(func, args, kwargs)
        if func._opname == "wait_tensor":
            v = self.value(named["tensor"])
            if v is not None:
                self.shadow[out] = v
            return
        kind = collective_kind(func._opname)
        src = next((named[k] for k in _SENT if k in named), None)
        src = src[0] if isinstance(src, (list, tuple)) and src else src
        if kind == "all_gather" and "output_tensors" in named:  # the list form: every part is v
            v = self.value(src) if isinstance(src, torch.Tensor) else None
            for part in _leaves(named["output_tensors"]):
                if isinstance(part, FakeTensor):
                    if v is not None and part.shape == v.shape:
                        self.shadow[part] = v
                    else:
                        self.shadow.pop(part, None)
            return
        dst = (
            out
            if func.namespace == "_c10d_functional"
            else named.get(
                "output",
                named.get("output_tensor", src if kind in ("all_reduce", "broadcast") else None),
            )
        )
        if not isinstance(dst, FakeTensor):
            return
        v = self.value(src) if isinstance(src, torch.Tensor) else None
        group = _group_of(func, args, kwargs)
        n, r = (group.size(), group.rank()) if group is not None else (1, 0)
        op = named.get("reduce_op")
        op = op.lower() if isinstance(op, str) else None
        got = None
        if v is not None:
            if kind == "all_gather":
                got = torch.cat([v] * n)
            elif kind == "all_to_all" and v.shape[0] % n == 0 and dst.shape == v.shape:
                got = torch.cat([v.chunk(n)[r]] * n)
            elif kind == "all_reduce" and op in ("sum", "avg", "max", "min"):
                got = v * n if op == "sum" else v
            elif kind == "reduce_scatter" and op in ("sum", "avg") and v.shape[0] % n == 0:
                got = v.chunk(n)[r] * (n if op == "sum" else 1)
            elif kind == "broadcast":
                got = v
        if got is not None and got.shape == dst.shape:
            self.shadow[dst] = got
        else:
            self.shadow.pop(dst, None)


def _arguments(func, args, kwargs) -> dict:
    """The op's arguments by schema name."""
    named = dict(kwargs)
    for a, value in zip(func._schema.arguments, args):
        named[a.name] = value
    return named


def _group_of(func, args, kwargs):
    """The process group a collective op names (by name, or as the c10d ops' boxed ProcessGroup)."""
    named = _arguments(func, args, kwargs)
    if isinstance(named.get("group_name"), str):
        return dist.distributed_c10d._resolve_process_group(named["group_name"])
    if named.get("process_group") is not None:
        return dist.ProcessGroup.unbox(named["process_group"])
    return None


def balanced_choices(shape, k: int) -> torch.Tensor:
    """Top-k expert ids of scores of `shape` (..., E) when every expert gets the same load: token t
    chooses experts (t + j (E // k)) mod E, j < k (CPU, int64).  Each token's choices are spread
    over the experts, and so over the expert-parallel ranks, as a trained router's are; consecutive
    ids would put them on one rank and flatter the deduplicating dispatchers (DeepEP, HybridEP send
    a token once per rank)."""
    E = shape[-1]
    rows = math.prod(shape[:-1])
    idx = (torch.arange(rows)[:, None] + torch.arange(k)[None, :] * max(1, E // k)) % E
    return idx.reshape(*shape[:-1], k)


class BalancedRouting(TorchDispatchMode):
    """A real run routed as a plan is: every `topk` returns the balanced choices and their scores
    (for a measured step to compare with a plan)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten.topk.default:
            scores, k = args[0], args[1]
            idx = balanced_choices(scores.shape, k).to(scores.device)
            return scores.gather(-1, idx), idx
        return func(*args, **(kwargs or {}))


def fake_device(t: FakeTensor) -> torch.device:
    """`t.device` as FakeTensor answers it."""
    return torch.device("meta") if t.fake_mode.in_kernel_invocation else t.fake_device


class _Observer(TorchDispatchMode):
    """A mode stacked over PlanMode: answers `t.device` itself (most dispatches are that query;
    passed down, each would cross every mode below) and hands every op to `handle`.  Its
    `__torch_dispatch__` is not wrapped in torch's Dynamo guard (`_should_skip_dynamo`): the dry runs
    never compile, and the guard costs every op a frame-evaluation switch on each mode it crosses."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and isinstance(args[0], FakeTensor):
            return fake_device(args[0])
        return self.handle(func, args, kwargs or {})

    def handle(self, func, args, kwargs):
        raise NotImplementedError


_EXPANDED = ("moevlm_deepep", "moevlm_hybridep")


def _python_body(func):
    """The Python body of one of our custom ops with a data-dependent output size, else None."""
    if func.namespace not in _EXPANDED:
        return None
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(f"{func.namespace}::{func._opname}")
    return None if opdef is None else opdef._init_fn


# ----------------------------------------------------------------- measuring
class StorageTracker(_Observer):
    """Live bytes of the storages the ops create (real or fake) and their peak; `track(tensors)`
    registers storages made outside (parameters, the batch).  A storage resized in place (FSDP frees
    and refills its unsharded weights so) counts at its new size: `UntypedStorage.resize_` is not an
    op a dispatch mode sees, so it is wrapped while the tracker is active.  Every storage is labelled
    when it is born (`moevlm.plan.attribution`: kind, module of `where`, op); `split_at_peak()`."""

    def __init__(self, where=None):
        super().__init__()
        self.live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.attribution = Attribution(self.live, where)
        self._func = None  # the op whose outputs are being added
        # host memory: the activation offload's copies (moevlm.parallel.offload), never device bytes
        self.host_live: dict[int, int] = {}
        self.host_live_bytes = 0
        self.host_peak_bytes = 0
        self.host_total_bytes = 0  # every host copy made (= bytes copied to the host and back)
        self._resize = torch.UntypedStorage.resize_  # the one `start` wraps and `stop` puts back

    def track(self, tensors) -> None:
        self._func = None
        for t in tensors:
            self._add(t)
        self._peak()

    def _peak(self) -> None:
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.attribution.new_peak()

    def _add(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" and not is_fake(t):
            return
        self._add_storage(local_shard(t).untyped_storage())

    def _add_storage(self, st, kind: str | None = None) -> None:
        key = st._cdata
        if key in self.live or key in self.host_live:
            return
        if allocating_host():
            self.host_total_bytes += st.nbytes()
            self._set_host(key, st.nbytes())
            weakref.finalize(st, self._set_host, key, 0)
            return
        self.attribution.born(key, self._func, kind)
        self._set(key, st.nbytes())
        weakref.finalize(st, self._set, key, 0)

    def _set_host(self, key: int, nbytes: int) -> None:
        self.host_live_bytes += nbytes - self.host_live.pop(key, 0)
        if nbytes:
            self.host_live[key] = nbytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_live_bytes)

    def _set(self, key: int, nbytes: int) -> None:
        delta = nbytes - self.live.pop(key, 0)
        if nbytes:
            self.live[key] = nbytes
        self.live_bytes += delta
        if delta or not nbytes:
            self.attribution.moved(key, delta, not nbytes)

    def observe(self, func, args, kwargs, out) -> None:
        self._func = func
        for t in _leaves(out):
            self._add(t)
        self._peak()

    # ------------------------------------------------------------- attribution
    def split_at_peak(self) -> dict:
        """{Label: bytes} of the storages live at the peak (sums to `peak_bytes`)."""
        return self.attribution.split_at_peak()

    def reset_peak(self) -> None:
        """Measure a new peak from now on (the optimizer step's own)."""
        self.peak_bytes = self.live_bytes
        self.attribution.reset_peak()

    def handle(self, func, args, kwargs):
        out = func(*args, **kwargs)
        self.observe(func, args, kwargs, out)
        return out

    def __enter__(self):
        self.start()
        return super().__enter__()

    def __exit__(self, *exc):
        self.stop()
        return super().__exit__(*exc)

    def start(self) -> None:
        self._resize = resize = torch.UntypedStorage.resize_
        tracker = self

        def tracked_resize(st, size):
            out = resize(st, size)
            if st._cdata in tracker.live:
                tracker._set(st._cdata, st.nbytes())
            else:
                tracker._func = "UntypedStorage.resize_"
                tracker._add_storage(st, "gathered weights")
            tracker._peak()
            return out

        torch.UntypedStorage.resize_ = tracked_resize

    def stop(self) -> None:
        torch.UntypedStorage.resize_ = self._resize


class CollectiveCounter(_Observer):
    """Bytes per phase, group role and collective of the collectives issued (docs/architecture.md).

    `phase` names what runs now (set by the caller); `as_dict(scale)` sums the phases, each times its
    scale (a phase run once that stands for several: the step's repeated micro-batches)."""

    def __init__(self, roles: dict[str, str] | None = None):
        super().__init__()
        self.roles = roles or {}
        self.phase = "step"
        self.bytes: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))

    def observe(self, func, args, kwargs, out) -> None:
        if func.namespace in _COLLECTIVE_NAMESPACES:
            kind = collective_kind(func._opname)
            group = _group_of(func, args, kwargs) if kind is not None else None
            if group is not None and group.size() > 1:
                role = self.roles.get(group.group_name, group.group_name)
                self.bytes[self.phase][role][kind] += _payload(func, args, kwargs)

    def handle(self, func, args, kwargs):
        self.observe(func, args, kwargs, None)
        return func(*args, **kwargs)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def as_dict(self, scale: dict[str, float] | None = None) -> dict[str, dict[str, int]]:
        total: dict = defaultdict(lambda: defaultdict(float))
        for phase, groups in self.bytes.items():
            k = (scale or {}).get(phase, 1)
            for role, kinds in groups.items():
                for kind, b in kinds.items():
                    total[role][kind] += b * k
        return {g: {c: round(b) for c, b in sorted(k.items())} for g, k in sorted(total.items())}


class DryRunObservers(_Observer):
    """A dry run's `comm` (CollectiveCounter) and `mem` (StorageTracker) as one dispatch mode over
    PlanMode (each mode stacked costs every op one more dispatch).  Our custom ops whose fake has a
    data-dependent output size (the DeepEP and HybridEP exchanges: the received row count) run their
    Python body instead, through this mode again: its ops see the shadows (the routing) and the
    trackers see its collectives and buffers."""

    def __init__(self, mem: StorageTracker, comm: CollectiveCounter):
        super().__init__()
        self.mem, self.comm = mem, comm

    def handle(self, func, args, kwargs):
        body = _python_body(func)
        if body is not None:
            TorchDispatchMode.__enter__(self)  # re-entered: the trackers see the body's ops
            try:
                return body(*args, **kwargs)
            finally:
                TorchDispatchMode.__exit__(self, None, None, None)
        self.comm.observe(func, args, kwargs, None)
        out = func(*args, **kwargs)
        self.mem.observe(func, args, kwargs, out)
        return out

    def __enter__(self):
        self.mem.start()
        return super().__enter__()

    def __exit__(self, *exc):
        self.mem.stop()
        return super().__exit__(*exc)


_KINDS = (
    ("reduce_scatter", "reduce_scatter"),
    ("allreduce", "all_reduce"),
    ("all_reduce", "all_reduce"),
    ("allgather", "all_gather"),
    ("all_gather", "all_gather"),
    ("alltoall", "all_to_all"),
    ("all_to_all", "all_to_all"),
    ("broadcast", "broadcast"),
    ("batch_p2p", "send/recv"),
    ("send", "send"),
    ("recv", "recv"),
    ("gather", "gather"),
    ("scatter", "scatter"),
    ("reduce", "reduce"),
)
_SENT = ("input", "inputs", "input_tensor", "input_tensors", "input_list", "tensor", "tensors")


def collective_kind(opname: str) -> str | None:
    """all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv...; None for what
    moves no data (waits, barriers, checks)."""
    for part, kind in _KINDS:
        if part in opname:
            return kind
    return None


def _payload(func, args, kwargs) -> int:
    """Bytes this rank puts into the collective (for a receive: what it receives)."""
    named = _arguments(func, args, kwargs)
    sent = next((named[k] for k in _SENT if k in named), None)
    return sum(t.numel() * t.element_size() for t in _leaves(sent) if isinstance(t, torch.Tensor))
