"""A training run set up from a job: `setup(job)` -> one `Run`, in stages that take what they need and
return what they make (nothing large is allocated before the config, the layout and the data are
checked):

    plan      validate + the memory estimate              (moevlm.config)
    launch    the device and the process group
    run dir   one directory for every rank, claimed        (moevlm.train.run_dir)
    log       metrics, TensorBoard, W&B, the notes
    model     built on meta for the layout, then the data, then materialized: HF weights or init
    optimizer AdamW and its schedule
    resume    the newest verified checkpoint, if any       (moevlm.train.checkpoint)
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from moevlm.config import JobPlan, check_memory, memory_limit, validate
from moevlm.data import merge_states
from moevlm.data.loader import NoData, build_loader
from moevlm.data.sample_cache import describe as describe_sample
from moevlm.data.sample_cache import ensure_sample
from moevlm.dispatch.capacity import OverflowCounter
from moevlm.errors import ConfigError
from moevlm.model.fp8 import install_weight_cache, weights_changed
from moevlm.model.linear import is_adapter
from moevlm.model.moe import Router
from moevlm.model.params import num_parameters
from moevlm.parallel import ParallelContext, build_model, init_parameters_, materialize_
from moevlm.parallel.balance import StepFrequencies
from moevlm.parallel.compile import CompileCounters
from moevlm.parallel.hf_io import ExportTargetError, check_export_target, load_hf_weights_
from moevlm.train.checkpoint import CheckpointError, CheckpointManager, read_marker, set_rng_state
from moevlm.train.checkpoint.base import base_identity, check_base
from moevlm.train.checkpoint.record import launch_record, refusal, resume_changes
from moevlm.train.evaluate import HeldOut
from moevlm.train.exit_codes import ExitCode
from moevlm.train.faults import Faults, StepWatchdog
from moevlm.train.metrics import MetricsLogger, device_peak_tflops
from moevlm.train.optim import build_optimizer, build_scheduler, fit_resumed_schedule
from moevlm.train.profile import Profiling
from moevlm.train.run_dir import RunDir, RunDirError
from moevlm.train.wandb_log import start_wandb

_STARTED = datetime.now()


@dataclass
class Launch:
    """This process: its rank in the launch, the launch's size, the device it computes on."""

    rank: int
    world: int
    device: torch.device
    owns_process_group: bool  # started here: destroyed when the run closes


@dataclass
class Counters:
    """The loop's counters a checkpoint carries: step, skipped steps (and in a row), the losses."""

    step: int = 0
    nonfinite_steps: int = 0
    in_a_row: int = 0
    losses: list[float] = field(default_factory=list)

    def state(self) -> dict:
        return {
            "step": self.step,
            "nonfinite_steps": self.nonfinite_steps,
            "in_a_row": self.in_a_row,
            "losses": list(self.losses),
        }


@dataclass
class Built:
    """The model laid out for the plan, and what the loop keeps beside it."""

    model: torch.nn.Module
    parallel: ParallelContext
    compiled: CompileCounters | None  # train.compile: the dynamo counters
    overflow: OverflowCounter | None  # model.moe_capacity_factor: the dropped rows
    frequencies: StepFrequencies | None  # model.moe_aux_loss=global_batch
    biased_routers: list  # model.moe_router_bias_rate: the routers with an expert bias


@dataclass
class Run:
    """Everything `setup` made, what the training loop (moevlm.train.trainer) runs on."""

    plan: JobPlan
    launch: Launch
    run_dir: RunDir
    log: MetricsLogger
    faults: Faults
    built: Built
    loader: object  # PackedLoader, or NoData on a pipeline rank without the first stage
    held_out: HeldOut | None
    optimizer: torch.optim.Optimizer
    scheduler: object
    ckpt: CheckpointManager
    counters: Counters
    peak_tflops: float | None
    prof: Profiling


