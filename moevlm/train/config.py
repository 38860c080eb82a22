"""The job's configuration: typed dataclasses registered in Hydra's ConfigStore,
filled by the YAML groups in `conf/` and the command line, validated before
anything large is allocated.

    python train.py                                   # embedded CPU default
    torchrun --nproc-per-node 8 train.py +experiment=h100_fsdp data.shards=...
    python train.py -m optim.lr=1e-3,3e-4             # a sweep: one job each

Design choices:
- Sections mirror the groups: `model`, `data` (moevlm.data.DataConfig),
  `parallel`, `optim`, `train`.  An experiment (`conf/experiment/*.yaml`,
  `# @package _global_`) picks groups and sets fields, named by hardware and
  parallelism.
- Each field's description is its `field(metadata={"help": ...})` and each section's its class docstring:
  the one source of `python train.py --help` and conf/README.md (moevlm.train.options, which also takes the
  allowed values from the constants validation uses: CHOICES, DISPATCHER_NAMES, ...).
- The model is a preset (torchtitan's "flavor") or an HF `config.json`, plus a
  few proxy knobs (`num_layers`, `num_experts`, `vision_depth`) so a recipe
  can shrink the real architecture to fit its hardware.
- The batch is layout independent: `train.global_batch_size` packed rows per
  optimizer step = micro_batch_size x grad accumulation x dp; accumulation is
  derived, and `data.streams` fixes which rows form a global batch whatever the
  layout (see moevlm.data.loader).
- `validate()` checks everything that needs no file or device and says what
  to change; files (shards, tokenizer, checkpoints) are checked where opened.
  Every number is range-checked so that NaN fails too (Python compares NaN
  False) and infinities are refused; settings that are valid but probably
  unintended (warmup longer than the run) become `Plan.notes` for the log.
- `model.dispatcher=auto` (the default) is resolved once, here, from the
  layout: `local` when parallel.ep x etp == 1, else `alltoall`; the Plan's
  model config carries the concrete name (a note says when auto chose
  alltoall).  An explicit name wins; `local` with ep > 1 is refused.  `deepep` and `hybridep` are
  gated (moevlm.dispatch.availability: package, adapter, layout rules) and refused with the reason, or
  replaced by `model.dispatcher_fallback` with one note.
- `check_memory()` refuses, before the model is built even on meta, a job
  whose weights, fp32 gradients and AdamW state (16 bytes a trained
  parameter, 4 a frozen one) exceed one rank's memory: the closed-form counts
  of `moevlm.model.params` divided by each part's sharding, on the fullest
  pipeline rank, against the GPU's free memory or on the CPU the machine's
  available memory over the node's ranks (`memory_limit`).  Activations are
  not estimated: the job is refused only when the model state alone exceeds
  the limit, and a note is logged above 80% of it.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from moevlm.data.config import DataConfig
from moevlm.data.loader import check_config as check_data_config
from moevlm.model.attention import varlen_available, varlen_missing
from moevlm.model.config import CAPACITY_OVERFLOWS, FP8_BACKENDS, FP8_RECIPES, ConfigError, Fp8Config, VLMConfig
from moevlm.model.fp8 import BLOCK
from moevlm.model.params import layers_parameters, parameter_counts
from moevlm.parallel.mesh import ParallelDims
from moevlm.parallel.pipeline_plan import PipelinePlan, plan_pipeline, schedule_name
from moevlm.train.scale import scale_down
from moevlm.train.profile import parse_profile_steps
from moevlm.train.wandb_log import MISSING_PACKAGE as WANDB_MISSING
from moevlm.train.wandb_log import MODES as WANDB_MODES
from moevlm.train.wandb_log import wandb_installed


@dataclass
class ModelConfig:
    """The network: a preset or an HF config, proxy knobs that shrink it, kernel and dispatcher backends."""
    preset: str = field(default="tiny", metadata={"help": "the architecture by name (ignored when hf_config is set)"})
    hf_config: str = field(default="", metadata={
        "help": "an HF Qwen3-VL-MoE config.json (or its folder) as the architecture; empty = model.preset"})
    hf_checkpoint: str = field(default="", metadata={
        "help": "an HF folder (safetensors) to load weights from; empty = random init"})
    num_layers: Optional[int] = field(default=None, metadata={
        "help": "proxy: fewer decoder layers; null = the model's own"})
    num_experts: Optional[int] = field(default=None, metadata={
        "help": "proxy: fewer experts (0: a dense MLP in every layer); null = the model's own"})
    vision_depth: Optional[int] = field(default=None, metadata={
        "help": "proxy: fewer vision blocks (deepstack taps beyond it dropped); null = the model's own"})
    attn_backend: str = field(default="auto", metadata={
        "help": "attention kernel: auto (on CUDA in bf16/fp16 the first available of flash, varlen, flex, sdpa; "
                "sdpa on CUDA in fp32; on the CPU sdpa_per_doc, or sdpa under train.compile), sdpa (one call, dense "
                "document mask), sdpa_per_doc (one call per document: only the useful scores, a host loop), flex "
                "(FlexAttention), flash (flash-attn varlen), varlen (torch.nn.attention.varlen, CUDA only, no extra "
                "package)"})
    grouped_gemm: str = field(default="torch", metadata={
        "help": "expert GEMM: torch (torch._grouped_mm), loop (one matmul per expert, the reference), triton "
                "(ours; needs the triton package)"})
    dispatcher: str = field(default="auto", metadata={
        "help": "how tokens reach their experts (moevlm.dispatch): auto (local when parallel.ep x etp == 1, else "
                "alltoall), local (no expert parallelism, parallel.ep=1), alltoall, deepep (DeepEP's V2 ElasticBuffer, "
                "else its V1 Buffer: needs the deep_ep package, CUDA only, and an EP group of 2, 4, 8 or a "
                "multiple of 8 ranks), hybridep "
                "(DeepEP's hybrid-ep branch, HybridEPBuffer: CUDA only, experts-per-rank x ranks-per-node a multiple "
                "of 4); neither was run on a real GPU cluster by moevlm yet; one that cannot run is refused, or "
                "replaced as model.dispatcher_fallback says"})
    dispatcher_fallback: str = field(default="none", metadata={
        "help": "when model.dispatcher (deepep, hybridep) cannot run here (package missing or broken, adapter not "
                "built, or a layout it cannot take): none (refuse with the reason) or alltoall (run the alltoall "
                "dispatcher instead; one note in the start-up log says why)"})
    permute: str = field(default="torch", metadata={
        "help": "token permute/unpermute around the experts: torch, or triton (fused kernels)"})
    moe_capacity_factor: Optional[float] = field(default=None, metadata={
        "help": "null = dropless (exact; the alltoall dispatcher syncs with the host once per MoE layer). A number "
                "f > 0: the capacity all-to-all (moevlm.dispatch.capacity): each rank sends each expert at most "
                "C = ceil(f x tokens x top_k / num_experts) rows through fixed-size buffers, no host sync; "
                "choices over C are dropped (the earliest tokens kept) and logged as moe_dropped_tokens in "
                "metrics.jsonl. Needs the alltoall dispatcher (model.dispatcher=alltoall, or auto with "
                "parallel.ep > 1) or hybridep (a static num_permuted_tokens of E x C rows per receiving rank; "
                "HybridEP drops the last permuted rows and flags it), and parallel.etp=1"})
    moe_capacity_overflow: str = field(default="drop", metadata={
        "help": "with model.moe_capacity_factor: drop (drop and count the choices over capacity) or error (the "
                "step fails, naming the fix, when any choice is dropped)"})
    aux_loss_coef: Optional[float] = field(default=None, metadata={
        "help": "router load-balancing loss weight (0 turns it off); null = the checkpoint's router_aux_loss_coef"})
    freeze_vision: bool = field(default=False, metadata={
        "help": "the whole vision module (tower, merger, deepstack mergers) runs forward only, no gradients"})
    recompute: str = field(default="none", metadata={
        "help": "activation recompute in backward: none, selective (the regions of model.recompute_modules), full "
                "(each decoder layer and vision block whole); collective outputs are kept, never re-run"})
    recompute_modules: List[str] = field(default_factory=lambda: ["core_attn"], metadata={
        "help": "regions recomputed when model.recompute=selective (ignored otherwise): core_attn (attention "
                "kernel), layernorm, mlp (dense MLPs: mlp_only_layers and vision), moe_act (experts' SwiGLU), moe "
                "(whole MoE block), vision (each vision block)"})
    fp8: str = field(default="none", metadata={
        "help": "FP8 training of the linears in model.fp8_modules: none, blockwise (Hopper recipe: e4m3, 1x128 "
                "activation tiles, 128x128 weight blocks, fp32 scales) or mxfp8 (Blackwell: 1x32 blocks, e8m0 "
                "scales); fp32 master weights, the router always fp32 (moevlm.model.fp8)"})
    fp8_modules: List[str] = field(default_factory=lambda: ["experts", "attn", "mlp"], metadata={
        "help": "what runs in FP8 when model.fp8 is set: experts (grouped GEMMs), attn (decoder q/k/v/o), mlp "
                "(decoder dense MLPs), vision (vision blocks and mergers); router, norms, embeddings and LM head "
                "never"})
    fp8_backend: str = field(default="auto", metadata={
        "help": "FP8 kernels: auto (blockwise: ours on sm89+; mxfp8: torch where the probe finds Blackwell's "
                "paths; refused on the CPU), triton (ours, blockwise), torch (torch._scaled_mm / _scaled_grouped_mm "
                "where a probe finds them; pads expert rows), emulate (dequantize, fp64 GEMM: the recipe's numerics "
                "anywhere, slow)"})
    fp8_pow2_scales: bool = field(default=False, metadata={
        "help": "blockwise: scales rounded up to powers of two (rescaling exact)"})
    fp8_cache_weights: bool = field(default=True, metadata={
        "help": "quantize each weight once per optimizer step and reuse it across micro-batches and backward (one "
                "byte per weight element kept until the step ends, unsharded under FSDP); false = at every use"})
    fp8_pad_experts: bool = field(default=False, metadata={
        "help": "pad each expert's rows to the scale block (128 / 32) so no weight-gradient scale block spans two "
                "experts (local dispatcher: up to block-1 zero rows per expert and a host sync per layer; hybridep: "
                "padded by HybridEP); "
                "fp8_backend=torch always pads"})
    cuda_graph_scope: list = field(default_factory=list, metadata={
        "help": "decoder-layer regions captured as CUDA graphs at the first training step and replayed "
                "(moevlm.parallel.cuda_graphs): any of attn (norm, q/k/v, rope, sdpa, o_proj; needs "
                "attn_backend=sdpa), moe_router, moe_preprocess (the dispatcher's sort/counts before any "
                "exchange), or full_layer alone (the whole layer; local dispatcher only); [] = none. CUDA only"})


@dataclass
class ParallelConfig:
    """The layout over the launched processes: tp x cp x dp x pp attention ranks, ep x etp x edp expert ranks."""
    tp: int = field(default=1, metadata={"help": "tensor (and sequence) parallel size"})
    cp: int = field(default=1, metadata={
        "help": "context parallel size: each packed row split over cp ranks (load-balanced: chunks r and "
                "2cp-1-r of 2cp), images encoded in shares and gathered"})
    cp_comm: str = field(default="allgather", metadata={
        "help": "context parallel attention: allgather (gather the kv heads of the row, reduce-scatter their "
                "gradients) or ring (K/V blocks passed around the cp ranks, overlapped with compute)"})
    pp: int = field(default=1, metadata={"help": "pipeline parallel size (stages over pp ranks)"})
    dp: int = field(default=-1, metadata={"help": "data parallel size; -1 = world / (pp * tp * cp)"})
    ep: int = field(default=1, metadata={"help": "expert parallel size: experts split over ep ranks"})
    etp: int = field(default=1, metadata={"help": "expert tensor parallel size: each expert's weights split"})
    ep_overlap: bool = field(default=False, metadata={
        "help": "split each MoE block's micro-batch tokens in two chunks and overlap one chunk's all-to-all with "
                "the other's expert compute, forward and backward (moevlm/parallel/ep_overlap.py; same result). Needs "
                "parallel.ep > 1, "
                "etp=1, the alltoall dispatcher; with model.moe_capacity_factor each chunk has its own capacity"})
    dp_mode: str = field(default="fsdp", metadata={
        "help": "data parallel: fsdp (FSDP2, weights/gradients/optimizer state sharded) or ddp (replicated)"})
    pp_schedule: str = field(default="1f1b", metadata={
        "help": "pipeline schedule (torch.distributed.pipelining; the class names GPipe, 1F1B, Interleaved1F1B "
                "are accepted too)"})
    vpp: Optional[int] = field(default=None, metadata={
        "help": "stages per pp rank; null = 1, or 2 for interleaved_1f1b / zbv / dualpipev"})
    pp_layers: Any = field(default="auto", metadata={
        "help": "decoder layers per stage: auto (balanced by training FLOPs, the vision tower charged to stage 0) "
                "or a list, e.g. parallel.pp_layers=[20,28] (or the string \"'20,28'\")"})
    world_size: Optional[int] = field(default=None, metadata={
        "help": "the recipe's GPU count, checked against the launch; null = any"})
    scale_to: Optional[int] = field(default=None, metadata={
        "help": "+scale=cpu sets it: at most this many processes; dp (and ep if it must) shrink to fit, the "
                "recipe's parallel shape is kept (moevlm/train/scale.py)"})
    backend: str = field(default="auto", metadata={
        "help": "process group backend: auto (nccl on CUDA, gloo on CPU), nccl, gloo"})
    timeout_s: float = field(default=600.0, metadata={
        "help": "seconds a collective may wait for its peers before the job ends with one clear line (exit 5); "
                "torch's NCCL default, long enough for a first-step compile or a large checkpoint write"})


@dataclass
class OptimConfig:
    """AdamW, its weight-decay groups, the learning-rate schedule and gradient clipping."""
    lr: float = field(default=3e-4, metadata={"help": "peak learning rate (reached after warmup)"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final lr = lr * min_lr_ratio, in [0, 1]"})
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata={
        "help": "AdamW betas, two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]"})
    eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon (added to sqrt(v)), > 0"})
    weight_decay: float = field(default=0.1, metadata={"help": "decoupled weight decay; 0 = none"})
    decay_norms_biases_embeddings: bool = field(default=False, metadata={
        "help": "weight decay on norms, biases and embeddings too (false: matrices only)"})
    implementation: str = field(default="auto", metadata={
        "help": "AdamW implementation: auto (fused where the device has the kernel, else foreach), fused, foreach, "
                "for_loop"})
    schedule: str = field(default="cosine", metadata={
        "help": "learning rate after the linear warmup: cosine, wsd (warmup-stable-decay), constant"})
    warmup_steps: int = field(default=0, metadata={"help": "steps of linear warmup up to lr"})
    decay_fraction: float = field(default=0.2, metadata={"help": "wsd: the last fraction of steps decays, in (0, 1]"})
    decay_shape: str = field(default="linear", metadata={"help": "wsd: the decay's shape"})
    grad_clip: float = field(default=1.0, metadata={
        "help": "max global gradient norm; <= 0 disables clipping (the norm is still logged)"})


@dataclass
class TrainConfig:
    """The loop: steps, batch sizes, precision, run directory, checkpoints, logging, fault handling."""
    steps: int = field(default=20, metadata={"help": "optimizer steps to run"})
    global_batch_size: int = field(default=1, metadata={
        "help": "packed rows per optimizer step over all data-parallel ranks; a multiple of micro_batch_size x dp "
                "(the quotient is the gradient accumulation)"})
    micro_batch_size: int = field(default=1, metadata={"help": "packed rows per forward/backward on one rank"})
    seed: int = field(default=0, metadata={"help": "seed of the weight init and the RNGs"})
    deterministic: bool = field(default=False, metadata={"help": "deterministic kernels (CPU runs repeat bitwise)"})
    precision: str = field(default="auto", metadata={
        "help": "compute precision: auto (bf16 autocast on CUDA, fp32 on CPU), fp32, bf16"})
    device: str = field(default="auto", metadata={"help": "auto (CUDA when available), cpu, cuda"})
    run_dir: str = field(default="", metadata={
        "help": "the run's directory (checkpoints, logs, metrics), one for all ranks; empty = "
                "outputs/<date>/<time>[/<sweep job>]"})
    resume: str = field(default="auto", metadata={
        "help": "auto (the newest complete checkpoint in run_dir, if any), none, or a checkpoint path"})
    checkpoint_every: int = field(default=0, metadata={"help": "steps between checkpoints; 0 = only at the end"})
    keep_checkpoints: int = field(default=2, metadata={"help": "keep the last K complete checkpoints; <= 0 keeps all"})
    checkpoint_at_end: bool = field(default=True, metadata={"help": "write a checkpoint after the last step"})
    export_hf: str = field(default="", metadata={
        "help": "a folder to write the final weights to as HF safetensors; empty = no export"})
    log_every: int = field(default=1, metadata={"help": "steps between metric log lines"})
    tensorboard: bool = field(default=True, metadata={"help": "write TensorBoard event files in run_dir"})
    wandb: str = field(default="disabled", metadata={
        "help": "Weights & Biases logging (pip install wandb): disabled, online, or offline (<run_dir>/wandb, no "
                "network); entity, run name and tags from W&B's WANDB_ENTITY, WANDB_NAME, WANDB_TAGS"})
    wandb_project: str = field(default="moevlm", metadata={"help": "the W&B project (train.wandb on)"})
    progress: Optional[bool] = field(default=None, metadata={
        "help": "a progress bar; null = when stdout is a terminal"})
    peak_tflops: Optional[float] = field(default=None, metadata={
        "help": "peak TFLOP/s per device for MFU; null = from the device table (MFU null when unknown)"})
    nonfinite: str = field(default="skip", metadata={
        "help": "a NaN/inf loss or gradient: skip (the step is skipped and counted) or stop (checkpoint, message, "
                "exit 3)"})
    max_nonfinite_steps: int = field(default=10, metadata={
        "help": "consecutive skipped non-finite steps before stopping anyway"})
    require_loss_decrease: bool = field(default=False, metadata={
        "help": "exit 1 if the mean loss of the last 3 steps is not below that of the first 3"})
    watchdog_factor: float = field(default=10.0, metadata={
        "help": "step watchdog: after 2 warm-up steps, a step longer than this x the median of the last 20 (and "
                "than watchdog_min_s) is reported with all threads' stacks; 0 = no reports"})
    watchdog_min_s: float = field(default=60.0, metadata={
        "help": "step watchdog: steps shorter than this many seconds are never reported"})
    watchdog_abort_s: Optional[float] = field(default=None, metadata={
        "help": "a step or checkpoint running longer than this many seconds ends the process (exit 6); null = never"})
    compile: bool = field(default=False, metadata={
        "help": "torch.compile each vision block and decoder layer (moevlm/parallel/compile.py); metrics.jsonl "
                "then logs compiled_graphs, graph_breaks and recompiles (after step 1: should stay 0)"})
    compile_mode: str = field(default="default", metadata={
        "help": "torch.compile mode with train.compile: default or max-autotune-no-cudagraphs (CUDA graphs are "
                "model.cuda_graph_scope's)"})
    profile_components: bool = field(default=False, metadata={
        "help": "time each part of every step (data, vision encoder, merger, attention, router, dispatch, experts, "
                "combine, LM head + loss, backward, gradient reduction + clipping, optimizer, other): "
                "components_s in metrics.jsonl (sums over the log window) and profile_components.md at the end; "
                "CUDA events on a GPU (one sync per step); not with train.compile"})
    profile_steps: Any = field(default="", metadata={
        "help": "a torch.profiler trace of steps A..B into <run_dir>/profile/rank<R>_steps<A>-<B>.json, e.g. "
                "train.profile_steps=[3,5] (or the string \"'3,5'\"); empty = no trace"})


@dataclass
class JobConfig:
    """The whole job, one section per config group."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def register_configs() -> None:
    """The schema behind conf/config.yaml (its first default): every group file
    and override is checked against these types; and the `${moevlm.options:}` resolver of the --help text."""
    from moevlm.train.options import register_help_resolver  # it imports this module

    ConfigStore.instance().store(name="job_schema", node=JobConfig)
    register_help_resolver()


