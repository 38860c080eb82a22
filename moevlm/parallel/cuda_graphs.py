"""CUDA-graph scopes (`model.cuda_graph_scope`): parts of every decoder layer captured once as CUDA
graphs (forward and backward) and replayed, to remove host launch overhead.

Legend: B batch, S sequence, D hidden, T tokens, K top-k, E experts, N = T*K rows.

    graphs = apply_cuda_graphs(model, ["attn", "moe_router", "moe_preprocess"])   # in build_model
    ...train: the first training forward on CUDA captures, later ones replay...
    graphs.captures()    # {"attn": layers, "moe_router": MoE layers, ...} once shapes are fixed

Scopes, each a `GraphedRegion` at a region slot of moevlm.model.strategies: `attn` (sdpa only),
`moe_router`, `moe_preprocess` (the dispatcher's `preprocess`) and `full_layer` (the whole layer,
where it is static and sync-free).  Why: docs/architecture.md.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from moevlm.model.attention import DocMask
from moevlm.model.moe import RouterStats
from moevlm.model.region import Region

SCOPES = ("attn", "moe_router", "moe_preprocess", "full_layer")


class _Capturable(nn.Module):
    """What make_graphed_callables graphs: `fn` over tensors, with `parts`' parameters as static inputs.
    Kept outside the model tree (the parts keep their own parents)."""

    def __init__(self, fn: Callable, parts: tuple[nn.Module, ...]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.fn = fn

    def forward(self, *tensors):
        return self.fn(*tensors)


class _Region:
    """How one kind of region turns its call into tensors and back.  Subclasses set `kind`, `parts`,
    `shared` (positions of inputs every layer shares), `owner` (whose training flag decides) and
    implement flatten; `build(fn, key)` is the function of tensors a capture graphs (default: `fn`)."""

    kind = ""
    shared: tuple[int, ...] = ()

    def __init__(self, parts: tuple[nn.Module, ...], owner: nn.Module):
        self.parts, self.owner = parts, owner

    def flatten(self, *args) -> tuple[tuple[torch.Tensor, ...], tuple]:
        """The tensors a capture takes (absent optional inputs, None, left out) and the key of which
        were present."""
        return tuple(a for a in args if a is not None), tuple(a is not None for a in args)

    def build(self, fn: Callable, key: tuple) -> Callable:
        if all(key):
            return fn

        def with_absent(*tensors):
            given = iter(tensors)
            return fn(*(next(given) if present else None for present in key))

        return with_absent

    def unflatten(self, outputs, args):
        return outputs


def _mask_tensors(mask: DocMask, region: str) -> tuple[tuple[torch.Tensor, ...], tuple]:
    if mask.backend != "sdpa":
        raise RuntimeError(
            f"model.cuda_graph_scope={region} captures the sdpa attention only (its (B,1,S,S) mask "
            f"is static); this layer got attn_backend={mask.backend!r}: set model.attn_backend=sdpa"
        )
    return ((mask.prepared,) if mask.prepared is not None else ()), (
        mask.causal,
        mask.prepared is not None,
    )


def _doc_mask(causal: bool, prepared: torch.Tensor | None) -> DocMask:
    return DocMask("sdpa", causal, [], prepared)  # sdpa reads only `prepared` / `causal`


class AttnRegion(_Region):
    kind, shared = "attn", (1, 2, 3)

    def __init__(self, layer: nn.Module):
        super().__init__((layer.input_layernorm, layer.self_attn), layer)

    def flatten(self, h_BSD, rope_cos_sin, mask):
        mask_t, key = _mask_tensors(mask, self.kind)
        return (h_BSD, *rope_cos_sin, *mask_t), key

    def build(self, eager, key):
        causal, _ = key

        def fn(h_BSD, cos, sin, *mask):
            return eager(h_BSD, (cos, sin), _doc_mask(causal, mask[0] if mask else None))

        return fn


class RouterRegion(_Region):
    kind = "moe_router"

    def __init__(self, router: nn.Module):
        super().__init__((router,), router)


class PreprocessRegion(_Region):
    kind = "moe_preprocess"

    def __init__(self, block: nn.Module):
        super().__init__((), block)


class FullLayerRegion(_Region):
    kind, shared = "full_layer", (1, 2, 3, 4)

    def __init__(self, layer: nn.Module):
        super().__init__((layer,), layer)
        self.layer = layer

    def flatten(self, h_BSD, rope_cos_sin, mask, token_mask_BS=None):
        mask_t, key = _mask_tensors(mask, self.kind)
        tm = (token_mask_BS,) if token_mask_BS is not None else ()
        return (h_BSD, *rope_cos_sin, *mask_t, *tm), (*key, token_mask_BS is not None)

    def build(self, eager, key):
        causal, has_mask, has_token_mask = key

        def fn(h_BSD, cos, sin, *rest):
            rest = list(rest)
            mask = _doc_mask(causal, rest.pop(0) if has_mask else None)
            token_mask = rest.pop(0) if has_token_mask else None
            out, stats = eager(h_BSD, (cos, sin), mask, token_mask)
            if stats is None:
                return (out,)
            # a tensor with a token mask, else T (shapes)
            n = (stats.num_tokens,) if has_token_mask else ()
            return (out, stats.prob_sum_E, stats.counts_E, *n)

        return fn

    def unflatten(self, outputs, args):
        if not self.layer.is_moe:
            return outputs[0], None
        out, prob_sum_E, counts_E, *n = outputs
        num_tokens = n[0] if n else args[0].shape[0] * args[0].shape[1]
        return out, RouterStats(prob_sum_E, counts_E, num_tokens)


class GraphedRegion(Region):
    """One region of one layer: eager off CUDA / without grad / in eval, else captured once per input
    signature and replayed.  `tensor_form=True` runs the exact function a capture would graph, eagerly
    (the CPU tests check the region boundaries with it)."""

    def __init__(self, region: _Region, graphs: "CudaGraphs", warmup: int = 3):
        super().__init__()
        self.region, self.shared, self.warmup = region, graphs.shared, warmup
        self.collection = (
            graphs  # the CudaGraphs this region belongs to (a plain object, not a submodule)
        )
        self.graphs: dict[tuple, Callable] = {}
        self.tensor_form = False

    def extra_repr(self) -> str:
        return f"{self.region.kind}, captured={len(self.graphs)}"

    def forward(self, fn: Callable, *args):
        tensors, key = self.region.flatten(*args)
        sig = (
            key,
            _autocast_state(),
            tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in tensors),
        )
        if not (tensors[0].is_cuda and torch.is_grad_enabled() and self.region.owner.training):
            if self.tensor_form:
                return self.region.unflatten(self.region.build(fn, key)(*tensors), args)
            return fn(*args)
        graphed = self.graphs.get(sig)
        if graphed is None:
            graphed = self.graphs[sig] = self._capture(fn, key, tensors)
        return self.region.unflatten(graphed(*tensors), args)

    def _capture(self, fn: Callable, key: tuple, tensors: tuple[torch.Tensor, ...]) -> Callable:
        if torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
            raise RuntimeError(
                "model.cuda_graph_scope captures under torch.autocast only with its weight cache "
                "off: use torch.autocast(..., cache_enabled=False) (the trainer does)"
            )
        sample = tuple(self._static_input(i, t) for i, t in enumerate(tensors))
        module = _Capturable(self.region.build(fn, key), self.region.parts)
        graphed = torch.cuda.make_graphed_callables(
            module, sample, num_warmup_iters=self.warmup, allow_unused_input=True
        )
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(_clone_if_adopted(p))
        return graphed

    def _static_input(self, position: int, t: torch.Tensor) -> torch.Tensor:
        """The buffer a replay copies this input into: per role for the inputs every layer shares."""
        if position in self.region.shared and not t.requires_grad:
            role = (self.region.kind, position, t.shape, t.dtype, t.device)
            if role not in self.shared:
                self.shared[role] = t.detach().clone()
            return self.shared[role]
        return t.detach().clone().requires_grad_(t.requires_grad)


def _clone_if_adopted(p: torch.Tensor):
    """A gradient hook: when `.grad` is None AccumulateGrad may adopt the graph's static buffer as `.grad`."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad.clone() if p.grad is None else grad

    return hook


