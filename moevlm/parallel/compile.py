"""Per-block `torch.compile` (`train.compile=true`) and the dynamo counters that prove it
does not recompile.

Legend: M dispatched expert rows (data dependent under expert parallel).

    apply_compile(model)                          # in parallelize: after recompute, before FSDP/DDP
    before = compile_counters()
    ...step 1 (every block compiles here)...
    after_step1 = compile_counters()
    ...steps 2..N...
    recompiles = compile_counters()["frames"] - after_step1["frames"]     # must stay 0

Design choices:
- Each `VisionBlock` and each `DecoderLayer` is compiled in place with
  `nn.Module.compile` (torchtitan's per-block granularity): the module keeps its
  class and its parameters' names (no `_orig_mod.` in state dicts, checkpoints
  or the HF export); FSDP wraps the compiled blocks afterwards (torchtitan's
  order: parallelisms -> recompute -> compile -> FSDP).  The loss, the LM head,
  the embedding and the mask preparation stay eager.
- Shapes are static by construction (the packer's fixed budgets), so blocks are
  compiled with `dynamic=None` and must never recompile after step 1.  What the
  blocks see is made shape-static: the document mask is prepared outside the
  blocks and, under compile, holds only tensors of a fixed size (`static_mask`:
  flash/varlen get cu_seqlens merged with the row ends, length fixed by the
  packer, and max_seqlen = S; no host list, no varying int); the router
  statistics count with a fixed-size `scatter_add_` (no `bincount`).
- All blocks of a kind share one code object (`forward`); dynamo keeps one
  cache entry per distinct variant (MoE vs dense layer, each dispatcher), not
  per instance, so the recompile limit is never reached by the layer count; we
  still raise `recompile_limit` to cover the variants with margin.
- `fullgraph=True` where the block has no graph break: vision blocks, dense
  layers, MoE layers with the local dispatcher (sync-free, static-shaped; the
  Triton grouped GEMM and permute are custom ops with fakes).  Not where a
  break is inherent: `attn_backend=flash` (a third-party function), the `loop`
  grouped GEMM (`.tolist()` of the counts), and the all-to-all exchange.
- `torch._grouped_mm`'s fake (meta) function accepts bf16 only (torch 2.13),
  while its CPU kernel also runs fp32: in fp32 runs (the CPU) the `torch`
  grouped GEMM of each MoE layer runs eagerly (`torch.compiler.disable`, one
  graph break per layer, no recompile: its shapes are static; the experts' flag
  `compile_eager_gemm`); in bf16 it is in the graph.
- Recompute regions (moevlm/parallel/recompute.py, applied before compile) are
  traced into the compiled block (checkpoint becomes a higher-order op); a graph
  break inside a region (the fp32 grouped-GEMM seam above) makes dynamo run the
  whole region eagerly, so fp32 MoE layers under `model.recompute=full` or
  `moe` are not compiled on the CPU (`compiled_graphs` in metrics.jsonl shows
  it); in bf16 they are.
- The all-to-all exchange (a host sync for the split sizes, data-dependent row
  counts) runs outside the graph: the MoE block's experts runner calls the
  `dispatch`/`combine` of a dispatcher whose `exchanges` is true through
  `torch.compiler.disable`d functions (moevlm.model.layout; one graph break each,
  counted), and the dispatched rows are marked dynamic on their row dimension before
  they re-enter the graph, so the first compile is already shape-generic in M and
  varying row counts never recompile.
- Counters come from `torch._dynamo.utils.counters` (same keys in torch 2.11
  and 2.13): `frames` = frames dynamo converted (`frames.total`: after warm-up
  every one is a recompile: a cache miss of a frame seen before), `graphs` =
  `stats.unique_graphs`, `graph_breaks` = the sum of `graph_break` reasons.
"""

from __future__ import annotations


import torch
import torch.nn as nn

from moevlm.model.decoder import DecoderLayer, TextDecoder
from moevlm.model.moe import MoEBlock
from moevlm.model.vision import VisionBlock, VisionEncoder

RECOMPILE_LIMIT = (
    64  # per code object: variants (MoE/dense, dispatcher), not layers; the default is 8
)


def apply_compile(model: nn.Module, *, mode: str | None = None, bf16: bool = True) -> nn.Module:
    """Compile every vision block and decoder layer of `model` in place (see the module docstring).
    `bf16`: the experts compute in bf16 (autocast); otherwise the `torch` grouped GEMM stays eager."""
    torch._dynamo.config.recompile_limit = max(
        torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT
    )
    backend = model.config.attn_backend
    for m in model.modules():
        if isinstance(m, (TextDecoder, VisionEncoder)):
            m.static_mask = True
    for m in list(model.modules()):
        if isinstance(m, VisionBlock):
            m.compile(fullgraph=backend != "flash", mode=mode)
        elif isinstance(m, DecoderLayer):
            eager_gemm = m.is_moe and m.mlp.experts.grouped_gemm == "torch" and not bf16
            m.compile(fullgraph=_layer_fullgraph(m, backend) and not eager_gemm, mode=mode)
            if eager_gemm:
                m.mlp.experts.compile_eager_gemm = True
    return model


def _layer_fullgraph(layer: DecoderLayer, backend: str) -> bool:
    if backend == "flash":
        return False
    if not layer.is_moe:
        return True
    moe: MoEBlock = layer.mlp
    return moe.experts.grouped_gemm != "loop" and not moe.dispatcher.exchanges


# ----------------------------------------------------------------- counters
def compile_counters() -> dict[str, int]:
    """Process-wide dynamo counters (monotonic): frames converted, graphs compiled, graph breaks."""
    from torch._dynamo.utils import counters

    return {
        "frames": int(counters["frames"]["total"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


class CompileCounters:
    """The counters since this object was made, and the recompiles since `warm()` (the end of step 1)."""

    def __init__(self):
        self.start, self.warm_at = compile_counters(), None

    def warm(self) -> None:
        self.warm_at = compile_counters()

    def record(self) -> dict[str, int]:
        now = compile_counters()
        warm = self.warm_at or now
        return {
            "compiled_graphs": now["graphs"] - self.start["graphs"],
            "graph_breaks": now["graph_breaks"] - self.start["graph_breaks"],
            "recompiles": now["frames"] - warm["frames"],
        }
