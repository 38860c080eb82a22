"""What a plan's peak is made of: the live storages at the moment of the peak, by kind, module and op.

    where = ModuleStack(model)                       # the module running now, forward or backward
    mem = StorageTracker(where)                      # every storage labelled when it is born
    with where, mem, saved_as_activations(mem): ...  # a step; mem.attribution.label_grads(model)
    split = mem.split_at_peak()                      # {Label: bytes}, summing to mem.peak_bytes
    summarize(split)                                 # by kind, by module, the largest labels

Kinds: weights, gathered weights (FSDP's unsharded copies), gradients, optimizer state, saved
activations (kept for backward, or recomputed there), communication buffers, temporaries.  A module
is named by its path in the model with layer indices as `*` ("" outside every module); the op is the
one that made the storage, with the Python function that called it for allocations.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections import defaultdict
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_flatten

KINDS = (
    "weights",
    "gathered weights",
    "gradients",
    "optimizer state",
    "saved activations",
    "communication buffers",
    "temporaries",
)
_COMM_NAMESPACES = ("c10d", "_c10d_functional", "fsdp")
# allocations whose op says nothing: the Python function that asked for them names them
_ALLOCATORS = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "zeros",
    "zeros_like",
    "new_zeros",
    "ones_like",
    "full",
    "full_like",
    "new_full",
}
_STATE_MAKERS = ("aten.zeros_like", "aten.empty_like", "aten.zeros", "aten.full", "aten.lift_fresh")
_WRAPPERS = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "region"}
_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


class Label(NamedTuple):
    kind: str
    module: str
    op: str
    phase: str  # setup, forward, backward, recompute, step, optimizer


def module_name(path: str) -> str:
    """A module path as attribution names it: wrappers dropped, layer indices as `*`."""
    parts = [p for p in path.split(".") if p and p not in _WRAPPERS]
    return _LAYER_INDEX.sub("*", ".".join(parts))


class ModuleStack:
    """The innermost module running: forward (global module hooks) and backward (hooks on its
    outputs' and inputs' gradients, as torch's ModuleTracker); a forward inside a backward is a
    recomputation."""

    def __init__(self, model: torch.nn.Module | None = None):
        self.names = {}
        if model is not None:
            self.names = {id(m): module_name(n) for n, m in model.named_modules()}
        self.stack: list[tuple[str, bool, int]] = []  # (name, in forward, call number)
        self._calls = 0
        self._handles: list = []
        self._grad_hooks: list = []
        self._callback = False

    def current(self) -> tuple[str, str]:
        """(innermost module, phase: forward, backward or recompute)."""
        backward = torch._C._current_graph_task_id() != -1
        if not self.stack:
            return "", "backward" if backward else "forward"
        name, forward, _ = self.stack[-1]
        return name, ("recompute" if forward else "backward") if backward else "forward"

    def _name(self, mod) -> str:
        name = self.names.get(id(mod))
        return type(mod).__name__ if name is None else name

    def _push(self, entry) -> None:
        self.stack.append(entry)

    def _pop(self, entry) -> None:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i] == entry:
                del self.stack[i]
                return

    # The backward hooks are plain tensor hooks whose closures hold no tensor and no autograd node
    # (torch's multi-grad hooks hold the nodes, which kept recomputed activations alive).
    def _pre(self, mod, args) -> None:
        self._calls += 1
        name, call = self._name(mod), self._calls
        self._push((name, True, call))
        for t in tree_flatten(args)[0]:
            if _needs_grad(t):  # backward of `mod` ends when its inputs' gradients are made
                self._grad_hooks.append(t.register_hook(lambda _: self._pop((name, False, call))))

    def _post(self, mod, args, out) -> None:
        name, call = self._name(mod), self._calls_of(mod)
        self._pop((name, True, call))
        started = []

        def start(_):  # backward of `mod` starts when its first output gradient arrives
            if not started:
                started.append(True)
                self._enter_backward((name, False, call))

        for t in tree_flatten(out)[0]:
            if _needs_grad(t):
                self._grad_hooks.append(t.register_hook(start))

    def _calls_of(self, mod) -> int:
        """The call number of `mod`'s innermost open forward."""
        name = self._name(mod)
        for entry in reversed(self.stack):
            if entry[0] == name and entry[1]:
                return entry[2]
        return -1

    def _enter_backward(self, entry) -> None:
        if not self._callback:  # the stack of a backward ends with it
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._callback = True
        self._push(entry)

    def _end_backward(self) -> None:
        self.stack = [e for e in self.stack if e[1]]
        self._callback = False

    def __enter__(self):
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post),
        ]
        return self

    def __exit__(self, *exc):
        for h in self._handles + self._grad_hooks:
            h.remove()
        self._handles, self._grad_hooks, self.stack = [], [], []


