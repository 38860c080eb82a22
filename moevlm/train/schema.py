"""The job's schema: typed dataclasses registered in Hydra's ConfigStore, filled by the YAML
groups in `conf/` and the command line, and the model config they compose.

    python train.py                                   # embedded CPU default
    torchrun --nproc-per-node 8 train.py +experiment=h100_fsdp data.shards=...
    python train.py -m optim.lr=1e-3,3e-4             # a sweep: one job each

Design choices:
- Sections mirror the groups: `model`, `data` (moevlm.data.DataConfig), `parallel`, `optim`,
  `train`.  An experiment (`conf/experiment/*.yaml`, `# @package _global_`) picks groups and sets
  fields, named by hardware and parallelism.
- Each field's description is its `field(metadata={"help": ...})` and each section's its class
  docstring: the one source of `python train.py --help` and conf/README.md (moevlm.train.options).
- One config tree.  The names users type (`model.moe_capacity_factor=1.25`, `model.fp8=blockwise`,
  `model.dispatcher=alltoall`) are the public interface and stay flat: nesting the job's model
  section as the model's own objects would move every key of every recipe and command line to an
  alias, and `model.fp8` cannot be both a value and a section in Hydra.  Instead each model field
  says which field of moevlm.model.VLMConfig it is (`metadata={"sets": "moe.capacity_factor"}`;
  `edits` for a proxy that is applied only when not null), `--help` shows it, and `model_config`
  applies every declaration with one loop: no copy table.  The same declarations read a
  VLMConfig error back in the names the user typed (`in_job_keys`), so each rule on a model
  field is checked once, by `VLMConfig.validate` (the boundary library callers meet too).
- The model is a preset (torchtitan's "flavor") or an HF `config.json`, plus a few proxy knobs
  (`num_layers`, `num_experts`, `vision_depth`) so a recipe can shrink the real architecture to
  fit its hardware.
- The batch is layout independent: `train.global_batch_size` packed rows per optimizer step =
  micro_batch_size x grad accumulation x dp; accumulation is derived, and `data.streams` fixes
  which rows form a global batch whatever the layout (see moevlm.data.loader).
- Validation (moevlm.train.validate) and the memory estimate (moevlm.train.memory) read these
  objects; moevlm.train.config gathers the three for importers.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from moevlm.data.config import DataConfig
from moevlm.errors import ConfigError
from moevlm.model.config import VLMConfig
from moevlm.train.wandb_log import MODES as WANDB_MODES


@dataclass
class ModelConfig:
    """The network: a preset or an HF config, proxy knobs that shrink it, kernel and dispatcher backends. An
    option marked [VLMConfig.x] is field x of the model config (moevlm.model.VLMConfig), under the name the
    model and the dispatcher read."""

    preset: str = field(
        default="tiny",
        metadata={"help": "the architecture by name (ignored when hf_config is set)"},
    )
    hf_config: str = field(
        default="",
        metadata={
            "help": "an HF Qwen3-VL-MoE config.json (or its folder) as the architecture; empty = model.preset"
        },
    )
    hf_checkpoint: str = field(
        default="",
        metadata={"help": "an HF folder (safetensors) to load weights from; empty = random init"},
    )
    num_layers: Optional[int] = field(
        default=None,
        metadata={
            "edits": "text.num_layers",
            "help": "proxy: fewer decoder layers; null = the model's own",
        },
    )
    num_experts: Optional[int] = field(
        default=None,
        metadata={
            "edits": "moe.num_experts",
            "help": "proxy: fewer experts (0: a dense MLP in every layer); null = the model's own",
        },
    )
    vision_depth: Optional[int] = field(
        default=None,
        metadata={
            "edits": "vision.depth",
            "help": "proxy: fewer vision blocks (deepstack taps beyond it dropped); null = the model's own",
        },
    )
    # the token ids: a randomly initialised model can take the ids of the data's tokenizer (the sample
    # set's tiny BPE with a large model's proxy); a checkpoint's model keeps its own
    vocab_size: Optional[int] = field(
        default=None,
        metadata={
            "edits": "text.vocab_size",
            "help": "the vocabulary (embedding and output rows): at least the tokenizer's ids; null = the "
            "model's own",
        },
    )
    image_token_id: Optional[int] = field(
        default=None,
        metadata={
            "edits": "image_token_id",
            "help": "the tokenizer's <|image_pad|> id; null = the model's own",
        },
    )
    video_token_id: Optional[int] = field(
        default=None,
        metadata={
            "edits": "video_token_id",
            "help": "the tokenizer's <|video_pad|> id; null = the model's own",
        },
    )
    vision_start_token_id: Optional[int] = field(
        default=None,
        metadata={
            "edits": "vision_start_token_id",
            "help": "the tokenizer's <|vision_start|> id; null = the model's own",
        },
    )
    vision_end_token_id: Optional[int] = field(
        default=None,
        metadata={
            "edits": "vision_end_token_id",
            "help": "the tokenizer's <|vision_end|> id; null = the model's own",
        },
    )
    attn_backend: str = field(
        default="auto",
        metadata={
            "sets": "attn_backend",
            "help": "attention kernel: auto (on CUDA in bf16/fp16 the first available of flash, varlen, flex, sdpa; "
            "sdpa on CUDA in fp32; on the CPU sdpa_per_doc, or sdpa under train.compile), sdpa (one call, dense "
            "document mask), sdpa_per_doc (one call per document: only the useful scores, a host loop), flex "
            "(FlexAttention), flash (flash-attn varlen), varlen (torch.nn.attention.varlen, CUDA only, no extra "
            "package)",
        },
    )
    grouped_gemm: str = field(
        default="torch",
        metadata={
            "sets": "moe.grouped_gemm",
            "help": "expert GEMM: torch (torch._grouped_mm), loop (one matmul per expert, the reference), triton "
            "(ours; needs the triton package)",
        },
    )
    dispatcher: str = field(
        default="auto",
        metadata={
            "sets": "moe.dispatcher",
            "help": "how tokens reach their experts (moevlm.dispatch): auto (local when parallel.ep x etp == 1, else "
            "alltoall), local (no expert parallelism, parallel.ep=1), alltoall, deepep (DeepEP's V2 ElasticBuffer, "
            "else its V1 Buffer: needs the deep_ep package, CUDA only, and an EP group of 2, 4, 8 or a "
            "multiple of 8 ranks), hybridep "
            "(DeepEP's hybrid-ep branch, HybridEPBuffer: CUDA only, experts-per-rank x ranks-per-node a multiple "
            "of 4); neither was run on a real GPU cluster by moevlm yet; one that cannot run is refused, or "
            "replaced as model.dispatcher_fallback says",
        },
    )
    dispatcher_fallback: str = field(
        default="none",
        metadata={
            "help": "when model.dispatcher (deepep, hybridep) cannot run here (package missing or broken, adapter not "
            "built, or a layout it cannot take): none (refuse with the reason) or alltoall (run the alltoall "
            "dispatcher instead; one note in the start-up log says why)"
        },
    )
    permute: str = field(
        default="torch",
        metadata={
            "sets": "moe.permute",
            "help": "token permute/unpermute around the experts: torch, or triton (fused kernels)",
        },
    )
    moe_capacity_factor: Optional[float] = field(
        default=None,
        metadata={
            "sets": "moe.capacity_factor",
            "help": "null = dropless (exact; the alltoall dispatcher syncs with the host once per MoE layer). A number "
            "f > 0: the capacity all-to-all (moevlm.dispatch.capacity): each rank sends each expert at most "
            "C = ceil(f x tokens x top_k / num_experts) rows through fixed-size buffers, no host sync; "
            "choices over C are dropped (the earliest tokens kept) and logged as moe_dropped_tokens in "
            "metrics.jsonl. Needs the alltoall dispatcher (model.dispatcher=alltoall, or auto with "
            "parallel.ep > 1) or hybridep (a static num_permuted_tokens of E x C rows per receiving rank; "
            "HybridEP drops the last permuted rows and flags it), and parallel.etp=1",
        },
    )
    moe_capacity_overflow: str = field(
        default="drop",
        metadata={
            "sets": "moe.capacity_overflow",
            "help": "with model.moe_capacity_factor: drop (drop and count the choices over capacity) or error (the "
            "step fails, naming the fix, when any choice is dropped)",
        },
    )
    deepep_api: str = field(
        default="auto",
        metadata={
            "sets": "moe.deepep_api",
            "help": "with model.dispatcher=deepep: which DeepEP API drives it: auto (V2's ElasticBuffer where the "
            "installed deep_ep has it, else V1's Buffer), v2, or v1 (EP sizes 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, "
            "144, 160 only, 8 ranks per node across nodes)",
        },
    )
    dispatcher_max_tokens_per_rank: Optional[int] = field(
        default=None,
        metadata={
            "sets": "moe.dispatcher_max_tokens_per_rank",
            "help": "with model.dispatcher=deepep (V2) or hybridep: a fixed bound on the tokens any rank dispatches "
            "per MoE layer (micro_batch_size x seq_len), so no all-reduce of token counts runs per layer; a larger "
            "count fails the step; null = the group's largest count, all-reduced each time",
        },
    )
    dispatcher_num_sms: int = field(
        default=0,
        metadata={
            "sets": "moe.dispatcher_num_sms",
            "help": "with model.dispatcher=deepep or hybridep: SMs their exchange kernels use (even); 0 = the "
            "backend's choice (DeepEP V1: 20; V2: its estimate, 24 where it cannot detect the RDMA bandwidth; "
            "HybridEP: its defaults)",
        },
    )
    moe_aux_loss: str = field(
        default="micro_batch",
        metadata={
            "sets": "moe.aux_loss",
            "help": "the load-balancing loss's form (weight model.aux_loss_coef): micro_batch (the reference's: "
            "expert frequencies and mean probabilities of each micro-batch, pooled over layers), global_batch "
            "(the micro-batch's mean probabilities weighted by the frequencies of the step's micro-batches so "
            "far over every data-parallel rank, in global row order: moevlm.parallel.balance), sequence "
            "(DeepSeek-V3's sequence-wise loss: per layer and per packed document, averaged)",
        },
    )
    moe_router_bias_rate: float = field(
        default=0.0,
        metadata={
            "sets": "moe.router_bias_rate",
            "help": "aux-loss-free balancing (DeepSeek-V3), 0 = off: a per-expert bias added to the router "
            "probabilities for the choice of experts only, moved after every optimizer step by "
            "bias += rate x sign(mean load - load) from the step's load (all micro-batches and data-parallel "
            "ranks); saved in training checkpoints, never exported. Combine with model.aux_loss_coef=0 for "
            "DeepSeek-V3's recipe",
        },
    )
    moe_z_loss_coeff: float = field(
        default=0.0,
        metadata={
            "sets": "moe.z_loss_coeff",
            "help": "router z-loss weight, 0 = off: coeff x the mean over tokens of logsumexp(router logits)^2, "
            "summed over MoE layers and averaged over the step's micro-batches like the aux loss",
        },
    )
    moe_router_force_balance: bool = field(
        default=False,
        metadata={
            "sets": "moe.router_force_balance",
            "help": "benchmarks only: every MoE layer routes its tokens evenly (the token at position p of its "
            "sequence to experts (p x top_k + j) mod num_experts, the same under any split of the sequence) "
            "whatever the router scores, as published force-balanced throughputs are measured; logged at "
            "start and marked moe_router_force_balance in every metrics record",
        },
    )
    aux_loss_coef: Optional[float] = field(
        default=None,
        metadata={
            "edits": "moe.router_aux_loss_coef",
            "help": "router load-balancing loss weight (0 turns it off); null = the checkpoint's router_aux_loss_coef",
        },
    )
    freeze_vision: bool = field(
        default=False,
        metadata={
            "help": "the whole vision module (tower, merger, deepstack mergers) runs forward only, no gradients"
        },
    )
    recompute: str = field(
        default="none",
        metadata={
            "help": "activation recompute in backward: none, selective (the regions of model.recompute_modules), full "
            "(each decoder layer and vision block whole); collective outputs are kept, never re-run"
        },
    )
    recompute_modules: List[str] = field(
        default_factory=lambda: ["core_attn"],
        metadata={
            "help": "regions recomputed when model.recompute=selective (ignored otherwise): core_attn (attention "
            "kernel), layernorm, mlp (dense MLPs: mlp_only_layers and vision), moe_act (experts' SwiGLU), moe "
            "(whole MoE block), vision (each vision block)"
        },
    )
    offload_modules: List[str] = field(
        default_factory=list,
        metadata={
            "help": "scopes whose activations saved for backward go to pinned host memory in forward and come back "
            "(prefetched one scope ahead, on a side stream) in backward (moevlm/parallel/offload.py): layer_input "
            "(each decoder layer's input, e.g. the one model.recompute=full keeps), core_attn, mlp, moe_act, moe, "
            "vision; a tensor recomputed in backward is never offloaded; [] = none"
        },
    )
    fp8: str = field(
        default="none",
        metadata={
            "sets": "fp8.recipe",
            "help": "FP8 training of the linears in model.fp8_modules: none, blockwise (Hopper recipe: e4m3, 1x128 "
            "activation tiles, 128x128 weight blocks, fp32 scales) or mxfp8 (Blackwell: 1x32 blocks, e8m0 "
            "scales); fp32 master weights, the router always fp32 (moevlm.model.fp8)",
        },
    )
    fp8_modules: List[str] = field(
        default_factory=lambda: ["experts", "attn", "mlp"],
        metadata={
            "sets": "fp8.modules",
            "help": "what runs in FP8 when model.fp8 is set: experts (grouped GEMMs), attn (decoder q/k/v/o), mlp "
            "(decoder dense MLPs), vision (vision blocks and mergers); router, norms, embeddings and LM head "
            "never",
        },
    )
    fp8_backend: str = field(
        default="auto",
        metadata={
            "sets": "fp8.backend",
            "help": "FP8 kernels: auto (blockwise: ours on sm89+; mxfp8: torch where the probe finds Blackwell's "
            "paths; refused on the CPU), triton (ours, blockwise), torch (torch._scaled_mm / _scaled_grouped_mm "
            "where a probe finds them; pads expert rows), emulate (dequantize, fp64 GEMM: the recipe's numerics "
            "anywhere, slow)",
        },
    )
    fp8_pow2_scales: bool = field(
        default=False,
        metadata={
            "sets": "fp8.pow2_scales",
            "help": "blockwise: scales rounded up to powers of two (rescaling exact)",
        },
    )
    fp8_cache_weights: bool = field(
        default=True,
        metadata={
            "sets": "fp8.cache_weights",
            "help": "quantize each weight once per optimizer step and reuse it across micro-batches and backward (one "
            "byte per weight element kept until the step ends, unsharded under FSDP); false = at every use",
        },
    )
    fp8_pad_experts: bool = field(
        default=False,
        metadata={
            "sets": "fp8.pad_experts",
            "help": "pad each expert's rows to the scale block (128 / 32) so no weight-gradient scale block spans two "
            "experts (local dispatcher: up to block-1 zero rows per expert and a host sync per layer; hybridep: "
            "padded by HybridEP); "
            "fp8_backend=torch always pads",
        },
    )
    cuda_graph_scope: list = field(
        default_factory=list,
        metadata={
            "help": "decoder-layer regions captured as CUDA graphs at the first training step and replayed "
            "(moevlm.parallel.cuda_graphs): any of attn (norm, q/k/v, rope, sdpa, o_proj; needs "
            "attn_backend=sdpa), moe_router, moe_preprocess (the dispatcher's sort/counts before any "
            "exchange), or full_layer alone (the whole layer; local dispatcher only); [] = none. CUDA only"
        },
    )


@dataclass
class ParallelConfig:
    """The layout over the launched processes: tp x cp x dp x pp attention ranks, ep x etp x edp expert ranks."""

    tp: int = field(default=1, metadata={"help": "tensor (and sequence) parallel size"})
    cp: int = field(
        default=1,
        metadata={
            "help": "context parallel size: each packed row split over cp ranks (load-balanced: chunks r and "
            "2cp-1-r of 2cp), images encoded in shares and gathered"
        },
    )
    cp_comm: str = field(
        default="allgather",
        metadata={
            "help": "context parallel attention: allgather (gather the kv heads of the row, reduce-scatter their "
            "gradients) or ring (K/V blocks passed around the cp ranks, overlapped with compute)"
        },
    )
    pp: int = field(default=1, metadata={"help": "pipeline parallel size (stages over pp ranks)"})
    dp: int = field(
        default=-1, metadata={"help": "data parallel size; -1 = world / (pp * tp * cp)"}
    )
    ep: int = field(
        default=1, metadata={"help": "expert parallel size: experts split over ep ranks"}
    )
    etp: int = field(
        default=1, metadata={"help": "expert tensor parallel size: each expert's weights split"}
    )
    ep_overlap: bool = field(
        default=False,
        metadata={
            "help": "split each MoE block's micro-batch tokens in two chunks and overlap one chunk's all-to-all with "
            "the other's expert compute, forward and backward (moevlm/parallel/ep_overlap.py; same result). Needs "
            "parallel.ep > 1, "
            "etp=1, the alltoall dispatcher; with model.moe_capacity_factor each chunk has its own capacity"
        },
    )
    dp_mode: str = field(
        default="fsdp",
        metadata={
            "help": "data parallel: fsdp (FSDP2, weights/gradients/optimizer state sharded) or ddp (replicated)"
        },
    )
    optimizer_offload: bool = field(
        default=False,
        metadata={
            "help": "keep the optimizer state in host memory and step on the CPU (moevlm/parallel/optimizer_offload.py; "
            "same result). Under FSDP (several processes) FSDP2's CPU offload policy: the sharded fp32 "
            "parameters, their gradients and the AdamW state live on the host. Under DDP and one process an "
            "fp32 master copy and the AdamW state on the host; gradients go device->host after clipping, the "
            "updated weights host->device"
        },
    )
    dp_replicate: int = field(
        default=1,
        metadata={
            "help": "HSDP: the data-parallel ranks as dp_replicate replicas x shard groups (FSDP2 on a 2-D mesh); "
            "weights, gradients and optimizer state sharded over dp/dp_replicate x cp (experts over "
            "edp/dp_replicate) within a replica, gradients all-reduced across replicas (the outer ranks, "
            "across nodes); 1 = FSDP over all of dp x cp. Must divide dp and edp; needs dp_mode=fsdp"
        },
    )
    pp_schedule: str = field(
        default="1f1b",
        metadata={
            "help": "pipeline schedule (torch.distributed.pipelining; the class names GPipe, 1F1B, Interleaved1F1B "
            "are accepted too)"
        },
    )
    vpp: Optional[int] = field(
        default=None,
        metadata={
            "help": "stages per pp rank; null = 1, or 2 for interleaved_1f1b / zbv / dualpipev"
        },
    )
    pp_layers: Any = field(
        default="auto",
        metadata={
            "help": "decoder layers per stage: auto (balanced by training FLOPs, the vision tower charged to stage 0) "
            "or a list, e.g. parallel.pp_layers=[20,28] (or the string \"'20,28'\")"
        },
    )
    world_size: Optional[int] = field(
        default=None,
        metadata={"help": "the recipe's GPU count, checked against the launch; null = any"},
    )
    scale_to: Optional[int] = field(
        default=None,
        metadata={
            "help": "+scale=cpu sets it: at most this many processes; dp (and ep if it must) shrink to fit, the "
            "recipe's parallel shape is kept (moevlm/train/scale.py)"
        },
    )
    backend: str = field(
        default="auto",
        metadata={"help": "process group backend: auto (nccl on CUDA, gloo on CPU), nccl, gloo"},
    )
    fake_world: int = field(
        default=0,
        metadata={
            "help": "N > 0: train nothing; plan the job on N ranks with fake tensors and a fake process group "
            "(one training step per rank role: memory and communication per rank, the fit on "
            "parallel.fake_gpu; `python -m moevlm.plan`) and exit, 0 when it fits, 1 when not. One process"
        },
    )
    fake_gpu: str = field(
        default="h100",
        metadata={
            "help": "the GPU parallel.fake_world checks the plan against: h100, h200, b200, gb200"
        },
    )
    timeout_s: float = field(
        default=600.0,
        metadata={
            "help": "seconds a collective may wait for its peers before the job ends with one clear line (exit 5); "
            "torch's NCCL default, long enough for a first-step compile or a large checkpoint write"
        },
    )


@dataclass
class OptimConfig:
    """AdamW, its weight-decay groups, the learning-rate schedule and gradient clipping."""

    lr: float = field(default=3e-4, metadata={"help": "peak learning rate (reached after warmup)"})
    min_lr_ratio: float = field(
        default=0.1, metadata={"help": "final lr = lr * min_lr_ratio, in [0, 1]"}
    )
    betas: tuple[float, float] = field(
        default=(0.9, 0.95),
        metadata={"help": "AdamW betas, two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]"},
    )
    eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon (added to sqrt(v)), > 0"})
    weight_decay: float = field(default=0.1, metadata={"help": "decoupled weight decay; 0 = none"})
    decay_norms_biases_embeddings: bool = field(
        default=False,
        metadata={
            "help": "weight decay on norms, biases and embeddings too (false: matrices only)"
        },
    )
    implementation: str = field(
        default="auto",
        metadata={
            "help": "AdamW implementation: auto (fused where the device has the kernel, else foreach), fused, foreach, "
            "for_loop"
        },
    )
    schedule: str = field(
        default="cosine",
        metadata={
            "help": "learning rate after the linear warmup: cosine, wsd (warmup-stable-decay), constant"
        },
    )
    warmup_steps: int = field(default=0, metadata={"help": "steps of linear warmup up to lr"})
    decay_fraction: float = field(
        default=0.2, metadata={"help": "wsd: the last fraction of steps decays, in (0, 1]"}
    )
    decay_shape: str = field(default="linear", metadata={"help": "wsd: the decay's shape"})
    grad_clip: float = field(
        default=1.0,
        metadata={
            "help": "max global gradient norm; <= 0 disables clipping (the norm is still logged)"
        },
    )


@dataclass
class TrainConfig:
    """The loop: steps, batch sizes, precision, run directory, checkpoints, logging, fault handling."""

    steps: int = field(default=20, metadata={"help": "optimizer steps to run"})
    global_batch_size: int = field(
        default=1,
        metadata={
            "help": "packed rows per optimizer step over all data-parallel ranks; a multiple of micro_batch_size x dp "
            "(the quotient is the gradient accumulation)"
        },
    )
    micro_batch_size: int = field(
        default=1, metadata={"help": "packed rows per forward/backward on one rank"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the weight init and the RNGs"})
    deterministic: bool = field(
        default=False, metadata={"help": "deterministic kernels (CPU runs repeat bitwise)"}
    )
    precision: str = field(
        default="auto",
        metadata={
            "help": "compute precision: auto (bf16 autocast on CUDA, fp32 on CPU), fp32, bf16"
        },
    )
    device: str = field(default="auto", metadata={"help": "auto (CUDA when available), cpu, cuda"})
    run_dir: str = field(
        default="",
        metadata={
            "help": "the run's directory (checkpoints, logs, metrics), one for all ranks; empty = "
            "outputs/<date>/<time>[/<sweep job>]"
        },
    )
    resume: str = field(
        default="auto",
        metadata={
            "help": "auto (the newest complete checkpoint in run_dir, if any), none, or a checkpoint path"
        },
    )
    checkpoint_every: int = field(
        default=0, metadata={"help": "steps between checkpoints; 0 = only at the end"}
    )
    keep_checkpoints: int = field(
        default=2, metadata={"help": "keep the last K complete checkpoints; <= 0 keeps all"}
    )
    checkpoint_at_end: bool = field(
        default=True, metadata={"help": "write a checkpoint after the last step"}
    )
    async_checkpoint: bool = field(
        default=False,
        metadata={
            "help": "write checkpoints in the background (DCP async_save): the state is copied to host "
            "memory, then training continues while it is written; complete (marker, checksums) only "
            "once written; the next save, the end or a stop signal waits for it"
        },
    )
    export_hf: str = field(
        default="",
        metadata={
            "help": "a folder to write the final weights to as HF safetensors; empty = no export"
        },
    )
    log_every: int = field(default=1, metadata={"help": "steps between metric log lines"})
    val_every: int = field(
        default=0,
        metadata={
            "help": "validate every N steps and after the last one: val_loss (summed token losses over their "
            "count) on the same held-out rows of data.val_shards each time, in that step's metrics line; 0 = off"
        },
    )
    val_batches: int = field(
        default=4,
        metadata={
            "help": "global batches (train.global_batch_size packed rows each) of held-out rows per validation"
        },
    )
    tensorboard: bool = field(
        default=True, metadata={"help": "write TensorBoard event files in run_dir"}
    )
    wandb: str = field(
        default="disabled",
        metadata={
            "help": "Weights & Biases logging (pip install wandb): disabled, online, or offline (<run_dir>/wandb, no "
            "network); entity, run name and tags from W&B's WANDB_ENTITY, WANDB_NAME, WANDB_TAGS"
        },
    )
    wandb_project: str = field(
        default="moevlm", metadata={"help": "the W&B project (train.wandb on)"}
    )
    progress: Optional[bool] = field(
        default=None, metadata={"help": "a progress bar; null = when stdout is a terminal"}
    )
    peak_tflops: Optional[float] = field(
        default=None,
        metadata={
            "help": "peak TFLOP/s per device for MFU; null = from the device table (MFU null when unknown)"
        },
    )
    nonfinite: str = field(
        default="skip",
        metadata={
            "help": "a NaN/inf loss or gradient: skip (the step is skipped and counted) or stop (checkpoint, message, "
            "exit 3)"
        },
    )
    max_nonfinite_steps: int = field(
        default=10, metadata={"help": "consecutive skipped non-finite steps before stopping anyway"}
    )
    require_loss_decrease: bool = field(
        default=False,
        metadata={
            "help": "exit 1 if the mean loss of the last 3 steps is not below that of the first 3"
        },
    )
    watchdog_factor: float = field(
        default=10.0,
        metadata={
            "help": "step watchdog: after 2 warm-up steps, a step longer than this x the median of the last 20 (and "
            "than watchdog_min_s) is reported with all threads' stacks; 0 = no reports"
        },
    )
    watchdog_min_s: float = field(
        default=60.0,
        metadata={"help": "step watchdog: steps shorter than this many seconds are never reported"},
    )
    watchdog_abort_s: Optional[float] = field(
        default=None,
        metadata={
            "help": "a step or checkpoint running longer than this many seconds ends the process (exit 6); null = never"
        },
    )
    compile: bool = field(
        default=False,
        metadata={
            "help": "torch.compile each vision block and decoder layer (moevlm/parallel/compile.py); metrics.jsonl "
            "then logs compiled_graphs, graph_breaks and recompiles (after step 1: should stay 0)"
        },
    )
    compile_mode: str = field(
        default="default",
        metadata={
            "help": "torch.compile mode with train.compile: default or max-autotune-no-cudagraphs (CUDA graphs are "
            "model.cuda_graph_scope's)"
        },
    )
    profile_components: bool = field(
        default=False,
        metadata={
            "help": "time each part of every step (data, vision encoder, merger, attention, router, dispatch, experts, "
            "combine, LM head + loss, backward, gradient reduction + clipping, optimizer, other): "
            "components_s in metrics.jsonl (sums over the log window) and profile_components.md at the end; "
            "CUDA events on a GPU (one sync per step); not with train.compile"
        },
    )
    profile_steps: Any = field(
        default="",
        metadata={
            "help": "a torch.profiler trace of steps A..B into <run_dir>/profile/rank<R>_steps<A>-<B>.json, e.g. "
            "train.profile_steps=[3,5] (or the string \"'3,5'\"); empty = no trace"
        },
    )


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
    """The job config as `train.py` would compose it (for notebooks and tests).  Unlike the command
    line, a list built in code may give a key again to change it: the last value wins, as in Hydra."""
    from hydra import compose, initialize_config_dir

    register_configs()
    check_overrides(overrides, repeats=False)
    config_dir = config_dir or os.path.join(os.path.dirname(__file__), "..", "..", "conf")
    with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base=None):
        return compose("config", overrides=list(overrides))


# allowed values of the job's own fields (a model field's are checked by VLMConfig.validate)
CHOICES = {
    "parallel.dp_mode": ("fsdp", "ddp"),
    "parallel.backend": ("auto", "nccl", "gloo"),
    "parallel.fake_gpu": ("h100", "h200", "b200", "gb200"),
    "optim.implementation": ("auto", "fused", "foreach", "for_loop"),
    "optim.schedule": ("cosine", "wsd", "constant"),
    "optim.decay_shape": ("linear", "cosine", "sqrt"),
    "train.precision": ("auto", "fp32", "bf16"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.nonfinite": ("skip", "stop"),
    "train.wandb": WANDB_MODES,
    "train.compile_mode": ("default", "max-autotune-no-cudagraphs"),
    "model.dispatcher_fallback": ("none", "alltoall"),
}


# ------------------------------------------------------------- the model config
def model_fields(m: ModelConfig | None = None) -> dict[str, str]:
    """`model.<key>` -> the VLMConfig field it is: every `sets` field, and the `edits` fields (proxies)
    that `m` sets (all of them when `m` is None)."""
    out = {}
    for f in dataclasses.fields(ModelConfig):
        path = f.metadata.get("sets") or f.metadata.get("edits")
        if path and ("sets" in f.metadata or m is None or getattr(m, f.name) is not None):
            out[f.name] = path
    return out


def model_config(m: ModelConfig) -> VLMConfig:
    """The model config `m` composes: the preset or HF config, then every declared field of `m`
    (`model_fields`) assigned by path, validated; a ConfigError speaks the job's keys."""
    _check_proxies(m)
    cfg = _hf_config(m.hf_config) if m.hf_config else VLMConfig.preset(m.preset)
    for key, path in model_fields(m).items():
        _assign(cfg, path, getattr(m, key))
    if m.num_layers is not None:  # dense layers and deepstack taps beyond a shrunk depth go with it
        cfg.moe.mlp_only_layers = tuple(i for i in cfg.moe.mlp_only_layers if i < m.num_layers)
    if m.vision_depth is not None:
        cfg.vision.deepstack_visual_indexes = tuple(
            i for i in cfg.vision.deepstack_visual_indexes if i < m.vision_depth
        )
    # resolved by validate() once the layout is known; one rank dispatches locally
    if cfg.moe.dispatcher == "auto":
        cfg.moe.dispatcher = "local"
    try:
        return cfg.validate()
    except ConfigError as err:
        raise ConfigError(in_job_keys(str(err), m)) from None


