"""Per-block `torch.compile` (`train.compile=true`) and the dynamo counters that show it does not
recompile.

Legend: M dispatched expert rows (data dependent under expert parallel).

    apply_compile(model)           # in build_model: after recompute, before FSDP/DDP
    counters = CompileCounters()   # before step 1; counters.warm() after it
    counters.record()              # {"compiled_graphs", "graph_breaks", "recompiles": stays 0}

Each `VisionBlock` and `DecoderLayer` is compiled in place (`nn.Module.compile`), with
`fullgraph=True` where the block has no graph break; the loss, the LM head, the embedding and the
mask preparation stay eager.  Why: docs/architecture.md.
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


def use_static_masks(model: nn.Module) -> None:
    """Masks built from fixed-size device tensors only (no host bounds): what compiled blocks and a
    captured step (moevlm.train.step_graph) need."""
    for m in model.modules():
        if isinstance(m, (TextDecoder, VisionEncoder)):
            m.static_mask = True


def apply_compile(model: nn.Module, *, mode: str | None = None, bf16: bool = True) -> nn.Module:
    """Compile every vision block and decoder layer of `model` in place (why: docs/architecture.md).
    `bf16`: the experts compute in bf16 (autocast); otherwise the `torch` grouped GEMM stays eager."""
    torch._dynamo.config.recompile_limit = max(
        torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT
    )
    backend = model.config.attn_backend
    use_static_masks(model)
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