def _needs_grad(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


class Attribution:
    """Live bytes per Label and their split at the peak, kept by StorageTracker (moevlm.plan.fake):
    `born` labels a new storage, `moved` applies a change of its bytes, `new_peak` marks the state as
    the peak's; the split is copied only when something is about to change it (a free, a relabel)."""

    def __init__(self, sizes: dict[int, int], where: ModuleStack | None = None):
        self.where, self._sizes = where, sizes  # the tracker's live storages: key -> bytes
        self.phase = "setup"  # "step": forward/backward/recompute from the module stack
        self.label_of: dict[int, Label] = {}
        self.live: dict[Label, int] = defaultdict(int)
        self.peak: dict[Label, int] = {}
        self._pending = False
        self._grad_paths: dict[int, str] = {}  # gradient storage -> its parameters' common path

    # ---------------------------------------------------------------- bookkeeping
    def born(self, key: int, func, kind: str | None = None) -> None:
        self.label_of[key] = self.label(func, kind)

    def moved(self, key: int, delta: int, gone: bool) -> None:
        if delta < 0 and self._pending:
            self._snapshot()
        label = self.label_of.get(key)
        if label is None:
            label = self.label_of[key] = self.label(None)
        self.live[label] += delta
        if gone:
            del self.label_of[key]
            self._grad_paths.pop(key, None)

    def new_peak(self) -> None:
        self._pending = True

    def _snapshot(self) -> None:
        self.peak = dict(self.live)
        self._pending = False

    def split_at_peak(self) -> dict[Label, int]:
        if self._pending:
            self._snapshot()
        return {k: v for k, v in self.peak.items() if v}

    def reset_peak(self) -> None:
        """The peak is now (what lives now)."""
        self._snapshot()

    def relabel(self, key: int, kind: str, module: str | None = None) -> None:
        old = self.label_of.get(key)
        if old is None or old.kind == kind and (module is None or old.module == module):
            return
        if self._pending:
            self._snapshot()
        new = old._replace(kind=kind, module=old.module if module is None else module)
        nbytes = self._sizes.get(key, 0)
        self.live[old] -= nbytes
        self.live[new] += nbytes
        self.label_of[key] = new

    # ---------------------------------------------------------------- relabelling
    def label_tensors(self, tensors, kind: str, module: str | None = None, keep=()) -> None:
        """Relabel the storages of `tensors` as `kind` (and `module`), unless their kind is in `keep`."""
        for t in tensors:
            key = _storage_key(t)
            old = self.label_of.get(key)
            if old is not None and old.kind not in keep:
                self.relabel(key, kind, module)

    def label_params(self, model) -> None:
        """Parameters (and buffers) as weights of the module that holds them."""
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            self.label_tensors((t,), "weights", module_name(name.rpartition(".")[0]))

    def grad_hook(self, name: str):
        """A post-accumulate-grad hook for the parameter `name`: its gradient's storage as gradients
        (FSDP calls it on the sharded parameter with its reduced shard)."""
        module = name.rpartition(".")[0]

        def hook(p) -> None:
            key = _storage_key(p.grad)
            old = self.label_of.get(key)
            if old is not None:
                seen = self._grad_paths.get(key)
                path = self._grad_paths[key] = (
                    module if seen is None else _common_path([seen, module])
                )
                self.relabel(key, "gradients", module_name(path))

        return hook

    def label_grads(self, model) -> None:
        """Gradients as such, of the module that holds their parameters (of the modules' common path
        when one storage holds several, as FSDP's reduced shards do)."""
        owners: dict[int, list[str]] = {}
        for name, p in model.named_parameters():
            if p.grad is not None:
                owners.setdefault(_storage_key(p.grad), []).append(name.rpartition(".")[0])
        for key, names in owners.items():
            if key in self.label_of:
                self.relabel(key, "gradients", module_name(_common_path(names)))

    # ---------------------------------------------------------------- labels
    def label(self, func, kind: str | None = None) -> Label:
        module, phase = self.where.current() if self.where is not None else ("", "forward")
        if self.phase != "step":
            phase = self.phase
        op = _op_name(func)
        if kind is None:
            kind = _kind_at_birth(func, op, phase)
        if isinstance(func, torch._ops.OpOverload) and func._opname in _ALLOCATORS:
            site = _caller()
            if site:
                op = f"{op} in {site}"
                if site.startswith("torch.distributed"):
                    kind = "communication buffers"
        return Label(kind, module, op, phase)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (read, not made by an op: the planner counts bytes and storages on the
    path of every op, and `to_local()` would dispatch two more); any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _storage_key(t) -> int:
    t = getattr(t, "elem", t)  # an AsyncCollectiveTensor's data
    t = local_shard(t)
    return t.untyped_storage()._cdata


def _common_path(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts):
        if any(p != level[0] for p in level):
            break
        common.append(level[0])
    return ".".join(common)


def _kind_at_birth(func, op: str, phase: str) -> str:
    if phase == "setup":
        return "weights"
    if op.split(".")[0] in _COMM_NAMESPACES:
        return "communication buffers"
    if phase == "optimizer":
        return "optimizer state" if op in _STATE_MAKERS else "temporaries"
    if phase == "recompute":
        return "saved activations"
    return "temporaries"


_OP_NAMES: dict = {}


def _op_name(func) -> str:
    """ "aten.sum" for an op; a string stands for itself (a storage made outside the ops)."""
    if func is None:
        return "(made outside an op)"
    if isinstance(func, str):
        return func
    name = _OP_NAMES.get(func)
    if name is None:
        name = _OP_NAMES[func] = f"{func.namespace}.{func._opname}"
    return name


# frames of the dispatch machinery, never the caller that asked for an allocation
_MACHINERY = (
    "torch/_ops.py",
    "torch/utils/_python_dispatch.py",
    "torch/_subclasses/",
    "torch/utils/_stats.py",
    "torch/_prims_common/",
    "torch/_decomp/",
    "torch/_refs/",
    "torch/_compile.py",
    "torch/_tensor.py",
    "torch/overrides.py",
    "torch/_library/",
    "moevlm/plan/",
    "torch/utils/_contextlib.py",
    "torch/autograd/",
    "torch/nn/modules/module.py",
    "torch/_dynamo/",
)
_SITES: dict = {}


def _caller() -> str:
    """`module:function` of the first Python frame outside the dispatch machinery ("" if none)."""
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        site = _SITES.get(code)
        if site is None:
            path = code.co_filename.replace("\\", "/")
            if any(m in path for m in _MACHINERY):
                site = _SITES[code] = ""
            else:
                site = _SITES[code] = f"{_module_of(path)}:{code.co_name}"
        if site:
            return site
        f = f.f_back
    return ""


def _module_of(path: str) -> str:
    for root in ("/torch/", "/moevlm/", "/kernels/"):
        if root in path:
            tail = path.rsplit(root, 1)[1].removesuffix(".py").replace("/", ".")
            return root.strip("/") + "." + tail
    return path.rsplit("/", 1)[-1]


_NOT_ACTIVATIONS = ("weights", "gathered weights", "gradients")


@contextlib.contextmanager
def saved_as_activations(mem):
    """Storages autograd keeps for backward are labelled saved activations (they keep the module and
    op that made them); an inner saved-tensor hook (a recompute region, an offload scope) takes over
    inside it, as it does on a GPU."""

    def pack(t):
        mem.attribution.label_tensors((t,), "saved activations", keep=_NOT_ACTIVATIONS)
        return t  # itself: no copy, no op (a saved output is still freed by its backward)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def summarize(split: dict[Label, int], top: int = 12) -> dict:
    """The JSON a plan carries: bytes by kind, by module (every kind), by (kind, module), the `top`
    largest labels and the largest temporaries made outside every module."""
    by_kind = {k: 0 for k in KINDS}
    by_module: dict[str, int] = defaultdict(int)
    for label, b in split.items():
        by_kind[label.kind] = by_kind.get(label.kind, 0) + b
        by_module[label.module or "(outside modules)"] += b
    rows = sorted(split.items(), key=lambda kv: -kv[1])

    def row(label, b):
        return {**label._asdict(), "bytes": b}

    loose = [row(lb, b) for lb, b in rows if not lb.module and lb.kind == "temporaries"]
    pairs: dict[tuple, int] = defaultdict(int)
    for label, b in split.items():
        pairs[label.kind, label.module] += b
    return {
        "by_kind": {k: b for k, b in by_kind.items() if b},
        "by_module": dict(sorted(by_module.items(), key=lambda kv: -kv[1])[:top]),
        "by_kind_and_module": [
            {"kind": k, "module": m, "bytes": b}
            for (k, m), b in sorted(pairs.items(), key=lambda kv: -kv[1])[:top]
        ],
        "top": [row(lb, b) for lb, b in rows[:top]],
        "unattributed": loose[: top // 2],
    }


def optimizer_split(opt, model) -> dict[Label, int]:
    """The optimizer's state by the module of its parameter (what lives through every later step)."""
    names = {id(p): n.rpartition(".")[0] for n, p in model.named_parameters()}
    out: dict[Label, int] = defaultdict(int)
    for p, state in opt.state.items():
        module = module_name(names.get(id(p), ""))
        label = Label("optimizer state", module, "(kept between steps)", "optimizer")
        for t in state.values():
            if isinstance(t, torch.Tensor):
                t = local_shard(t)
                out[label] += t.numel() * t.element_size()
    return dict(out)


def offloaded_split(kind: str, sizes: dict) -> dict[Label, int]:
    """What optimizer offload `kind` takes off the device, as negative terms (moevlm.plan.dry_run)."""
    if kind == "host":  # the state lives on the host: nothing of it is added
        return {}
    gone = ("weights", "params_bytes"), ("gradients", "grads_bytes")
    return {Label(k, "(offloaded to host)", "", "optimizer"): -sizes[f] for k, f in gone}


def merge_splits(*splits: dict[Label, int]) -> dict[Label, int]:
    out: dict[Label, int] = defaultdict(int)
    for split in splits:
        for label, b in split.items():
            out[label] += b
    return dict(out)


def exact_split(split: dict[Label, int], peak: int) -> dict[Label, int]:
    """`split` with its rounding residual (an extrapolation's) on its largest term: it sums to `peak`."""
    split = {k: v for k, v in split.items() if v}
    residual = peak - sum(split.values())
    if residual and split:
        largest = max(split, key=split.get)
        split[largest] += residual
    return split