def _hf_config(path: str) -> VLMConfig:
    """model.hf_config read, or a ConfigError saying why not (missing, not JSON, not the model's keys)."""
    from moevlm.data.checks import shown_path

    key = f"model.hf_config={shown_path(path)}"
    _check(os.path.exists(path), f"{key} does not exist; give an HF config.json or its folder")
    try:
        return VLMConfig.from_hf(path)
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(
            f"{key} cannot be read as a Qwen3-VL-MoE config.json ({type(err).__name__}: "
            f"{' '.join(str(err).split())})"
        ) from None


def in_job_keys(message: str, m: ModelConfig) -> str:
    """`message` (from VLMConfig.validate) with each `path=value` a job field set written `model.<key>=value`."""
    for key, path in model_fields(m).items():
        message = re.sub(rf"(?<![\w.]){re.escape(path)}=", f"model.{key}=", message)
    return message


def _assign(cfg: VLMConfig, path: str, value) -> None:
    *parents, name = path.split(".")
    node = cfg
    for p in parents:
        node = getattr(node, p)
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    setattr(node, name, tuple(value) if isinstance(value, list) else value)


def _check_proxies(m: ModelConfig) -> None:
    """The proxy sizes, before they edit the architecture (0 experts is a proxy's own meaning: dense)."""
    for name, least, what in (
        ("num_layers", 1, ""),
        ("vision_depth", 1, ""),
        ("num_experts", 0, " (0: a dense MLP in every layer)"),
    ):
        value = getattr(m, name)
        _check(
            value is None or _int(value) and value >= least,
            f"model.{name}={value!r} must be an integer >= {least}{what}, or null for the model's own",
        )


