"""The memory check: a job whose model state (weights, gradients, AdamW state) cannot fit one rank
is refused before the model is built, even on meta.

    est = check_memory(plan, *memory_limit(device))     # ConfigError when it cannot fit
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moevlm.errors import check
from moevlm.model.config import VLMConfig
from moevlm.model.params import layers_parameters, parameter_counts
from moevlm.parallel.mesh import ParallelDims
from moevlm.parallel.master_weights import model_state_bytes
from moevlm.parallel.optimizer_offload import offload_kind

if TYPE_CHECKING:
    from moevlm.config.job_plan import JobPlan

BYTES_TRAINED = 16  # fp32 master weight 4 + fp32 gradient 4 (FSDP reduces in fp32) + AdamW exp_avg, exp_avg_sq 8
BYTES_FROZEN = 4  # a frozen weight: no gradient, no optimizer state
MEMORY_NOTE = 0.8  # above this share of the limit, a note: activations need the rest
# how each part of a decoder layer is sharded (see _divisors)
_LAYER_SHARDING = {
    "q_o": "tp",
    "k_v": "kv",
    "norms": "whole",
    "linear_attn": "tp",  # GDN: every projection, the conv and the per-head gates by heads
    "router": "whole",
    "experts": "experts",
    "dense_mlp": "tp",
}


@dataclass
class MemoryEstimate:
    """Weights, gradients and optimizer state on the fullest rank (activations not included)."""

    params: float  # parameters held by that rank (a shard counts its fraction)
    bytes: float
    total_params: int  # the whole model's
    offloaded: bool = False  # parallel.optimizer_offload took what lives on the host off `bytes`

    def describe(self, layout: str = "") -> str:
        what = (
            "what stays on the device of weights, gradients and AdamW state (parallel.optimizer_offload)"
            if self.offloaded
            else "weights, gradients and AdamW state"
        )
        return (
            f"{self.bytes / 2**30:.1f} GiB per rank for {what} "
            f"({self.params / 1e9:.3g}B of the model's {self.total_params / 1e9:.3g}B parameters"
            + (f"; {layout})" if layout else ")")
        )


def _bytes_per_parameter(plan: JobPlan, device_type: str) -> tuple[int, int]:
    """(trained, frozen) bytes a parameter keeps on the device (module docstring; optim.master_weights
    and optim.state_dtype: moevlm.parallel.master_weights.model_state_bytes)."""
    b = plan.build
    kind = offload_kind(b.optimizer_offload, plan.dims.world, b.dp_mode)
    if kind is None or device_type == "cpu":
        return model_state_bytes(b.master_weights, plan.job.optim.state_dtype)
    if kind == "fsdp":
        return 0, 0
    return BYTES_TRAINED - 8, BYTES_FROZEN


def estimate_memory(plan: JobPlan, device_type: str = "cpu") -> MemoryEstimate:
    """Per-rank bytes of parameters, gradients and AdamW state, from the config and the layout alone
    (nothing is built).  Each part is divided by its sharding (`_divisors`); under pipeline stages
    each pp rank holds its stages' layers, the first stage the vision tower and embedding, the last
    the final norm and LM head, and the fullest pp rank counts.  Not counted: activations, FSDP's
    transient all-gathered units, DDP's reduction buckets, uneven shard padding."""
    cfg, pipe = plan.model, plan.pipeline
    div = _divisors(plan.build.dp_mode, plan.dims, cfg)
    whole = parameter_counts(cfg)
    trained_bytes, frozen = _bytes_per_parameter(plan, device_type)
    frozen_bytes = frozen if plan.job.model.freeze_vision else trained_bytes
    offloaded = device_type != "cpu" and (
        offload_kind(plan.build.optimizer_offload, plan.dims.world, plan.build.dp_mode) is not None
    )
    best = MemoryEstimate(0, 0, sum(whole.values()), offloaded)
    for r in range(pipe.pp) if pipe else [0]:
        stages = pipe.stages_of(r) if pipe else [0]
        last = pipe.num_stages - 1 if pipe else 0
        trained = 0.0
        for s in stages:
            layers = layers_parameters(cfg, pipe.layer_range(s) if pipe else None)
            trained += sum(n / div[_LAYER_SHARDING[k]] for k, n in layers.items())
        vision = whole["vision"] / div["vision"] if 0 in stages else 0.0
        if 0 in stages:
            trained += whole["embed_tokens"] / div["tp"]  # vocab-parallel
        if last in stages:
            trained += whole["norm"] / div["whole"] + whole["lm_head"] / div["tp"]
        est = MemoryEstimate(
            trained + vision,
            trained * trained_bytes + vision * frozen_bytes,
            best.total_params,
            offloaded,
        )
        best = max(best, est, key=lambda e: e.bytes)
    return best