def setup(job, sweep: tuple[str, int] | None = None) -> Run:
    """The run of `job` (a composed config) on this process; `sweep`: (sweep dir, job number)."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    plan = plan_job(job, world)
    device = _device(plan.train.device)
    # from the config alone: before the meta build
    check_memory(plan, *memory_limit(device), device_type=device.type)
    faults = _faults(plan, rank, world)
    launch = start_launch(plan, rank, world, device)
    check_export_targets(plan, launch, sweep)
    run_dir = claim_run_dir(plan, launch, sweep)
    log = open_log(plan, launch, run_dir, job)
    torch.manual_seed(plan.train.seed)
    if plan.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    built = build(plan, launch, log)
    sample = _sample_set(plan, launch, log) if "sample" in _shard_specs(plan) else None
    loader = open_loader(plan, launch, built, sample)
    held_out = open_held_out(plan, launch, built, sample, loader) if plan.train.val_every else None
    materialize(plan, launch, built, log, run_dir.path)
    optimizer, scheduler = make_optimizer(plan, built, log)
    ckpt = CheckpointManager(
        run_dir.path / "checkpoints",
        keep=plan.train.keep_checkpoints,
        async_save=plan.train.async_checkpoint,
        timeout=timedelta(seconds=plan.job.parallel.timeout_s),
        base=lora_base(plan),
        record=launch_record(job, plan.model, tokenizer_of(launch, loader)),
    )
    counters = resume(plan, launch, ckpt, built, optimizer, scheduler, loader, log)
    if rank == 0:  # only now: a relaunch refused above leaves the run's record as it was
        run_dir.write_config(OmegaConf.to_yaml(job))
    weights_changed()  # (FP8 weight codes of the loaded values, if any, are made at first use)
    peak = device_peak_tflops(device, "bf16" if plan.build.bf16 else "fp32", plan.train.peak_tflops)
    # train.profile_components / profile_steps: no-ops when both are off
    prof = Profiling(plan.train, built.model, device, run_dir.path, rank, log)
    return Run(
        plan, launch, run_dir, log, faults, built, loader, held_out, optimizer, scheduler, ckpt,
        counters, peak, prof,
    )  # fmt: skip


def lora_base(plan: JobPlan) -> dict | None:
    """With LoRA, the frozen base's identity: checkpoints then hold the trainable parameters alone."""
    if not plan.model.lora.rank:
        return None
    return base_identity(plan.job.model.hf_checkpoint, plan.train.seed, plan.model)


def plan_job(job, world: int) -> JobPlan:
    """The validated plan; a ConfigError is the config's alone, the same on every rank (train.py has
    rank 0 say it)."""
    try:
        return validate(job, world)
    except ConfigError as err:
        err.same_on_every_rank = True
        raise


def _faults(plan: JobPlan, rank: int, world: int) -> Faults:
    t = plan.train
    watchdog = StepWatchdog(
        t.watchdog_factor,
        t.watchdog_min_s,
        t.watchdog_abort_s,
        prefix=f"rank {rank}: " if world > 1 else "",
    )
    return Faults(rank, world, plan.job.parallel.timeout_s, watchdog)


def start_launch(plan: JobPlan, rank: int, world: int, device: torch.device) -> Launch:
    """The process group of a launch of several processes (unless the caller started one)."""
    owns = world > 1 and not dist.is_initialized()
    if owns:
        backend = plan.job.parallel.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=plan.job.parallel.timeout_s))
    return Launch(rank, world, device, owns)


def claim_run_dir(plan: JobPlan, launch: Launch, sweep: tuple[str, int] | None) -> RunDir:
    """One directory for every rank, claimed by rank 0 for the launch (moevlm.train.run_dir: made by
    moevlm or empty, locked, no links); the others receive it, or the refusal.  A sweep's jobs get a
    subdirectory each (their number) of train.run_dir, or else of the sweep directory."""
    t = plan.train
    default = sweep is None and not t.run_dir
    if sweep is None:
        path = t.run_dir or os.path.join("outputs", _STARTED.strftime("%Y-%m-%d/%H-%M-%S"))
    else:
        path = os.path.join(t.run_dir or sweep[0], str(sweep[1]))
    claim, refusal = None, None
    if launch.rank == 0:
        try:
            claim = RunDir.claim(path, default=default)
            path = str(claim.path)
        except RunDirError as err:
            refusal = str(err)
    if launch.world > 1:
        box = [path, refusal]
        dist.broadcast_object_list(box, src=0)
        path, refusal = box
    if refusal is not None:
        err = RunDirError(refusal)
        err.same_on_every_rank = True
        raise err
    return claim if claim is not None else RunDir.joined(path)


