"""LoRA adapters (`model.lora_rank` > 0): a low-rank update beside each targeted linear and each
expert's grouped GEMMs, merging into the base weights, and export in PEFT's format.

Legend: r rank, E experts, D hidden, F expert hidden, M dispatched rows.

    model = Qwen3VLMoe(cfg)                # cfg.lora.rank > 0: the model attaches adapters, base frozen
    merge_lora(model)                      # W += (alpha/r) B A, adapters removed
    save_peft_adapter(model, out_dir)      # adapter_config.json + adapter_model.safetensors

A linear's pair is PEFT's, A (r, in), B (out, r): y = W x + (alpha/r) B A dropout(x). Experts stack
one pair per expert for their grouped GEMM: gate_up_A (E, D, r), gate_up_B (E, r, 2F), down_A
(E, F, r), down_B (E, r, D). A starts Kaiming-uniform, B at zero."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from moevlm.model.config import LoraConfig
from moevlm.model.fp8 import expert_mm
from moevlm.model.fp8_targets import fp8_targets
from moevlm.model.linear import Linear, is_adapter
from moevlm.model.moe import Experts, Router
from moevlm.model.strategies import local

__all__ = ["ExpertLora", "LoraAdapter", "attach_lora", "lora_init_rules", "merge_lora"]
__all__ += ["merged_weight", "peft_tensors", "save_peft_adapter", "write_peft_adapter"]


class LoraAdapter(nn.Module):
    """The low-rank update of one linear (in -> out)."""

    def __init__(self, d_in: int, d_out: int, rank: int, scale: float, dropout: float):
        super().__init__()
        self.scale, self.dropout = scale, nn.Dropout(dropout) if dropout else nn.Identity()
        self.A = nn.Parameter(torch.empty(rank, d_in))
        self.B = nn.Parameter(torch.empty(d_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """On this rank's shards (tensor parallel: B's rows by a column-parallel base, A's columns by a
        row-parallel one)."""
        return F.linear(F.linear(self.dropout(x), local(self.A)), local(self.B)) * self.scale


class ExpertLora(nn.Module):
    """Each routed expert's low-rank updates, run by the experts' grouped GEMM on the permuted rows."""

    def __init__(self, experts: Experts, rank: int, scale: float, dropout: float):
        super().__init__()
        E, D, F2 = experts.gate_up_proj.shape
        self.scale, self.dropout = scale, nn.Dropout(dropout) if dropout else nn.Identity()
        self.gate_up_A = nn.Parameter(torch.empty(E, D, rank))
        self.gate_up_B = nn.Parameter(torch.empty(E, rank, F2))
        self.down_A = nn.Parameter(torch.empty(E, F2 // 2, rank))
        self.down_B = nn.Parameter(torch.empty(E, rank, D))

    def update(self, which: str, x_MK: torch.Tensor, counts_E, backend: str) -> torch.Tensor:
        """(alpha/r) x B_e A_e for each row's expert e, `which` gate_up or down: two grouped GEMMs."""
        A = local(getattr(self, which + "_A"))  # this rank's experts (and etp shard)
        B = local(getattr(self, which + "_B"))
        h_Mr = expert_mm(self.dropout(x_MK), A, counts_E, backend, None)
        return expert_mm(h_Mr, B, counts_E, backend, None) * self.scale


def attach_lora(model: nn.Module, cfg: LoraConfig) -> int:
    """Adapters on the linears and experts `cfg.modules` names; every base parameter frozen except the
    routers with `cfg.router` trained. Returns how many modules got adapters."""
    scale = cfg.scale
    model.requires_grad_(False)
    targets = fp8_targets(model, cfg.modules)
    for m in targets:
        if isinstance(m, Experts):
            m.lora = ExpertLora(m, cfg.rank, scale, cfg.dropout)
        else:
            m.lora = LoraAdapter(m.in_features, m.out_features, cfg.rank, scale, cfg.dropout)
    if cfg.router == "trained":
        for m in model.modules():
            if isinstance(m, Router):
                m.weight.requires_grad_(True)
    return len(targets)


