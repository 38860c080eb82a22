"""The job's `parallel`, `optim` and `train` sections (the `data` section is moevlm.data.DataConfig,
the `model` section moevlm.config.model_section.ModelConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from moevlm.fields import one_of
from moevlm.parallel.cp_attention import COMMS as CP_COMMS
from moevlm.parallel.pipeline_schedules import SCHEDULES, schedule_name

# train.resume_allow_changes: what a resume refuses unless told (moevlm.train.checkpoint.record)
RESUME_CHANGES = ("tokenizer", "architecture")
WANDB_MODES = ("disabled", "online", "offline")  # train.wandb (moevlm.train.wandb_log)
GPUS = (
    "h100",
    "h200",
    "b200",
    "gb200",
)  # parallel.fake_gpu: the planner's device table (moevlm.plan.devices)


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
    cp_comm: one_of(*CP_COMMS) = field(
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
    dp_mode: one_of("fsdp", "ddp") = field(
        default="fsdp",
        metadata={
            "help": "data parallel: fsdp (FSDP2, weights/gradients/optimizer state sharded) or ddp (replicated)"
        },
    )
    reduce_dtype: one_of("float32", "bfloat16") = field(
        default="float32",
        metadata={
            "help": "dtype of the data-parallel gradient reductions: float32 or bfloat16 (half the traffic, "
            "sums rounded to bf16). FSDP2's MixedPrecisionPolicy.reduce_dtype (the gradients are then kept in "
            "the weights' dtype), the dtype of DDP's all-reduce buckets and of the tensor-parallel sums of "
            "partial gradients"
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
    pp_schedule: one_of(*SCHEDULES, checked_by=schedule_name) = field(
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
            "recipe's parallel shape is kept (moevlm/config/scale.py)"
        },
    )
    backend: one_of("auto", "nccl", "gloo") = field(
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
    fake_gpu: one_of(*GPUS) = field(
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
    implementation: one_of("auto", "fused", "foreach", "for_loop") = field(
        default="auto",
        metadata={
            "help": "AdamW implementation: auto (fused where the device has the kernel, else foreach), fused, foreach, "
            "for_loop"
        },
    )
    state_dtype: one_of("float32", "bfloat16") = field(
        default="float32",
        metadata={
            "help": "dtype of the AdamW moments: float32 (torch's AdamW) or bfloat16 (moevlm/train/adamw.py: "
            "4 bytes a parameter less; each step reads them up to fp32, updates in fp32 and writes them back "
            "rounded to nearest; with beta2 near 1 the second moment's small increments round away, keep "
            "betas[1] <= 0.99). Not with optim.implementation=fused"
        },
    )
    master_weights: bool = field(
        default=False,
        metadata={
            "help": "the model's weights in bf16 (what the forward computes with, what FSDP gathers) and an fp32 "
            "master of this rank's shard held by the optimizer (moevlm/parallel/master_weights.py): gradients "
            "arrive in bf16 (reduced in parallel.reduce_dtype), the AdamW update runs on the master, the result "
            "is copied down to the weights; checkpoints hold the masters, HF export the bf16 weights. Needs "
            "bf16 compute (train.precision=bf16, or auto on CUDA); not with parallel.optimizer_offload or "
            "parallel.pp > 1"
        },
    )
    schedule: one_of("cosine", "wsd", "constant") = field(
        default="cosine",
        metadata={
            "help": "learning rate after the linear warmup: cosine, wsd (warmup-stable-decay), constant"
        },
    )
    warmup_steps: int = field(default=0, metadata={"help": "steps of linear warmup up to lr"})
    decay_fraction: float = field(
        default=0.2, metadata={"help": "wsd: the last fraction of steps decays, in (0, 1]"}
    )
    decay_shape: one_of("linear", "cosine", "sqrt") = field(
        default="linear", metadata={"help": "wsd: the decay's shape"}
    )
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
    precision: one_of("auto", "fp32", "bf16") = field(
        default="auto",
        metadata={
            "help": "compute precision: auto (bf16 autocast on CUDA, fp32 on CPU), fp32, bf16"
        },
    )
    device: one_of("auto", "cpu", "cuda") = field(
        default="auto", metadata={"help": "auto (CUDA when available), cpu, cuda"}
    )
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
    resume_allow_changes: List[
        one_of(*RESUME_CHANGES, checked_by="moevlm.config.train_checks.check_batch")
    ] = field(
        default_factory=list,
        metadata={
            "help": "what a resume may change that it otherwise refuses (exit 7): tokenizer (another "
            "vocabulary: a sha256 of the tokenizer's vocabulary, merges and added tokens differs from "
            "the checkpoint's), architecture (the model's config: family, shapes, routing); every "
            "change is logged as `resume: <key>: <old> -> <new>` either way; [] = refuse both"
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
    export_adapter: str = field(
        default="",
        metadata={
            "help": "with model.lora_rank > 0: a folder to write the final adapters to in PEFT's format "
            "(adapter_config.json, adapter_model.safetensors; moevlm.model.lora); empty = none"
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
    wandb: one_of(*WANDB_MODES) = field(
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
    nonfinite: one_of("skip", "stop") = field(
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
    compile_mode: one_of("default", "max-autotune-no-cudagraphs") = field(
        default="default",
        metadata={
            "help": "torch.compile mode with train.compile: default or max-autotune-no-cudagraphs (CUDA graphs are "
            "model.cuda_graph_scope's)"
        },
    )
    cuda_graph: one_of("off", "step") = field(
        default="off",
        metadata={
            "help": "step: after train.cuda_graph_warmup eager steps, capture the whole step (every micro-batch's "
            "forward and backward, the gradient reduction and clip as one CUDA graph, the optimizer step as a "
            "second) and replay it (moevlm/train/step_graph.py); text rows with images or videos, on one GPU or "
            "under FSDP2, HSDP or DDP"
        },
    )
    cuda_graph_warmup: int = field(
        default=3,
        metadata={
            "help": "train.cuda_graph=step: eager steps (on a side stream) before the capture"
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
