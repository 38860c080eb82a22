"""Which modules of a built model compute in FP8: the targets each `model.fp8_modules` entry names,
and the marking that hands them the resolved FP8 recipe (an `Fp8Recipe`).

    n = apply_fp8(model, recipe, ("experts", "attn"))   # in build_model; None unmarks all

The router, norms, embeddings, LM head, the vision patch embedding, the shared expert's gate and a
Gated DeltaNet layer's per-head gate projections (in_proj_a, in_proj_b) are never marked.
"""

from __future__ import annotations

import torch.nn as nn

from moevlm.model.config import check_fp8_modules
from moevlm.model.decoder import TextAttention
from moevlm.model.fp8 import Fp8Recipe
from moevlm.model.gated_deltanet import GatedDeltaNet
from moevlm.model.linear import Linear
from moevlm.model.moe import DenseMLP, Experts, MoEBlock, Router
from moevlm.model.vision import PatchMerger, VisionBlock

__all__ = ["apply_fp8", "fp8_targets"]

_KINDS = {
    "experts": (Experts,),
    "attn": (TextAttention, GatedDeltaNet),
    "mlp": (DenseMLP,),
    "vision": (VisionBlock, PatchMerger),
}


def fp8_targets(model: nn.Module, modules) -> list[nn.Module]:
    """The modules `model.fp8_modules` names: experts (the grouped GEMMs), attn (q/k/v/o of every decoder
    layer; a Gated DeltaNet layer's in_proj_qkv, in_proj_z and out_proj), mlp (dense SwiGLU layers of the
    decoder and the shared expert), vision (vision blocks and mergers; not the patch embedding)."""
    check_fp8_modules(modules)  # a ConfigError (ValueError) naming the allowed ones
    chosen = tuple(k for name in modules for k in _KINDS[name])
    out = []
    for m in model.modules():
        if isinstance(m, Experts) and isinstance(m, chosen):
            out.append(m)
        elif isinstance(m, GatedDeltaNet) and isinstance(m, chosen):
            out += [
                m.in_proj_qkv,
                m.in_proj_z,
                m.out_proj,
            ]  # its per-head gates stay in full precision
        elif isinstance(m, chosen):
            out += [lin for lin in m.modules() if isinstance(lin, Linear)]
    assert not any(isinstance(m, Router) for m in out)
    return out


def apply_fp8(model: nn.Module, recipe: Fp8Recipe | None, modules) -> int:
    """Marks the chosen modules with `recipe` (None: unmarks every one); returns how many were marked."""
    targets = fp8_targets(model, modules) if recipe is not None else []
    for m in model.modules():
        if "fp8" in m.__dict__:
            del m.fp8
        m.__dict__.pop("_fp8_weight", None)
        if isinstance(m, MoEBlock) and m.dispatcher.pads_experts:
            pad = recipe is not None and recipe.pad_experts and "experts" in modules
            m.dispatcher.pad_multiple = recipe.block if pad else 1
    for m in targets:
        m.fp8 = recipe
    return len(targets)