def export_protected(plan: JobPlan, option: str) -> dict:
    """What the folder of export `option` must never be or hold, beside the run directory: the weights
    the run started from, the other export's folder."""
    t = plan.job.train
    other = t.export_adapter if option == "train.export_hf" else t.export_hf
    key = "train.export_adapter" if option == "train.export_hf" else "train.export_hf"
    return {"model.hf_checkpoint": plan.job.model.hf_checkpoint, key: other}


def check_export_targets(plan: JobPlan, launch: Launch, sweep: tuple[str, int] | None) -> None:
    """train.export_hf and train.export_adapter name folders this run may replace (absent, empty, or
    an earlier export of this run: moevlm.parallel.hf_io.check_export_target), checked by rank 0
    before the run directory is claimed or anything is built; a refusal is a config error."""
    t = plan.train
    if sweep is not None:
        run_dir = os.path.join(t.run_dir or sweep[0], str(sweep[1]))
    else:
        run_dir = t.run_dir or None  # a default run directory is new: no export is its own yet
    refusal = None
    if launch.rank == 0:
        try:
            for option in ("train.export_hf", "train.export_adapter"):
                target = getattr(t, option.split(".")[1])
                if target:
                    check_export_target(target, run_dir, option, export_protected(plan, option))
        except ExportTargetError as err:
            refusal = str(err)
    if launch.world > 1:
        box = [refusal]
        dist.broadcast_object_list(box, src=0)
        refusal = box[0]
    if refusal is not None:
        err = ExportTargetError(refusal)
        err.same_on_every_rank = True
        raise err


def open_log(plan: JobPlan, launch: Launch, run_dir: RunDir, job) -> MetricsLogger:
    t = plan.train
    log = MetricsLogger(
        run_dir.path,
        launch.rank,
        t.steps,
        t.log_every,
        t.tensorboard,
        t.progress,
        wandb=start_wandb(job, run_dir.path, launch.rank),
        world_size=launch.world,
    )
    for note in plan.notes:
        log.info(note)
    return log


def build(plan: JobPlan, launch: Launch, log: MetricsLogger) -> Built:
    """The model built and laid out without memory: a layout that cannot run fails here, before the
    data; and the counters the loop keeps beside it."""
    model, ctx = build_model(plan.model, plan.dims, plan.build)
    fp8 = plan.build.fp8
    if fp8 is not None:
        log.info(
            f"{fp8.describe()}; {ctx.fp8_marked} modules ({', '.join(plan.build.fp8_modules)})"
        )
    if ctx.pipeline is not None:
        log.info(plan.pipeline.describe())
    moe = plan.model.moe
    # the capacity all-to-all's dropped rows (every rank: its reads are collective)
    overflow = (
        None
        if moe.capacity_factor is None
        else OverflowCounter(
            model, [ctx.loss_group, ctx.pp_group], moe.capacity_factor, moe.capacity_overflow
        )
    )
    frequencies = StepFrequencies(ctx.dp_group) if moe.aux_loss == "global_batch" else None
    if frequencies is not None and ctx.pipeline is not None:
        ctx.pipeline.set_frequencies(frequencies)
    # moe.router_bias_rate: the expert biases (training state, not in HF files)
    biased = [r for r in model.modules() if isinstance(r, Router) and hasattr(r, "expert_bias")]
    compiled = CompileCounters() if plan.build.compile else None
    return Built(model, ctx, compiled, overflow, frequencies, biased)


def _shard_specs(plan: JobPlan) -> list[str]:
    return [plan.data.shards, plan.data.val_shards if plan.train.val_every else None]