def compose_job(overrides: list[str] = (), config_dir: str | None = None):
    """The job config as `train.py` would compose it (for notebooks and tests)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    config_dir = config_dir or os.path.join(os.path.dirname(__file__), "..", "..", "conf")
    with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base=None):
        return compose("config", overrides=list(overrides))


# ------------------------------------------------------------------ validation
CHOICES = {
    "parallel.dp_mode": ("fsdp", "ddp"),
    "parallel.backend": ("auto", "nccl", "gloo"), "optim.implementation": ("auto", "fused", "foreach", "for_loop"),
    "optim.schedule": ("cosine", "wsd", "constant"), "optim.decay_shape": ("linear", "cosine", "sqrt"),
    "train.precision": ("auto", "fp32", "bf16"), "train.device": ("auto", "cpu", "cuda"),
    "train.nonfinite": ("skip", "stop"), "train.wandb": WANDB_MODES,
    "train.compile_mode": ("default", "max-autotune-no-cudagraphs"),
    "model.fp8": FP8_RECIPES, "model.fp8_backend": FP8_BACKENDS, "model.moe_capacity_overflow": CAPACITY_OVERFLOWS,
    "model.dispatcher_fallback": ("none", "alltoall"),
}


@dataclass
class Plan:
    """What validation derived: the model config, the layout, the accumulation (= the pipeline's
    micro-batches per step), the pipeline stages (pp > 1), notes for the log."""
    model: VLMConfig
    dims: ParallelDims
    grad_accum: int
    pipeline: Optional[PipelinePlan] = None
    # for the log: valid but probably unintended settings, and what an `auto` setting chose when not the obvious
    notes: list[str] = field(default_factory=list)


def build_model_config(m: ModelConfig) -> VLMConfig:
    _check_proxies(m)
    cfg = VLMConfig.from_hf(m.hf_config) if m.hf_config else VLMConfig.preset(m.preset)
    if m.num_layers is not None:
        cfg.text.num_layers = m.num_layers
        cfg.moe.mlp_only_layers = tuple(i for i in cfg.moe.mlp_only_layers if i < m.num_layers)
    if m.num_experts is not None:
        cfg.moe.num_experts = m.num_experts
    if m.vision_depth is not None:
        cfg.vision.depth = m.vision_depth
        cfg.vision.deepstack_visual_indexes = tuple(i for i in cfg.vision.deepstack_visual_indexes
                                                    if i < m.vision_depth)
    if m.aux_loss_coef is not None:
        cfg.moe.router_aux_loss_coef = m.aux_loss_coef
    # `auto` is resolved by validate() once the layout is known; the model alone (one rank) dispatches locally
    dispatcher = "local" if m.dispatcher == "auto" else m.dispatcher
    cfg.moe.grouped_gemm, cfg.moe.dispatcher, cfg.attn_backend = m.grouped_gemm, dispatcher, m.attn_backend
    cfg.moe.permute = m.permute
    cfg.moe.capacity_factor, cfg.moe.capacity_overflow = m.moe_capacity_factor, m.moe_capacity_overflow
    cfg.fp8 = Fp8Config(recipe=m.fp8, modules=tuple(str(x) for x in m.fp8_modules), backend=m.fp8_backend,
                        pow2_scales=m.fp8_pow2_scales, cache_weights=m.fp8_cache_weights,
                        pad_experts=m.fp8_pad_experts)
    return cfg.validate()


def _check_proxies(m: ModelConfig) -> None:
    for name, least, what in (("num_layers", 1, ""), ("vision_depth", 1, ""),
                              ("num_experts", 0, " (0: a dense MLP in every layer)")):
        value = getattr(m, name)
        _check(value is None or _int(value) and value >= least,
               f"model.{name}={value!r} must be an integer >= {least}{what}, or null for the model's own")
    _check(m.aux_loss_coef is None or _real(m.aux_loss_coef) and m.aux_loss_coef >= 0,
           f"model.aux_loss_coef={m.aux_loss_coef!r} must be a finite number >= 0 (0 turns the aux loss off), or "
           "null for the checkpoint's router_aux_loss_coef")
    f = m.moe_capacity_factor
    _check(f is None or _real(f) and f > 0,
           f"model.moe_capacity_factor={f!r} must be a finite number > 0 (1.0: the balanced load per expert), or "
           "null for the dropless all-to-all")


def _check_recompute(m) -> None:
    from moevlm.parallel.recompute import check

    reason = check(m.recompute, tuple(m.recompute_modules or ()))
    if reason is not None:
        raise ConfigError(reason)


def validate(job, world_size: int = 1, environment: bool = True) -> Plan:
    """Every check that needs no allocation (config values, the launch, and with `environment` the
    device, packages and files the config names), all at once: ConfigError with one line per problem
    (each group of checks reports its first), in the order a user would fix them.  environment=False
    checks a recipe for another machine (a GPU recipe's arithmetic on a laptop)."""
    problems: list[str] = []
    run = _collector(problems)
    p, t, o = job.parallel, job.train, job.optim
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(job, section), name)
        run(_check, value in allowed, f"{key}={value!r}; choose one of {list(allowed)}")
    before = len(problems)
    unavailable = run(_dispatcher_unavailable, job.model, environment)
    if len(problems) > before:  # such a recipe cannot run at all: its launch size and layout do not matter
        raise ConfigError("\n".join(problems))
    run(_check, t.wandb == "disabled" or wandb_installed(), WANDB_MISSING.format(mode=t.wandb))
    scaled = run(scale_down, job, world_size, build_model_config)  # parallel.scale_to rewrites the layout and batch
    if scaled is None:  # the layout checks below would only repeat it
        raise ConfigError("\n".join(problems))
    run(_check, p.world_size is None or p.world_size == world_size,
        f"this recipe is laid out for parallel.world_size={p.world_size} processes but {world_size} were "
        f"launched; launch {p.world_size} (torchrun --nnodes/--nproc-per-node) or set parallel.world_size=null "
        "and a layout that fits")
    for check in environment_checks(job) if environment else ():
        run(check)
    dims = run(ParallelDims, world_size, tp=p.tp, cp=p.cp, pp=p.pp, dp=p.dp, ep=p.ep, etp=p.etp)
    model = run(build_model_config, job.model)
    if dims is not None and model is not None:
        run(dims.check_model, model)
    dispatcher_note: list[str] = []
    if dims is not None:
        run(_check_dispatcher, job.model.dispatcher, dims)
        run(_check_batch, t, dims)
    if dims is not None and model is not None:
        unavailable = unavailable or run(_dispatcher_layout_problem, job.model, dims, model.moe.num_experts,
                                         environment)
        model.moe.dispatcher, dispatcher_note = resolve_dispatcher(job.model.dispatcher, dims, unavailable,
                                                                   job.model.dispatcher_fallback)
        run(_check_capacity, job.model, model.moe.dispatcher, dims)
        run(_check_ep_overlap, job, model, dims)
    notes = scaled + dispatcher_note + (run(_check_optim, o, t.steps) or [])
    run(_check_faults, p, t)
    run(_check_recompute, job.model)
    run(_check, not (t.compile and job.model.attn_backend == "sdpa_per_doc"),
        "train.compile=true with model.attn_backend=sdpa_per_doc: its host loop over the documents would "
        "recompile every batch; use model.attn_backend=sdpa (or auto), or train.compile=false")
    run(_check_profile, t)
    if dims is not None:
        run(_check_context_parallel, job, dims)
    if dims is not None and model is not None:
        run(_check_data, job.data, model, dims)
        run(_check_cuda_graphs, job, model, dims)
        run(_check_fp8, job, model, dims, environment)
    if environment and model is not None:
        run(_check_tokenizer, job.data, job.model.hf_checkpoint, model)
    if problems:
        raise ConfigError("\n".join(problems))
    grad_accum = t.global_batch_size // (t.micro_batch_size * dims.dp)
    return Plan(model=model, dims=dims, grad_accum=grad_accum, pipeline=_plan_pipeline(job, model, dims, grad_accum),
                notes=notes)