# ------------------------------------------------------------- unknown keys
def check_overrides(overrides, repeats: bool = True) -> None:
    """Refuse a command-line override of a field the schema lacks, naming the nearest ones (Hydra's own
    refusal names neither the fields nor the model config's names); a VLMConfig path such as
    `model.moe.capacity_factor` is pointed at the job key that sets it.  With `repeats`, a key given
    twice too (on a command line a mistake, often the shell's brace expansion)."""
    from moevlm.train.options import options

    if repeats:
        _check_repeats(overrides)
    known = {o.path for o in options()}
    by_model_path = {f"model.{path}": f"model.{key}" for key, path in model_fields().items()}
    for item in overrides:
        key = _override_key(str(item))
        if key is None or key in known:
            continue
        near = (
            [by_model_path[key]]
            if key in by_model_path
            else difflib.get_close_matches(key, known, n=3)
        )
        raise ConfigError(
            f"{key} is not an option"
            + (f"; did you mean {' or '.join(near)}?" if near else "")
            + " (python train.py --help lists them all)"
        )


def _check_repeats(overrides) -> None:
    """A key given twice: Hydra would keep the last.  Shards given many times are almost always a brace
    pattern the shell expanded (`data.shards=/d/s-{000..009}.tar` unquoted): the quoted spec is shown."""
    from moevlm.data.reader import shard_spec

    given: dict[str, list[str]] = {}
    for item in overrides:
        if (key := _override_key(str(item))) is not None:
            given.setdefault(key, []).append(str(item).split("=", 1)[1])
    for key, values in given.items():
        if len(values) < 2:
            continue
        seen = ", ".join(values[:3]) + (", ..." if len(values) > 3 else "")
        if key.endswith("shards"):
            raise ConfigError(
                f"{key} is given {len(values)} times ({seen}): the shell expanded a brace pattern, and "
                f"only the last would be used; quote it: {key}=\"'{shard_spec(values)}'\""
            )
        raise ConfigError(
            f"{key} is given {len(values)} times ({seen}) and only the last would be used; give it once"
        )


def _override_key(item: str) -> str | None:
    """`section.field` of a plain override `section.field=value`; None for group choices, `+`/`~` edits,
    hydra.* and flags."""
    match = re.match(r"([A-Za-z_][\w.]*)=", item)
    if not match or "." not in match.group(1):
        return None
    key = match.group(1)
    return key if key.split(".")[0] in {f.name for f in dataclasses.fields(JobConfig)} else None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _real(value) -> bool:
    """A finite int or float (not bool, not NaN, not +-inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