def _autocast_state() -> tuple:
    enabled = torch.is_autocast_enabled("cuda")
    return (enabled, torch.get_autocast_dtype("cuda") if enabled else None)


class CudaGraphs:
    """The regions installed in one model (each `GraphedRegion` points back here: `cuda_graphs(model)`)."""

    def __init__(self, scope: tuple[str, ...]):
        self.scope = scope
        self.regions: list[GraphedRegion] = []
        self.shared: dict = {}

    def install(self, module: nn.Module, slot: str, region: _Region) -> None:
        graphed = GraphedRegion(region, self)
        module.add_module(slot, graphed)
        self.regions.append(graphed)

    def captures(self) -> dict[str, int]:
        """Graphs captured so far, per region kind (summed over layers)."""
        out: dict[str, int] = {}
        for r in self.regions:
            out[r.region.kind] = out.get(r.region.kind, 0) + len(r.graphs)
        return out

    def set_tensor_form(self, on: bool = True) -> None:
        for r in self.regions:
            r.tensor_form = on


def scope_problem(scope) -> str | None:
    unknown = [s for s in scope if s not in SCOPES]
    if unknown:
        return (
            f"model.cuda_graph_scope has unknown region(s) {unknown}; choose among {list(SCOPES)}"
        )
    if "full_layer" in scope and len(set(scope)) > 1:
        return (
            "model.cuda_graph_scope: full_layer already holds attn, moe_router and moe_preprocess; "
            "list it alone"
        )
    return None


