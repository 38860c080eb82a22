"""FP8 training of the decoder's projections and the expert GEMMs: the resolved recipe (`Fp8Recipe`),
the per-step cache of weight codes, and the autograd rule over moevlm.kernels' quantizers and GEMMs.

Legend: M rows (tokens, or expert-grouped rows), K in-features, N out-features, E experts, B the
recipe's scale block (128 blockwise, 32 MXFP8).  Suffix q: e4m3 codes, s: their scales.

    recipe = resolve_fp8(cfg.fp8, device)          # None when cfg.fp8.recipe == "none"
    install_weight_cache(optimizer)              # weights quantized once per optimizer step
    y_MN = fp8_mm(x_MK, w_EKN, counts_E, recipe, owner)     # or w_KN with counts_E None
    y_MN = expert_mm(x_MK, w_EKN, counts_E, backend, recipe, owner)   # grouped_mm when recipe is None
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from moevlm.kernels import grouped_mm
from moevlm.kernels.fp8_gemm_ref import BLOCK
from moevlm.kernels.fp8_gemm_torch import scaled_mm_support
from moevlm.model.autocast import compute_dtype


class Fp8Unavailable(RuntimeError):
    """The FP8 recipe cannot run as asked on this device; the message names the fix."""


@dataclass(frozen=True)
class Fp8Recipe:
    recipe: str  # blockwise | mxfp8
    dense: str  # GEMM backend of the projections: triton | torch | emulate
    grouped: str  # GEMM backend of the experts
    quant: str  # quantizer backend: triton | torch
    pow2_scales: bool = False  # blockwise: scales rounded up to powers of two
    cache_weights: bool = True
    pad_experts: bool = False  # expert rows padded to the block by the local dispatcher

    @property
    def block(self) -> int:
        return BLOCK[self.recipe]

    def describe(self) -> str:
        return (
            f"fp8 {self.recipe}: projections {self.dense}, experts {self.grouped}, quantizers {self.quant}"
            f"{', pow2 scales' if self.pow2_scales else ''}, weights cached per step: {self.cache_weights}"
        )


# ------------------------------------------------------------------ resolution
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _fp8_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _triton_ok(device: torch.device) -> str | None:
    """None when our Triton FP8 kernels can run on `device`, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install triton)"
    if device.type == "cuda":
        return (
            None
            if _fp8_cores(device)
            else (
                f"{torch.cuda.get_device_name(device)} has no FP8 tensor cores "
                "(sm89+: Ada, Hopper, Blackwell)"
            )
        )
    return (
        None
        if _interpreting()
        else "on the CPU the Triton kernels run only under TRITON_INTERPRET=1"
    )


def _probe(device: torch.device) -> dict[str, bool]:
    if importlib.util.find_spec("triton") is None:
        return {}
    return scaled_mm_support(device) if device.type == "cuda" else {}