def _divisors(dp_mode: str, dims: ParallelDims, cfg: VLMConfig) -> dict[str, int]:
    """Over how many ranks of a pipeline stage each kind of weight is split.  FSDP shards the dense
    weights over dp x cp (after TP's split) and the experts over edp (after EP's and ETP's); DDP keeps
    them whole per rank.  TP splits attention q/o, the dense MLP, the embedding and the LM head, and
    k/v when there are at least tp kv heads; norms and the router stay whole per tp rank.  The vision
    tower is not tensor parallel; FSDP shards it over dp x cp x tp.  HSDP (parallel.dp_replicate = R)
    shards within a replica only: over dp/R instead of dp, edp/R instead of edp."""
    shard = dims.dp_shard * dims.cp if dp_mode == "fsdp" else 1
    return {
        "tp": dims.tp * shard,
        "kv": (dims.tp if cfg.text.num_kv_heads >= dims.tp else 1) * shard,
        "whole": shard,
        "vision": dims.tp * shard if dp_mode == "fsdp" else 1,
        "experts": dims.ep * dims.etp * (dims.edp_shard if dp_mode == "fsdp" else 1),
    }


def check_memory(
    plan: JobPlan, limit: float | None, where: str = "the device", device_type: str = "cpu"
) -> MemoryEstimate:
    """Refuse a job whose weights, gradients and AdamW state alone exceed `limit` bytes per rank (the
    trainer passes the device's free memory: `memory_limit`), before any model is built; above
    MEMORY_NOTE of it, add a note to `plan.notes`.  `limit=None` checks nothing.  `device_type`: what
    optimizer offload takes off (module docstring)."""
    est = estimate_memory(plan, device_type)
    if limit is None:
        return est
    have = f"{where} has {limit / 2**30:.1f} GiB"
    check(
        est.bytes <= limit,
        f"the model needs about {est.describe(plan.dims.describe())} but {have}; use fewer layers or "
        "experts (model.num_layers, model.num_experts) or shard more (more GPUs, parallel.dp_mode=fsdp, "
        "parallel.ep, parallel.pp)",
    )
    if est.bytes > MEMORY_NOTE * limit:
        plan.notes.append(
            f"note: the model needs about {est.describe()}, {100 * est.bytes / limit:.0f}% of what "
            f"{have}; activations need the rest"
        )
    return est


def memory_limit(device) -> tuple[float, str]:
    """(bytes one rank may use, where they come from): a GPU's free memory (torch.cuda.mem_get_info), or
    on the CPU the machine's available memory (/proc/meminfo MemAvailable) shared by the ranks on this
    node (LOCAL_WORLD_SIZE).  (None, ...) when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        index = (
            device.index
            if device.index is not None
            else int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())
        )
        return float(torch.cuda.mem_get_info(index)[0]), f"cuda:{index} (free memory)"
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None, "the host"
    share = f" shared by {ranks} ranks" if ranks > 1 else ""
    return kib * 1024.0 / ranks, f"this machine (available memory{share})"