def _sample_set(plan: JobPlan, launch: Launch, log: MetricsLogger) -> Path:
    """The cached sample set (moevlm.data.sample_cache): each machine's first rank builds or reuses it
    while the others wait at the barrier, then finds it complete."""
    builder = int(os.environ.get("LOCAL_RANK", launch.rank)) == 0
    if not builder:
        _barrier()
    path, built = ensure_sample()
    if builder:
        _barrier()
    if launch.rank == 0:
        log.info(describe_sample(path, built))
    return path


def data_rank(plan: JobPlan, launch: Launch) -> int:
    """This rank's data-parallel index (the loader's rank)."""
    dims = plan.dims
    return launch.rank // (dims.tp * dims.cp) % dims.dp


def open_loader(plan: JobPlan, launch: Launch, built: Built, sample: Path | None, **fields):
    """This rank's loader of data.shards, or of the `fields` given instead (validation's shards, the
    training tokenizer, streams looping forever); a later pipeline stage reads nothing (NoData): the
    first stage's rank shares each micro-batch's text."""
    pipeline = built.parallel.pipeline
    if pipeline is not None and not pipeline.holds_first:
        return NoData()
    d = copy.deepcopy(plan.data)
    for key, value in fields.items():
        setattr(d, key, value)
    if d.shards == "sample":
        d.shards = str(sample)
    return build_loader(
        d,
        plan.model,
        rank=data_rank(plan, launch),
        world=plan.dims.dp,
        hf_checkpoint=plan.job.model.hf_checkpoint,
    )


def open_held_out(plan: JobPlan, launch: Launch, built: Built, sample, loader) -> HeldOut:
    """The validation rows' loader over data.val_shards (moevlm.train.evaluate); one it cannot build
    is a config error naming data.val_shards."""
    tokenizer = getattr(loader, "tokenizer_path", "")
    try:
        held = open_loader(
            plan,
            launch,
            built,
            sample,
            shards=plan.data.val_shards,
            tokenizer=tokenizer,
            epochs=None,
        )
    except ValueError as err:  # ConfigError and DataSetupError included
        err = ConfigError(
            "data.val_shards: " + str(err).replace("data.shards=", "data.val_shards=")
        )
        err.same_on_every_rank = True
        raise err from None
    return HeldOut(
        None if isinstance(held, NoData) else held,
        batches=plan.train.val_batches,
        grad_accum=plan.grad_accum,
        rows=plan.train.micro_batch_size,
        model=plan.model,
        freeze_vision=plan.job.model.freeze_vision,
    )


def materialize(
    plan: JobPlan, launch: Launch, built: Built, log: MetricsLogger, run_dir: Path
) -> None:
    """The weights made on the device, then loaded from model.hf_checkpoint or initialized (the same
    under any layout); the router biases zeroed, the vision tower frozen if asked, the pipeline
    started."""
    model, m, t = built.model, plan.job.model, plan.train
    materialize_(model, launch.device, built.parallel)
    if m.hf_checkpoint:  # every parameter comes from it (a missing one is an error)
        load_hf_weights_(model, m.hf_checkpoint)
        log.info(
            f"loaded weights from {os.path.abspath(m.hf_checkpoint)} "
            f"({num_parameters(plan.model):,} parameters)"
        )
        # LoRA adapters are not in the checkpoint: drawn as without one
        init_parameters_(model, t.seed, built.parallel, only=is_adapter)
    else:
        init_parameters_(model, t.seed, built.parallel)
    for r in built.biased_routers:
        r.expert_bias.zero_()
    moe = plan.model.moe
    if moe.router_force_balance and moe.num_experts:
        log.info(
            "WARNING: model.moe_router_force_balance=true: tokens are routed evenly whatever the "
            "router scores (a benchmarking mode: the model trained is not a real MoE); every "
            "record carries moe_router_force_balance=true"
        )
    # (None on pipeline ranks without the first stage)
    if m.freeze_vision and model.vision is not None:
        model.vision.requires_grad_(False)
    pipeline = built.parallel.pipeline
    if pipeline is not None:
        d = plan.data.pack
        pipeline.start(
            launch.device,
            rows=t.micro_batch_size,
            seq_len=d.seq_len,
            max_patches=d.max_patches,
            max_video_patches=d.max_video_patches if d.max_videos else 0,
            seq_shards=plan.dims.tp * plan.dims.cp,
            autocast=lambda: autocast(plan, launch.device),
            **boundary_dtypes(plan.build.bf16, plan.build.dp_mode),
        )
    # each rank's groups along every dimension (larger jobs: ParallelDims.describe_ranks)
    if 1 < launch.world <= 64:
        log.info(plan.dims.describe_ranks())
    n = sum(p.numel() for p in model.parameters())
    held = " on pp rank 0's stages" if pipeline is not None else ""
    if plan.model.lora.rank:  # LoRA: the adapters (and a trained router) alone
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        held += f", {trained / 1e6:.2f}M trainable (LoRA rank {plan.model.lora.rank})"
    log.info(
        f"model: {n / 1e6:.1f}M parameters{held} ({plan.dims.describe()}), "
        f"{plan.grad_accum} micro-batches x {t.micro_batch_size} rows per step, run dir {run_dir}"
    )