def apply_cuda_graphs(model: nn.Module, scope) -> CudaGraphs | None:
    """Wrap the chosen regions of every decoder layer `model` holds; None for an empty scope."""
    scope = tuple(scope or ())
    if not scope:
        return None
    problem = scope_problem(scope)
    if problem is not None:
        raise ValueError(problem)
    graphs = CudaGraphs(scope)
    for layer in model.text.layers.children():
        if layer.linear_attn is not None and {"attn", "full_layer"} & set(scope):
            # a captured region rebuilds the attention mask without the documents' bounds
            raise ValueError(
                "model.cuda_graph_scope attn / full_layer cannot capture a Gated DeltaNet layer "
                "(text.layer_types linear_attention); use moe_router / moe_preprocess"
            )
        if "full_layer" in scope:
            graphs.install(layer, "region", FullLayerRegion(layer))
            continue
        if "attn" in scope:
            graphs.install(layer, "attn_region", AttnRegion(layer))
        if layer.is_moe and "moe_router" in scope:
            graphs.install(layer.mlp.router, "region", RouterRegion(layer.mlp.router))
        if layer.is_moe and "moe_preprocess" in scope:
            if not layer.mlp.dispatcher.capturable_preprocess:
                raise ValueError(
                    "model.cuda_graph_scope=moe_preprocess captures the torch permutation plan of the "
                    f"local and alltoall dispatchers ({layer.mlp.dispatcher.name} has none to capture); "
                    "use model.permute=torch, or leave moe_preprocess out"
                )
            graphs.install(layer.mlp.dispatcher, "preprocess_region", PreprocessRegion(layer.mlp))
    return graphs


def cuda_graphs(model: nn.Module) -> CudaGraphs | None:
    """The CudaGraphs whose regions `model` holds, or None."""
    return next((m.collection for m in model.modules() if isinstance(m, GraphedRegion)), None)


__all__ = [
    "SCOPES",
    "CudaGraphs",
    "GraphedRegion",
    "apply_cuda_graphs",
    "cuda_graphs",
    "scope_problem",
]