def lora_init_rules(model: nn.Module, prefix: str = "") -> dict[str, tuple[str, float]]:
    """Init rules (moevlm.model.vlm.fill_ kinds) of every adapter: A uniform in +-1/sqrt(in) (PEFT's
    Kaiming-uniform with a = sqrt(5)), B zeros, so a fresh adapter changes nothing."""
    rules = {}
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if not is_adapter(name):
            continue
        if leaf.endswith("B"):
            rules[prefix + name] = ("zeros", 0.0)
        else:
            fan_in = p.shape[-1] if p.ndim == 2 else p.shape[1]
            rules[prefix + name] = ("uniform", 1.0 / math.sqrt(fan_in))
    return rules


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Folds every adapter into its base weight (`merged_weight`) and removes it; returns how many were
    merged."""
    n = 0
    for name, m in list(model.named_modules()):
        if m._modules.get("lora") is None or not isinstance(m, (Linear, Experts)):
            continue
        for leaf in ("weight",) if isinstance(m, Linear) else ("gate_up_proj", "down_proj"):
            w = getattr(m, leaf)
            w.copy_(merged_weight(model, f"{name}.{leaf}", w))
        m.lora, n = None, n + 1
    return n


PEFT_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")  # ParamWrapper order: gate_up inner


@torch.no_grad()
def save_peft_adapter(model: nn.Module, out_dir: str | Path) -> Path:
    """The adapters as PEFT's LoRA folder, named as transformers' Qwen3VLMoe- or
    Qwen3_5MoeForConditionalGeneration names its modules (a Gated DeltaNet in_proj_qkv's B in the
    reference's [q | k | v] row order). Expert adapters take PEFT's `target_parameters` form on the
    fused 3-D weights (transformers' (E, out, in)): lora_A (E r, in) with expert e's rows e r .. e r +
    r - 1, lora_B (out, r E) with expert e's column j at j E + e; the down_proj wrapper outside the
    gate_up one. A model laid out over ranks writes through moevlm.parallel.hf_io.save_adapter."""
    return write_peft_adapter(model.config, *peft_tensors(model), out_dir)


def write_peft_adapter(cfg, tensors: dict, modules: list[str], out_dir: str | Path) -> Path:
    """adapter_model.safetensors and adapter_config.json of `peft_tensors`' output."""
    experts = any(".base_layer." in k for k in tensors)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().float().contiguous().cpu() for k, v in tensors.items()},
        out / "adapter_model.safetensors",
        metadata={"format": "pt"},
    )
    (out / "adapter_config.json").write_text(
        json.dumps(_peft_config(cfg, modules, experts), indent=2)
    )
    return out


def _whole(name: str, t: torch.Tensor) -> torch.Tensor:
    return t


@torch.no_grad()
def peft_tensors(model: nn.Module, full=_whole) -> tuple[dict[str, torch.Tensor], list[str]]:
    """PEFT's saved tensors by name, and the names of the linears with adapters (transformers').
    `full(name, tensor)`: an adapter parameter's whole value (a gather under a layout)."""
    from moevlm.model.hf import BY_KEY_HEAD, key_head_order, ours_to_hf

    tensors, modules = {}, []
    for name, m in model.named_modules():
        lora = m._modules.get("lora")
        if lora is None or not isinstance(m, (Linear, Experts)):
            continue
        hf = ours_to_hf(name + ".weight")[: -len(".weight")]
        key = "base_model.model." + hf
        whole = _wholes(name, lora, full)
        if isinstance(m, Linear):
            modules.append(hf)
            B = whole("B")
            # a Gated DeltaNet's in_proj_qkv: B's rows in the reference's [q | k | v] order
            if (name + ".weight").endswith(BY_KEY_HEAD):
                B = B[key_head_order(model.config).argsort().to(B.device)]
            tensors[key + ".lora_A.weight"], tensors[key + ".lora_B.weight"] = whole("A"), B
            continue
        for which, prefix in (("gate_up", key + ".base_layer"), ("down", key)):
            A, B = whole(which + "_A"), whole(which + "_B")  # (E, in, r), (E, r, out)
            E, d_in, r = A.shape
            tensors[prefix + ".lora_A.weight"] = A.transpose(1, 2).reshape(E * r, d_in)
            tensors[prefix + ".lora_B.weight"] = B.permute(2, 1, 0).reshape(B.shape[2], r * E)
    return tensors, modules


def _wholes(owner: str, lora: nn.Module, full):
    """leaf -> the whole value of adapter parameter `owner`.lora.`leaf`."""
    return lambda leaf: full(f"{owner}.lora.{leaf}", getattr(lora, leaf).detach())


@torch.no_grad()
def merged_weight(model: nn.Module, name: str, weight: torch.Tensor, full=_whole) -> torch.Tensor:
    """`weight`, the whole value of parameter `name`, plus its adapter's update (W + (alpha/r) B A;
    experts (E, in, out) + (alpha/r) A_e B_e) when it has one: what `merge_lora` writes, from whole
    values (`full` as in `peft_tensors`), the model unchanged."""
    owner, leaf = name.rsplit(".", 1)
    m = model.get_submodule(owner)
    lora = m._modules.get("lora")
    if lora is None:
        return weight
    whole = _wholes(owner, lora, full)
    if isinstance(m, Linear) and leaf == "weight":
        delta = whole("B") @ whole("A")
    elif isinstance(m, Experts) and leaf in ("gate_up_proj", "down_proj"):
        which = leaf[: -len("_proj")]
        delta = whole(which + "_A") @ whole(which + "_B")
    else:
        return weight
    return weight + (lora.scale * delta).to(weight.dtype)


def _peft_config(cfg, modules: list[str], experts: bool) -> dict:
    """adapter_config.json: target_modules a regex of the exact module names."""
    lo = cfg.lora
    target = "^(" + "|".join(re.escape(n) for n in modules) + ")$" if modules else None
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": None,
        "r": lo.rank,
        "lora_alpha": lo.alpha_value,
        # PEFT refuses dropout on fused expert weights; dropout acts in training only
        "lora_dropout": 0.0 if experts else lo.dropout,
        "target_modules": target,
        "target_parameters": list(PEFT_EXPERTS) if experts else None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