def autocast(plan: JobPlan, device: torch.device):
    """bf16 autocast where the plan computes in bf16; CUDA graphs are captured inside it and refuse
    its weight cache (moevlm.parallel.cuda_graphs)."""
    if plan.build.bf16:
        return torch.autocast(
            device.type, dtype=torch.bfloat16, cache_enabled=not plan.build.cuda_graph_scope
        )
    return contextlib.nullcontext()


def make_optimizer(plan: JobPlan, built: Built, log: MetricsLogger):
    """AdamW over the trained parameters (on the host with parallel.optimizer_offload) and its
    schedule."""
    offload = built.parallel.optimizer_offload
    opt = build_optimizer(built.model, plan.optim, offload=offload == "host")
    if offload is not None:
        log.info(_offload_line(offload, built.model, plan.optim.state_dtype))
    if plan.build.fp8 is not None and plan.build.fp8.cache_weights:
        install_weight_cache(opt)  # FP8 weight codes live for one optimizer step
    return opt, build_scheduler(opt, plan.optim, plan.train.steps)


def resume(
    plan: JobPlan, launch: Launch, ckpt: CheckpointManager, built: Built, opt, sched, loader, log
) -> Counters:
    """train.resume=auto: the newest checkpoint that verifies (damaged newer ones are moved aside into
    checkpoints/rejected/); a named checkpoint must verify.  Starting at step N (0 for a fresh start)
    sets this run dir's checkpoints from step N on aside (checkpoints/abandoned-<time>/): they belong
    to a line of history this run abandons.  Metrics after N are dropped."""
    t = plan.train
    r = t.resume
    path = None if r == "none" else ckpt.newest_verified() if r == "auto" else Path(r)
    for moved, problems in ckpt.rejected:
        log.info(
            f"checkpoint {moved.name} failed verification ({'; '.join(problems[:3])}); moved to "
            f"{moved.parent}"
        )
    marker = {} if path is None else read_marker(path)
    step = 0 if path is None else marker["step"]
    if path is not None:  # adapters of another base (or none): refused before anything is moved
        check_base(marker, ckpt.base, path)
        check_changes(path, marker, ckpt.record, t.resume_allow_changes, log)
    if step > t.steps:  # before anything is set aside
        raise ConfigError(
            f"train.steps={t.steps} is below step {step} of the checkpoint to resume "
            f"({path}): set train.steps >= {step} to continue it, or train.resume=none (or "
            "another train.run_dir) to start over"
        )
    moved = ckpt.set_aside_after(step, keep=path)
    if moved:
        log.info(
            f"this run restarts at step {step}: the run dir's checkpoints of the abandoned line "
            f"({', '.join(p.name for p in moved)}) were moved to {moved[0].parent}"
        )
    log.resume_at(step, abandoned=moved[0].parent if moved else None)
    if path is None:
        return Counters()
    got = ckpt.load(
        path,
        model=built.model,
        optimizer=opt,
        extra={"scheduler": sched, "counters": {}},
        per_rank={"rng": None},
    )
    if not weights_finite(built.model, launch):
        raise CheckpointError(
            f"checkpoint {path} holds non-finite weights: training from it cannot recover; resume "
            "an earlier checkpoint (train.resume=PATH) or start over (train.resume=none)"
        )
    ckpt.resumed_from = path
    saved = got["extra"]["counters"]
    # a relaunch after a non-finite stop keeps counting
    counters = Counters(
        saved["step"], saved["nonfinite_steps"], saved.get("in_a_row", 0), list(saved["losses"])
    )
    # a changed train.steps; the lr the checkpoint's run would have used: its optim.lr's
    saved_lr = marker.get("config", {}).get("optim", {}).get("lr")
    for line in fit_resumed_schedule(sched, plan.optim, t.steps, saved_lr):
        log.info(line)
    try:
        loader.load_state_dict(
            merge_states([d for d in ckpt.load_all_ranks(path, "data") if d is not None])
        )
    # other shards, seed or streams than the checkpoint's: what to change
    except ValueError as err:
        raise DataResumeRefused(f"cannot resume the data from {path}: {err}") from None
    if got["per_rank"].get("rng") is not None:
        set_rng_state(got["per_rank"]["rng"])
    log.info(f"resumed from {path} at step {counters.step}")
    return counters