def _collector(problems: list[str]):
    """run(fn, *args): fn's result, or None with its ConfigError's lines added to `problems`."""
    def run(fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as err:
            problems.extend(line for line in str(err).splitlines() if line not in problems)
            return None
    return run


# ---------------------------------------------------------- the environment
TRITON_OPTIONS = ("model.grouped_gemm", "model.permute")


def environment_checks(job) -> list:
    """Checks of what the config asks of this machine (device, backend, packages) and of the files it
    names; each a no-argument callable raising ConfigError, so every problem is reported."""
    t, m, p = job.train, job.model, job.parallel
    cuda = torch.cuda.is_available()
    on_cpu = t.device == "cpu" or not cuda  # (device=cuda without CUDA is its own error)
    checks = [
        lambda: _check(t.device != "cuda" or cuda,
                       f"train.device=cuda but {_why_no_cuda()}; use train.device=auto (CPU here) or cpu"),
        lambda: _check(p.backend != "nccl" or not on_cpu,
                       "parallel.backend=nccl needs CUDA devices but this job runs on the CPU; use parallel.backend=auto "
                       "(gloo on the CPU)"),
    ]
    for key in TRITON_OPTIONS:
        value = getattr(m, key.split(".")[1])
        checks.append(lambda key=key, value=value: _check(
            value != "triton" or not on_cpu or os.environ.get("TRITON_INTERPRET") == "1",
            f"{key}=triton runs Triton kernels, which need a CUDA device; on the CPU use {key}=torch (or set "
            "TRITON_INTERPRET=1 before launching to run them in Triton's interpreter: very slow, for tests)"))
    checks.append(lambda: _check(not m.cuda_graph_scope or not on_cpu,
                                 f"model.cuda_graph_scope={_scope(m)} captures CUDA graphs, which need a CUDA device; "
                                 "this job runs on the CPU: use model.cuda_graph_scope=[] (or train.device=cuda on a "
                                 "GPU machine)"))
    checks.append(lambda: _check(m.attn_backend != "flash" or importlib.util.find_spec("flash_attn") is not None,
                                 "model.attn_backend=flash needs the flash-attn package, which is not installed "
                                 "(pip install flash-attn, CUDA only); use model.attn_backend=auto"))
    checks.append(lambda: _check(m.attn_backend != "varlen" or (not on_cpu and varlen_available()),
                                 f"model.attn_backend=varlen needs {_varlen_needs(on_cpu)}; use "
                                 "model.attn_backend=auto (sdpa on the CPU)"))
    checks += [lambda: _check_path(m.hf_checkpoint, "model.hf_checkpoint", "an HF folder with config.json and "
                                   "*.safetensors", folder=True),
               lambda: _check_path(m.hf_config, "model.hf_config", "an HF config.json or its folder"),
               lambda: _check_path("" if t.resume in ("auto", "none") else t.resume, "train.resume",
                                   "a checkpoint folder (checkpoints/step_NNNNNNNN), auto or none", folder=True),
               lambda: _check_shards(job.data.shards)]
    return checks


def _varlen_needs(on_cpu: bool) -> str:
    if on_cpu:
        return "a CUDA device (torch's varlen_attn is a flash-attention kernel) but this job runs on the CPU"
    return varlen_missing() or "a CUDA device"


def _check_tokenizer(data, hf_checkpoint: str, model: VLMConfig) -> None:
    """Your shards' tokenizer is found (data.tokenizer, beside the shards, or the HF checkpoint's) and its
    special tokens sit where the model expects them.  (The sample set brings its own, built later.)"""
    if data.shards in ("", "sample", MISSING):
        return
    from moevlm.data.loader import find_tokenizer
    from moevlm.data.reader import expand_shards
    from moevlm.data.text import ChatEncoder, load_tokenizer

    try:
        shards = expand_shards(data.shards)
    except FileNotFoundError:
        return  # _check_shards says so
    path = find_tokenizer(data, shards, hf_checkpoint)  # DataSetupError (a ConfigError) names the three places
    try:
        ChatEncoder(load_tokenizer(path)).check_model(model)
    except ValueError as err:
        raise ConfigError(f"the tokenizer {path} does not fit the model: {err}") from None
    except Exception as err:  # not a tokenizer.json at all
        raise ConfigError(f"the tokenizer {path} cannot be loaded ({type(err).__name__}: {err}); point "
                          "data.tokenizer at a tokenizers tokenizer.json") from None


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    return f"no CUDA device is visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r})"


def _check_path(path: str, key: str, what: str, folder: bool = False) -> None:
    if path:
        _check(os.path.isdir(path) if folder else os.path.exists(path),
               f"{key}={path} does not exist{' or is not a folder' if folder else ''}; give {what}")


def _check_shards(spec: str) -> None:
    """A shard spec that names nothing readable (the sample set and the empty value are checked elsewhere)."""
    if spec in ("", "sample", MISSING) or not isinstance(spec, str):
        return
    if "{" not in spec and "," not in spec and not any(c in spec for c in "*?[") and not os.path.exists(spec):
        raise ConfigError(f"data.shards={spec} does not exist; give a folder of .tar shards (build them with "
                          "python -m moevlm.data.build_shards), a brace pattern or a list")
    from moevlm.data.reader import expand_shards

    shards = expand_shards(spec)  # naming nothing that exists: DataSetupError, a ConfigError
    missing = [s for s in shards if not os.path.isfile(s)]
    _check(not missing, f"data.shards={spec} names {len(missing)} shard(s) that do not exist, e.g. {missing[:3]}")


def _plan_pipeline(job, model: VLMConfig, dims: ParallelDims, microbatches: int) -> Optional[PipelinePlan]:
    p, d = job.parallel, job.data
    schedule_name(p.pp_schedule)  # a misspelt schedule is refused whatever pp is
    if dims.pp == 1:
        _check(p.pp_layers in ("auto", None) and p.vpp in (None, 1),
               "parallel.pp_layers / parallel.vpp describe pipeline stages but parallel.pp=1; set parallel.pp > 1 "
               "or leave them at auto / null")
        return None
    return plan_pipeline(model, pp=dims.pp, vpp=p.vpp, schedule=p.pp_schedule, layers=p.pp_layers,
                         microbatches=microbatches, rows=job.train.micro_batch_size, seq_len=d.pack.seq_len,
                         max_patches=d.pack.max_patches, image_patches=d.image.max_pixels // d.image.patch_size**2,
                         freeze_vision=job.model.freeze_vision)


DISPATCHER_NAMES = ("local", "alltoall", "deepep", "hybridep")
GATED_DISPATCHERS = ("deepep", "hybridep")  # named, but runnable only as moevlm.dispatch.availability says


def resolve_dispatcher(name: str, dims: ParallelDims, unavailable: str | None = None,
                       fallback: str = "none") -> tuple[str, list[str]]:
    """The concrete dispatcher for `model.dispatcher` (already checked) under `dims`, and the log line
    when `auto` chose one that moves tokens: `auto` is `local` when no token leaves its rank
    (ep x etp == 1), else `alltoall` (the built backend that runs everywhere); an explicit name wins,
    unless it is `unavailable` (the reason) and `fallback` names what runs instead: one note says so."""
    if unavailable is not None and fallback != "none":
        return fallback, [f"note: model.dispatcher={name} cannot run: {unavailable}; running the {fallback} "
                          f"dispatcher instead (model.dispatcher_fallback={fallback})"]
    if name != "auto":
        return name, []
    if dims.ep * dims.etp == 1:
        return "local", []
    return "alltoall", [f"model.dispatcher=auto chose alltoall: parallel.ep x etp = {dims.ep} x {dims.etp} > 1 "
                        "moves tokens between ranks"]


def _check_dispatcher(name: str, dims: ParallelDims) -> None:
    _check(name == "auto" or name in DISPATCHER_NAMES,
           f"model.dispatcher={name!r}; choose auto or one of {list(DISPATCHER_NAMES)}")
    _check(name != "local" or dims.ep == 1,
           f"parallel.ep={dims.ep} moves tokens between ranks: model.dispatcher='local' cannot; choose alltoall "
           "(or auto)")


def _check_capacity(m, dispatcher: str, dims: ParallelDims) -> None:
    """model.moe_capacity_factor is a mode of the alltoall and hybridep dispatchers, without ETP
    (moevlm.dispatch.capacity, moevlm.dispatch.hybridep)."""
    if m.moe_capacity_factor is None:
        return
    _check(dispatcher in ("alltoall", "hybridep"),
           f"model.moe_capacity_factor={m.moe_capacity_factor} is a mode of the alltoall and hybridep dispatchers "
           f"but the dispatcher is {dispatcher!r}; set model.dispatcher=alltoall, or model.moe_capacity_factor=null")
    _check(dims.etp == 1, f"model.moe_capacity_factor={m.moe_capacity_factor} is not built with parallel.etp="
                          f"{dims.etp} > 1; use parallel.etp=1, or model.moe_capacity_factor=null (dropless)")


def _check_ep_overlap(job, model: VLMConfig, dims: ParallelDims) -> None:
    """What parallel.ep_overlap (moevlm.parallel.ep_overlap) cannot run with, each with its reason."""
    if not job.parallel.ep_overlap:
        return
    refusals = [
        (not model.moe.num_experts, "has no MoE layer to overlap (model.num_experts=0); leave it false"),
        (dims.ep == 1, "needs expert parallel: parallel.ep=1 exchanges nothing; set parallel.ep > 1"),
        (dims.etp > 1, f"is not built with expert tensor parallel (parallel.etp={dims.etp}); use parallel.etp=1"),
        (model.moe.dispatcher != "alltoall", f"runs the alltoall dispatcher only, not {model.moe.dispatcher!r}; set "
                                             "model.dispatcher=alltoall (or auto)"),
        (bool(job.train.compile), "with train.compile=true is not built (its exchanges are not kept out of the "
                                  "compiled graph); use train.compile=false"),
        ("moe_preprocess" in [str(s) for s in job.model.cuda_graph_scope],
         "with model.cuda_graph_scope moe_preprocess: the overlap permutes two chunks of varying shape, which one "
         "captured graph cannot replay; leave moe_preprocess out"),
    ]
    _check(not any(bad for bad, _ in refusals),
           "\n".join(f"parallel.ep_overlap=true {why}" for bad, why in refusals if bad))


def _dispatcher_refusal(name: str, reason: str) -> str:
    return (f"model.dispatcher={name!r} cannot run: {reason}; use model.dispatcher=alltoall, or "
            "model.dispatcher_fallback=alltoall to fall back to it")


def _dispatcher_unavailable(m, environment: bool) -> str | None:
    """Why a gated backend (deepep, hybridep) cannot run: its package on this machine (with `environment`),
    then moevlm's adapter.  Refused here, before any process group, unless model.dispatcher_fallback says
    what runs instead; then the reason, for the note."""
    from moevlm.dispatch.availability import unavailable_reason

    if m.dispatcher not in GATED_DISPATCHERS:
        return None
    reason = unavailable_reason(m.dispatcher, check_package=environment)
    _check(reason is None or m.dispatcher_fallback != "none", _dispatcher_refusal(m.dispatcher, reason))
    return reason


def _dispatcher_layout_problem(m, dims: ParallelDims, num_experts: int, environment: bool) -> str | None:
    """A gated backend's rank and expert-count rules (moevlm.dispatch.availability) under this layout; the
    node size is this machine's when checking it (DeepEP: the launch's LOCAL_WORLD_SIZE; HybridEP: its
    NVLINK_DOMAIN_SIZE, default 8), else unknown."""
    from moevlm.dispatch.availability import LAUNCH_NODE_SIZE, LAYOUT_PROBLEMS

    if m.dispatcher not in GATED_DISPATCHERS or not num_experts:
        return None
    node = LAUNCH_NODE_SIZE[m.dispatcher]() if environment else None
    problem = LAYOUT_PROBLEMS[m.dispatcher](dims.ep, num_experts, node)
    _check(problem is None or m.dispatcher_fallback != "none", _dispatcher_refusal(m.dispatcher, problem))
    return problem


def _scope(m) -> str:
    return "[" + ",".join(str(s) for s in m.cuda_graph_scope) + "]"


def _check_cuda_graphs(job, model: VLMConfig, dims: ParallelDims) -> None:
    """What `model.cuda_graph_scope` cannot capture safely (moevlm.parallel.cuda_graphs), each with its reason."""
    from moevlm.parallel.cuda_graphs import scope_problem

    m, scope = job.model, [str(s) for s in job.model.cuda_graph_scope]
    if not scope:
        return
    key = f"model.cuda_graph_scope={_scope(m)}"
    problem = scope_problem(scope)
    _check(problem is None, f"{problem}")
    refusals = [
        (dims.world > 1 and job.parallel.dp_mode == "fsdp",
         "cannot run under FSDP (parallel.dp_mode=fsdp over several processes): FSDP2 frees the unsharded "
         "parameters after each use and allocates them again at the next all-gather, so their addresses change "
         "under a captured graph; use parallel.dp_mode=ddp"),
        (dims.pp > 1, "cannot run with pipeline parallel (parallel.pp>1): a schedule runs several micro-batches' "
         "forwards before their backwards, and each replay overwrites the graph's saved activations and outputs; "
         "use parallel.pp=1"),
        (dims.tp * dims.cp > 1, "cannot capture the tensor/context-parallel collectives; use parallel.tp=1 and cp=1"),
        (bool(job.train.compile),
         "and train.compile=true both capture the same code (torch.compile brings its own CUDA graphs); "
         "choose one"),
        (m.recompute != "none",
         "cannot run with model.recompute (recompute re-runs a graphed forward inside backward, which is not "
         "verified); use model.recompute=none"),
        (("attn" in scope or "full_layer" in scope) and m.attn_backend != "sdpa",
         f"captures attention with the sdpa backend only (its (B,1,S,S) mask is static; flash and varlen take "
         f"cu_seqlens of varying length, flex a block mask); model.attn_backend={m.attn_backend}: set "
         "model.attn_backend=sdpa"),
        ("full_layer" in scope and dims.ep * dims.etp > 1,
         "full_layer needs a static, sync-free layer, but the alltoall dispatcher (parallel.ep x etp > 1) moves a "
         "data-dependent number of tokens after a host sync; the capacity-bounded alltoall arrives with issue 18: "
         "until then use attn, moe_router, moe_preprocess"),
        ("full_layer" in scope and m.grouped_gemm == "loop",
         "full_layer cannot capture model.grouped_gemm=loop (it splits rows on the host); use torch or triton"),
        ("moe_preprocess" in scope and m.permute != "torch",
         "moe_preprocess captures the torch permutation plan; model.permute=triton builds its plan inside its "
         "kernels: use model.permute=torch or leave moe_preprocess out"),
        (bool({"moe_router", "moe_preprocess"} & set(scope)) and not model.moe.num_experts,
         "moe_router/moe_preprocess: this model has no MoE layers (model.num_experts=0); leave them out"),
    ]
    _check(not any(bad for bad, _ in refusals), "\n".join(f"{key} {why}" for bad, why in refusals if bad))


def _check_fp8(job, model: VLMConfig, dims: ParallelDims, environment: bool) -> None:
    """What model.fp8 cannot run with, then (with `environment`) whether its kernels run on this device."""
    f, m = model.fp8, job.model
    if f.recipe == "none":
        return
    key = f"model.fp8={f.recipe}"
    experts = "experts" in f.modules and model.moe.num_experts > 0
    refusals = [
        (bool(m.cuda_graph_scope), "with model.cuda_graph_scope: a graph would replay the weight codes of the step "
         "it was captured in; use model.cuda_graph_scope=[]"),
        (bool(job.train.compile), "with train.compile=true is not supported yet (the FP8 autograd rule keeps "
         "per-step weight codes on the modules, which torch.compile would trace as constants); use "
         "train.compile=false"),
        (experts and (f.pad_experts or f.backend == "torch") and dims.ep * dims.etp > 1
         and model.moe.dispatcher != "hybridep",
         "pads expert rows (model.fp8_pad_experts, or fp8_backend=torch) with the local and hybridep dispatchers "
         "only; with parallel.ep x etp > 1 use model.dispatcher=hybridep, or model.fp8_backend=triton without "
         "padding"),
    ]
    _check(not any(bad for bad, _ in refusals), "\n".join(f"{key} {why}" for bad, why in refusals if bad))
    if f.backend == "torch":
        t, moe = model.text, model.moe
        block = BLOCK[f.recipe]
        dims_ = {"text.hidden_size": t.hidden_size, "text.intermediate_size": t.intermediate_size,
                 "moe.moe_intermediate_size": moe.moe_intermediate_size, "text.num_kv_heads*head_dim":
                 t.num_kv_heads * t.head_dim}
        bad = {k: v for k, v in dims_.items() if v % block}
        _check(not bad, f"{key} with model.fp8_backend=torch: cuBLAS's scaled GEMMs take whole {block}-blocks, but "
                        f"{bad} are not multiples of {block}; use model.fp8_backend=triton or emulate")
    if environment:
        from moevlm.model.fp8 import Fp8Unavailable, resolve_fp8
        cuda = torch.cuda.is_available() and job.train.device != "cpu"
        try:
            resolve_fp8(f, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
        except Fp8Unavailable as err:
            raise ConfigError(str(err)) from None


def _check_batch(t, dims: ParallelDims) -> None:
    _check(t.steps >= 1, f"train.steps={t.steps} must be >= 1")
    _check(t.micro_batch_size >= 1, f"train.micro_batch_size={t.micro_batch_size} must be >= 1")
    per_step = t.micro_batch_size * dims.dp
    _check(t.global_batch_size >= per_step and t.global_batch_size % per_step == 0,
           f"train.global_batch_size={t.global_batch_size} must be a multiple of micro_batch_size x dp = "
           f"{t.micro_batch_size} x {dims.dp} = {per_step}; e.g. train.global_batch_size="
           f"{max(1, math.ceil(t.global_batch_size / per_step)) * per_step}")
    _check(t.log_every >= 1, f"train.log_every={t.log_every} must be >= 1")
    _check(t.checkpoint_every >= 0, f"train.checkpoint_every={t.checkpoint_every} must be >= 0 (0 = at the end)")
    _check(t.resume in ("auto", "none") or bool(t.resume), "train.resume must be auto, none or a checkpoint path")
    _check(t.max_nonfinite_steps >= 1, f"train.max_nonfinite_steps={t.max_nonfinite_steps} must be >= 1")
    _check(t.peak_tflops is None or _real(t.peak_tflops) and t.peak_tflops > 0,
           f"train.peak_tflops={t.peak_tflops!r} must be a finite number > 0 (TFLOP/s per device), or null for "
           "the device table")


def _check_optim(o, steps: int) -> list[str]:
    """Every real-valued field must be a finite number in its range: Python's comparisons are False for
    NaN, so each range test is written to fail on it, and infinities are refused by name.  Returns notes
    (valid but probably unintended settings) for the log."""
    _check(_real(o.lr) and o.lr > 0, f"optim.lr={o.lr!r} must be a finite number > 0")
    _check(_real(o.min_lr_ratio) and 0 <= o.min_lr_ratio <= 1,
           f"optim.min_lr_ratio={o.min_lr_ratio!r} must be a number in [0, 1] (final lr = lr x min_lr_ratio)")
    betas = list(o.betas)
    _check(len(betas) == 2 and all(_real(b) and 0 <= b < 1 for b in betas),
           f"optim.betas={betas} must be two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]")
    _check(_real(o.eps) and o.eps > 0,
           f"optim.eps={o.eps!r} must be a finite number > 0 (AdamW divides by sqrt(v) + eps), e.g. optim.eps=1e-8")
    _check(_real(o.weight_decay) and o.weight_decay >= 0,
           f"optim.weight_decay={o.weight_decay!r} must be a finite number >= 0 (0 = no decay)")
    _check(_int(o.warmup_steps) and o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps!r} must be >= 0")
    _check(_real(o.decay_fraction) and 0 < o.decay_fraction <= 1,
           f"optim.decay_fraction={o.decay_fraction!r} must be a number in (0, 1]")
    _check(_real(o.grad_clip),
           f"optim.grad_clip={o.grad_clip!r} must be a finite number (the max gradient norm; 0 or less disables "
           "clipping)")
    if o.warmup_steps > steps:  # the multiplier after warmup step s is (s + 1) / warmup: 1 at s = warmup - 1
        return [f"note: optim.warmup_steps={o.warmup_steps} > train.steps={steps}: the learning rate never "
                f"reaches optim.lr={o.lr} in this run"]
    return []


def _check_faults(p, t) -> None:
    _check(_real(p.timeout_s) and p.timeout_s > 0, f"parallel.timeout_s={p.timeout_s} must be > 0 seconds (torch's NCCL default is 600)")
    _check(_real(t.watchdog_factor) and (t.watchdog_factor == 0 or t.watchdog_factor > 1),
           f"train.watchdog_factor={t.watchdog_factor} must be > 1 (x the median step time) or 0 (no reports)")
    _check(_real(t.watchdog_min_s) and t.watchdog_min_s >= 0, f"train.watchdog_min_s={t.watchdog_min_s} must be >= 0")
    _check(t.watchdog_abort_s is None or _real(t.watchdog_abort_s) and t.watchdog_abort_s > 0,
           f"train.watchdog_abort_s={t.watchdog_abort_s} must be > 0 seconds, or null (never abort)")


def _check_profile(t) -> None:
    parse_profile_steps(t.profile_steps, t.steps)
    _check(not (t.profile_components and t.compile),
           "train.profile_components=true times modules with hooks, which would break the graphs of "
           "train.compile=true; profile eagerly (train.compile=false), or drop train.profile_components")


def _check_data(d: DataConfig, model: VLMConfig, dims: ParallelDims) -> None:
    _check(d.shards not in ("", MISSING),
           "data.shards is not set: point it at WebDataset shards (a folder, a brace pattern or a list; build them "
           "with python -m moevlm.data.build_shards) or use data.shards=sample for the embedded sample set")
    try:
        check_data_config(d, model, dims.dp)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    pk = d.pack
    _check(pk.seq_len <= model.text.max_position_embeddings,
           f"data.pack.seq_len={pk.seq_len} exceeds the model's max_position_embeddings="
           f"{model.text.max_position_embeddings}")
    if dims.cp == 1:
        _check(pk.seq_len % dims.tp == 0, f"data.pack.seq_len={pk.seq_len} must be divisible by tp={dims.tp} "
                                          "(sequence parallel)")
    else:
        _check(pk.seq_len % (2 * dims.cp) == 0 and (pk.seq_len // dims.cp) % dims.tp == 0,
               f"data.pack.seq_len={pk.seq_len} must be divisible by 2*cp={2 * dims.cp} (each row is cut into 2*cp "
               f"chunks for load-balanced context parallel) and seq_len/cp by tp={dims.tp} (sequence parallel): "
               f"use a multiple of {math.lcm(2 * dims.cp, dims.cp * dims.tp)}")


CP_ATTN_BACKENDS = ("auto", "sdpa", "sdpa_per_doc")  # the decoder then runs cp_attention (SDPA blocks)


def _check_context_parallel(job, dims: ParallelDims) -> None:
    from moevlm.parallel.context_parallel import CP_COMMS

    p, m, t = job.parallel, job.model, job.train
    _check(p.cp_comm in CP_COMMS, f"parallel.cp_comm={p.cp_comm!r}; choose one of {list(CP_COMMS)}")
    if dims.cp == 1:
        return
    _check(m.attn_backend in CP_ATTN_BACKENDS,
           f"parallel.cp={dims.cp} computes the decoder's attention with its own allgather/ring function over SDPA "
           f"blocks; model.attn_backend={m.attn_backend} cannot run inside it: use model.attn_backend=auto or sdpa")
    _check(not t.compile, f"parallel.cp={dims.cp} with train.compile=true is not supported yet (the cp attention's "
                          "collectives are not traced); use train.compile=false")


# ---------------------------------------------------------------------- memory
BYTES_TRAINED = 16  # fp32 master weight 4 + fp32 gradient 4 (FSDP reduces in fp32) + AdamW exp_avg, exp_avg_sq 8
BYTES_FROZEN = 4  # a frozen weight: no gradient, no optimizer state
MEMORY_NOTE = 0.8  # above this share of the limit, a note: activations need the rest
# how each part of a decoder layer is sharded (see _divisors)
_LAYER_SHARDING = {"q_o": "tp", "k_v": "kv", "norms": "whole", "router": "whole", "experts": "experts",
                   "dense_mlp": "tp"}


@dataclass
class MemoryEstimate:
    """Weights, gradients and optimizer state on the fullest rank (activations not included)."""
    params: float  # parameters held by that rank (a shard counts its fraction)
    bytes: float
    total_params: int  # the whole model's

    def describe(self, layout: str = "") -> str:
        return (f"{self.bytes / 2**30:.1f} GiB per rank for weights, gradients and AdamW state "
                f"({self.params / 1e9:.3g}B of the model's {self.total_params / 1e9:.3g}B parameters"
                + (f"; {layout})" if layout else ")"))


def estimate_memory(job, plan: Plan) -> MemoryEstimate:
    """Per-rank bytes of parameters, gradients and AdamW state, from the config and the layout alone
    (nothing is built).  Each part is divided by its sharding (`_divisors`); under pipeline stages
    each pp rank holds its stages' layers, the first stage the vision tower and embedding, the last
    the final norm and LM head, and the fullest pp rank counts.  Not counted: activations, FSDP's
    transient all-gathered units, DDP's reduction buckets, uneven shard padding."""
    cfg, pipe = plan.model, plan.pipeline
    div = _divisors(job.parallel.dp_mode, plan.dims, cfg)
    whole = parameter_counts(cfg)
    frozen_bytes = BYTES_FROZEN if job.model.freeze_vision else BYTES_TRAINED
    best = MemoryEstimate(0, 0, sum(whole.values()))
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
        est = MemoryEstimate(trained + vision, trained * BYTES_TRAINED + vision * frozen_bytes, best.total_params)
        best = max(best, est, key=lambda e: e.bytes)
    return best


def _divisors(dp_mode: str, dims: ParallelDims, cfg: VLMConfig) -> dict[str, int]:
    """Over how many ranks of a pipeline stage each kind of weight is split.  FSDP shards the dense
    weights over dp x cp (after TP's split) and the experts over edp (after EP's and ETP's); DDP keeps
    them whole per rank.  TP splits attention q/o, the dense MLP, the embedding and the LM head, and
    k/v when there are at least tp kv heads; norms and the router stay whole per tp rank.  The vision
    tower is not tensor parallel; FSDP shards it over dp x cp x tp."""
    shard = dims.dp * dims.cp if dp_mode == "fsdp" else 1
    return {"tp": dims.tp * shard, "kv": (dims.tp if cfg.text.num_kv_heads >= dims.tp else 1) * shard,
            "whole": shard, "vision": dims.tp * shard if dp_mode == "fsdp" else 1,
            "experts": dims.ep * dims.etp * (dims.edp if dp_mode == "fsdp" else 1)}


def check_memory(job, plan: Plan, limit: float | None, where: str = "the device") -> MemoryEstimate:
    """Refuse a job whose weights, gradients and AdamW state alone exceed `limit` bytes per rank (the
    trainer passes the device's free memory: `memory_limit`), before any model is built; above
    MEMORY_NOTE of it, add a note to `plan.notes`.  `limit=None` checks nothing."""
    est = estimate_memory(job, plan)
    if limit is None:
        return est
    have = f"{where} has {limit / 2**30:.1f} GiB"
    _check(est.bytes <= limit,
           f"the model needs about {est.describe(plan.dims.describe())} but {have}; use fewer layers or "
           "experts (model.num_layers, model.num_experts) or shard more (more GPUs, parallel.dp_mode=fsdp, "
           "parallel.ep, parallel.pp)")
    if est.bytes > MEMORY_NOTE * limit:
        plan.notes.append(f"note: the model needs about {est.describe()}, {100 * est.bytes / limit:.0f}% of what "
                          f"{have}; activations need the rest")
    return est


def memory_limit(device) -> tuple[float, str]:
    """(bytes one rank may use, where they come from): a GPU's free memory (torch.cuda.mem_get_info), or
    on the CPU the machine's available memory (/proc/meminfo MemAvailable) shared by the ranks on this
    node (LOCAL_WORLD_SIZE).  (None, ...) when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else \
            int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())
        return float(torch.cuda.mem_get_info(index)[0]), f"cuda:{index} (free memory)"
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None, "the host"
    share = f" shared by {ranks} ranks" if ranks > 1 else ""
    return kib * 1024.0 / ranks, f"this machine (available memory{share})"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _real(value) -> bool:
    """A finite int or float (not bool, not NaN, not +-inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