def resolve_fp8(cfg, device) -> Fp8Recipe | None:
    """The recipe for `cfg` (`model.fp8*` fields as `Fp8Config`) on `device`, or Fp8Unavailable naming the fix."""
    if cfg.recipe == "none":
        return None
    device = torch.device(device)
    where = str(device) if device.type != "cuda" else torch.cuda.get_device_name(device)
    quant = "triton" if device.type == "cuda" or _interpreting() else "torch"
    opts = dict(
        pow2_scales=cfg.pow2_scales, cache_weights=cfg.cache_weights, pad_experts=cfg.pad_experts
    )
    if cfg.backend == "emulate":
        if importlib.util.find_spec("triton") is None:
            raise Fp8Unavailable(
                "model.fp8_backend=emulate uses moevlm.kernels.fp8_gemm, which imports triton: "
                "pip install triton"
            )
        return Fp8Recipe(cfg.recipe, "emulate", "emulate", "torch", **opts)
    if cfg.backend == "triton" or (cfg.backend == "auto" and cfg.recipe == "blockwise"):
        if cfg.recipe != "blockwise":
            raise Fp8Unavailable(
                "model.fp8_backend=triton runs the blockwise recipe only; for model.fp8=mxfp8 use "
                "model.fp8_backend=torch (Blackwell) or emulate"
            )
        why = _triton_ok(device)
        if why:
            raise Fp8Unavailable(
                f"model.fp8=blockwise with model.fp8_backend={cfg.backend} cannot run on {where}: "
                f"{why}; set model.fp8_backend=emulate to train with the recipe's numerics "
                "(slow), or model.fp8=none"
            )
        return Fp8Recipe("blockwise", "triton", "triton", "triton", **opts)
    need = (
        ("scaled_mm_blockwise",)
        if cfg.recipe == "blockwise"
        else ("scaled_mm_mxfp8", "scaled_grouped_mm_mxfp8")
    )
    found = _probe(device)
    missing = [k for k in need if not found.get(k)]
    if missing:
        hint = (
            "model.fp8=blockwise (Hopper) or model.fp8_backend=emulate"
            if cfg.recipe == "mxfp8"
            else "model.fp8_backend=triton or emulate"
        )
        raise Fp8Unavailable(
            f"model.fp8={cfg.recipe} with model.fp8_backend={cfg.backend} needs torch's "
            f"{', '.join(missing)} on {where}, which the probe did not find "
            f"({'the CPU has none' if device.type != 'cuda' else 'refused or disagreed'}); "
            f"use {hint}"
        )
    opts["pad_experts"] = True  # torch's grouped FP8 paths need whole scale blocks per expert
    return Fp8Recipe(cfg.recipe, "torch", "torch", quant, **opts)


# ------------------------------------------------------------- weight cache
_generation = 0  # bumped whenever weights change; cached codes of an older generation are stale
_hooked = False  # an optimizer bumps it after each step: only then may codes be cached


def weights_changed() -> None:
    """Every cached weight code is stale (the optimizer stepped, or weights were loaded)."""
    global _generation
    _generation += 1


def install_weight_cache(optimizer: torch.optim.Optimizer) -> None:
    """Cache weight codes for one optimizer step: each step of `optimizer` starts a new generation."""
    global _hooked
    weights_changed()
    optimizer.register_step_post_hook(lambda *_: weights_changed())
    _hooked = True


def _cache_on(recipe: Fp8Recipe) -> bool:
    return recipe.cache_weights and _hooked


def _weight_codes(owner, w, recipe: Fp8Recipe, grouped: bool):
    """((codes, scales) for the forward, (codes, scales) for the input gradient) of w (K, N) or (E, K, N).
    `owner`: the module holding w, or (module, name) when it holds several; None caches nothing."""
    module, name = owner if isinstance(owner, tuple) else (owner, "weight")
    cache = (
        module.__dict__.setdefault("_fp8_weight", {})
        if module is not None and _cache_on(recipe)
        else None
    )
    key = (_generation, tuple(w.shape), w.dtype, w.device, recipe)
    if cache is not None and name in cache and cache[name][0] == key:
        return cache[name][1]
    codes = _quant_weight(w, recipe, grouped)
    if cache is not None:
        cache[name] = (key, codes)
    return codes


# ---------------------------------------------------------------- quantizers
def _q():
    from moevlm.kernels import fp8_quant

    return fp8_quant


def _quant_act(x_MK, recipe):
    """1xB along the last dim: (codes (M, K), scales (M, K/B))."""
    if recipe.recipe == "mxfp8":
        return _q().quant_mxfp8(x_MK, dim=-1, backend=recipe.quant)
    return _q().quant_blockwise_act(x_MK, pow2_scales=recipe.pow2_scales, backend=recipe.quant)


def _quant_act_t(x_MK, recipe):
    """x^T 1xB along M: (codes (K, M), scales (K, M/B))."""
    if recipe.recipe == "mxfp8":
        codes, scales = _q().quant_mxfp8(x_MK, dim=0, backend=recipe.quant)
        return codes.t(), scales.t()
    return _q().quant_blockwise_act_t(x_MK, pow2_scales=recipe.pow2_scales, backend=recipe.quant)


def _quant_weight(w, recipe, grouped):
    if recipe.recipe == "blockwise":
        q = _q().quant_blockwise_weight(w, pow2_scales=recipe.pow2_scales, backend=recipe.quant)
        return q, q  # 128x128: the same codes serve w and w^T
    along_k = w.transpose(-2, -1)  # (.., N, K): 1x32 along K
    cq, cs = _q().quant_mxfp8(along_k, dim=-1, backend=recipe.quant)
    return (cq.transpose(-2, -1), cs.transpose(-2, -1)), _q().quant_mxfp8(
        w, dim=-1, backend=recipe.quant
    )