class DataResumeRefused(CheckpointError):
    """The checkpoint's data state does not fit these shards (others, another seed or stream count,
    changed contents): the message names what continues; train.py exits with `exit_code`."""

    exit_code = ExitCode.DATA


def check_changes(path: Path, marker: dict, record: dict, allowed: list[str], log) -> None:
    """Each difference between the launch that wrote checkpoint `path` (its `marker`) and this one in
    a line; a tokenizer or architecture change train.resume_allow_changes does not name:
    CheckpointError (exit 7)."""
    if "config" not in marker:
        log.info(
            f"resume: checkpoint {path} records no config (an older version wrote it): not compared"
        )
    changes = resume_changes(marker, record)
    for change in changes:
        log.info(change.line())
    if why := refusal(path, changes, list(allowed)):
        raise CheckpointError(why)


def tokenizer_of(launch: Launch, loader) -> str:
    """The tokenizer.json the data is read with, as rank 0 (which reads the data) has it."""
    path = getattr(loader, "tokenizer_path", "") or ""
    if launch.world > 1:
        box = [path]
        dist.broadcast_object_list(box, src=0)
        path = box[0]
    return path


def weights_finite(model: torch.nn.Module, launch: Launch) -> bool:
    """Every weight of every rank finite (a collective over all ranks: each holds its shards)."""
    bad = torch.zeros((), dtype=torch.int64, device=launch.device)
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        bad += (~torch.isfinite(local.detach())).sum()
    if launch.world > 1:
        dist.all_reduce(bad)
    return int(bad) == 0


def boundary_dtypes(bf16: bool, dp_mode: str) -> dict:
    """The dtypes of what crosses a pipeline stage boundary, as one process computes them: the
    residual stream is bf16 when FSDP casts the weights to bf16 (under autocast alone it stays fp32);
    deepstack features are sent in fp32 unless FSDP makes the whole tower bf16 (casting them up is
    exact)."""
    half = bf16 and dp_mode == "fsdp"
    dtype = torch.bfloat16 if half else torch.float32
    return {"h_dtype": dtype, "vision_dtype": dtype}


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(name)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _offload_line(kind: str, model: torch.nn.Module, state_dtype: str = "float32") -> str:
    """The log line of parallel.optimizer_offload: where the state lives and this rank's host memory
    (16 bytes a trained element, 12 with bf16 moments: FSDP's fp32 shard, its gradient and the AdamW
    state, or the host AdamW's master, gradient buffer and state)."""
    n = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel()
        for p in model.parameters()
        if p.requires_grad
    )
    what = {
        "fsdp": "FSDP2's CPU offload policy: this rank's fp32 parameter shards, their gradients and AdamW state",
        "host": "a host AdamW: fp32 masters, gradient buffers and AdamW state of this rank's parameters",
    }[kind]
    per = 12 if state_dtype == "bfloat16" else 16
    return f"parallel.optimizer_offload: {what} in host memory ({per * n / 2**20:.1f} MiB)"