# ------------------------------------------------------------------ autograd
def _gemm():
    from moevlm.kernels import fp8_gemm

    return fp8_gemm


class _Fp8Mm(torch.autograd.Function):
    """out_MN = x_MK @ w (w (K, N), or (E, K, N) with counts_E), every GEMM in FP8."""

    @staticmethod
    def forward(ctx, x_MK, w, counts_E, recipe: Fp8Recipe, owner, out_dtype):
        grouped = counts_E is not None
        (wq, ws), w_dgrad = _weight_codes(owner, w, recipe, grouped)
        xq, xs = _quant_act(x_MK, recipe)
        g, backend = _gemm(), recipe.grouped if grouped else recipe.dense
        kw = dict(recipe=recipe.recipe, backend=backend, out_dtype=out_dtype)
        out = (
            g.fp8_grouped_mm(xq, xs, wq, ws, counts_E, **kw)
            if grouped
            else g.fp8_linear(xq, xs, wq, ws, **kw)
        )
        x_t = _quant_act_t(x_MK, recipe) if ctx.needs_input_grad[1] else (None, None)
        ctx.save_for_backward(*x_t, *w_dgrad, counts_E)
        ctx.recipe, ctx.grouped, ctx.w_dtype, ctx.x_dtype = recipe, grouped, w.dtype, x_MK.dtype
        return out

    @staticmethod
    def backward(ctx, dy_MN):
        xtq, xts, wq, ws, counts_E = ctx.saved_tensors
        recipe, g = ctx.recipe, _gemm()
        kw = dict(recipe=recipe.recipe, backend=recipe.grouped if ctx.grouped else recipe.dense)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dyq, dys = _quant_act(dy_MN, recipe)
            dx = (
                g.fp8_grouped_dgrad(dyq, dys, wq, ws, counts_E, out_dtype=ctx.x_dtype, **kw)
                if ctx.grouped
                else g.fp8_linear_dgrad(dyq, dys, wq, ws, out_dtype=ctx.x_dtype, **kw)
            )
        if ctx.needs_input_grad[1]:
            dytq, dyts = _quant_act_t(dy_MN, recipe)
            dw = (
                g.fp8_grouped_wgrad(xtq, xts, dytq, dyts, counts_E, out_dtype=torch.float32, **kw)
                if ctx.grouped
                else g.fp8_linear_wgrad(xtq, xts, dytq, dyts, out_dtype=torch.float32, **kw)
            )
            dw = dw.to(ctx.w_dtype)
        return dx, dw, None, None, None, None


def fp8_mm(x_MK, w, counts_E, recipe: Fp8Recipe, owner=None):
    """x_MK @ w[e] per expert (counts_E given, w (E, K, N)) or x_MK @ w (w (K, N)), in FP8."""
    dtype = compute_dtype(x_MK.device.type, x_MK.dtype)
    with torch.autocast(x_MK.device.type, enabled=False):
        return _Fp8Mm.apply(x_MK.to(dtype), w, counts_E, recipe, owner, dtype)


def fp8_linear(x, weight_NK, bias, recipe: Fp8Recipe, owner=None):
    """F.linear(x, weight, bias) with the GEMMs in FP8 (the bias is added in the output dtype)."""
    out = fp8_mm(x.reshape(-1, x.shape[-1]), weight_NK.t(), None, recipe, owner)
    out = out.view(*x.shape[:-1], weight_NK.shape[0])
    return out if bias is None else out + bias.to(out.dtype)


def expert_mm(x_MK, w_EKN, counts_E, backend: str, recipe: Fp8Recipe | None, owner=None):
    """The experts' grouped GEMM: FP8 when a recipe is given, else `moevlm.kernels.grouped_mm(backend)`."""
    if recipe is None:
        return grouped_mm(x_MK, w_EKN, counts_E, backend)
    return fp8_mm(x_MK, w_EKN, counts_E, recipe, owner)
