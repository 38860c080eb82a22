"""The training job: set up once, then optimizer steps until `train.steps`.

    trainer = Trainer(job)          # validated config (moevlm.train.config)
    code = trainer.run()            # an exit code (below)

`run` returns a `moevlm.train.exit_codes.ExitCode` (the table is there); train.py exits with it.

Order of set-up (nothing large is allocated before the config, the layout and
the data are checked): validate -> memory estimate (weights, gradients and
AdamW state per rank against the device's free memory) -> process group -> run dir -> logger -> model
on meta -> `parallelize` -> data -> materialise + init or HF load -> freeze ->
optimizer + schedule -> resume from the newest complete checkpoint.

Design choices:
- One optimizer step = `grad_accum` micro-batches per data-parallel rank, each
  `micro_batch_size` packed rows; all micro-batches of a step are fetched
  first, so the loss can be normalised by the step's global count of loss
  tokens (all micro-batches, all ranks) before any backward: every token
  weighs the same whatever the packing, accumulation or layout.  The aux
  loss is averaged over micro-batches.  Padding is kept out of the router
  statistics (`token_mask`).
- Non-finite loss or gradient norm: `skip` zeroes the gradients and skips the
  optimizer and schedule step (the data is consumed, the step counted);
  `stop` (or `max_nonfinite_steps` skips in a row) checkpoints and exits 3.
- FLOPs for TFLOP/s and MFU are counted per row from the real documents and
  images (padding excluded), so MFU, like tokens/s, is useful work.
- Checkpoints hold model, optimizer, schedule, counters, and per rank the
  data-loader state and RNG states; resuming continues bit-exactly.  With
  `train.async_checkpoint` they are written in the background
  (moevlm.train.checkpoint); the next save, the end of the run, a stop signal
  (its checkpoint complete before the exit) and an early exit wait for the one
  in flight.
- Pipeline stages (parallel.pp > 1): the step's micro-batches are the
  schedule's (torch.distributed.pipelining runs them; moevlm.parallel.pipeline).
  Only the first stage's ranks read data; they share each micro-batch's text
  with their pipeline group, so every rank computes the same token totals.  The
  loss sums come from the last stage and are summed over the pipeline group,
  so all ranks log and judge (non-finite policy) the same numbers.
- `model.moe_capacity_factor` (moevlm.dispatch.capacity): each record carries
  `moe_dropped_tokens` (the (token, expert) choices dropped over the window,
  summed over layers, micro-batches and ranks), `moe_dropped_fraction`
  (of the choices routed) and `moe_overflowed_dispatches` (MoE-layer dispatches
  that dropped any: HybridEP's overflow flag with model.dispatcher=hybridep),
  read from the device once per logged step; with
  `model.moe_capacity_overflow=error` a step that dropped any fails before its
  update (one read per step, beside the loss's own sync).
- Router balancing (moevlm.model.moe, moevlm.parallel.balance): with `model.moe_aux_loss=global_batch`
  each micro-batch's aux loss weighs its router probabilities by the step's expert frequencies so far
  (`StepFrequencies`, one all-gather per micro-batch over the data-parallel group); with
  `model.moe_router_bias_rate` the routers' biases move after each step that updated the weights, from
  the step's expert counts summed over data-parallel ranks (each pipeline rank its own layers; a
  skipped step leaves them); the z-loss is averaged over micro-batches like the aux loss.
  `model.moe_router_force_balance` is announced at start and marked in every record.
- `train.compile`: each record carries the dynamo counters of this process
  since set-up (`compiled_graphs`, `graph_breaks`) and `recompiles` since the
  end of its first step (0 when the shapes are static, as they must be).
- Faults (moevlm.train.faults): during `run`, SIGTERM/SIGINT stop every rank
  after the same step (a MAX all-reduce of a flag after each step) with a
  checkpoint; collectives time out after `parallel.timeout_s` and end the run
  with one line naming what the trainer was doing; a watchdog thread reports
  steps far slower than the recent ones (and aborts past
  `train.watchdog_abort_s`).  Signal handlers are restored in `close`.
- A step is a sequence of phases (`_phase`): each names itself to the fault handling (a hang or a
  failed collective reports it) and, where it is one of the profiler's components (data, backward,
  gradient reduction + clipping, optimizer), opens and closes that span
  (moevlm.train.profile; the model's parts are timed by hooks it attaches from outside).  With both
  profiling options off the spans are no-ops.
- `Window` (moevlm.train.metrics) sums the steps between two log lines; the trainer hands it the
  values only it knows (step, peak memory, skip counts, the expert counts of every stage) when the
  record is written.  Each step's images and image tokens are summed over the data-parallel ranks in
  the same all-reduce as its token counts.
- `parallel.optimizer_offload` (moevlm.parallel.optimizer_offload): the optimizer state on the host,
  by FSDP2's CPU offload policy under FSDP, else by a host AdamW over fp32 masters.  Clipping is
  unchanged (on the reduced gradients, before they leave the device); the schedule drives the host
  AdamW's groups; checkpoints keep the device optimizer's format.
- Vision balance (`vision_flops_max_over_mean`): for each micro-batch of the step, every (dp, cp)
  rank's vision tower FLOPs (its cp share of the micro-batch's images, `MicroBatch.vision_flops_cp`);
  the slowest rank's, summed over the micro-batches, over the mean rank's: the straggler that the
  ranks wait for each time they meet, which is every micro-batch under FSDP (its reduce-scatter) and
  wherever experts are sharded (the all-to-alls), so a step's sum per rank would hide it (DDP without
  expert parallelism meets once a step, after the last micro-batch: the figure is then an upper
  bound).  tp ranks run the tower on the same images (it is not tensor parallel) and count once;
  pipeline stages after the first run no tower but carry the first stage's figures.  No extra
  collective: each data-parallel rank puts its slowest cp share of each micro-batch in its own slots
  of the token-count all-reduce (dp x micro-batches values; cp ranks of one replica compute their
  shares of the same micro-batch, so every rank knows them all).
- Validation (`train.val_every`, moevlm.train.evaluate): after a due step, before its record and its
  checkpoint, on held-out rows of its own loader; its values join that step's record.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import signal
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from omegaconf import OmegaConf

from moevlm.data import DataError
from moevlm.data.batch import MicroBatch
from moevlm.data.hf_files import write_processor_files
from moevlm.data import build_loader, merge_states, worker_death
from moevlm.data.sample_cache import describe as describe_sample, ensure_sample
from moevlm.errors import ConfigError
from moevlm.model.fp8 import install_weight_cache, resolve_fp8, weights_changed
from moevlm.model.moe import Router, global_balance_loss, update_router_bias_
from moevlm.model.objective import objective
from moevlm.parallel import build_model, init_parameters_, materialize_
from moevlm.parallel.balance import StepFrequencies, step_load
from moevlm.parallel.compile import CompileCounters
from moevlm.parallel.hf_io import load_hf_weights_, save_hf
from moevlm.parallel.offload import describe as describe_offload
from moevlm.parallel.offload import offload_setting
from moevlm.parallel.recompute import describe as describe_recompute
from moevlm.parallel.recompute import recompute_setting
from moevlm.train.checkpoint import (
    CheckpointError,
    CheckpointManager,
    read_marker,
    rng_state,
    set_rng_state,
)
from moevlm.train.config import check_memory, memory_limit, validate
from moevlm.dispatch.capacity import OverflowCounter
from moevlm.train.evaluate import HeldOut, evaluate, val_due
from moevlm.train.exit_codes import ExitCode
from moevlm.train.integrity import write_failed_line, looks_like_disk_full
from moevlm.train.faults import Faults, StepWatchdog
from moevlm.train.metrics import (
    LogWriteError,
    MetricsLogger,
    Window,
    device_peak_tflops,
    peak_memory_gib,
    reset_peak_memory,
    slowest_over_micro_batches,
    vision_flops_slots,
)
from moevlm.train.optim import build_optimizer, build_scheduler, fit_resumed_schedule
from moevlm.train.profile import Profiling
from moevlm.train.run_dir import RunDir, RunDirError
from moevlm.train.wandb_log import start_wandb

_STARTED = datetime.now()


class Trainer:
    def __init__(self, job, sweep: tuple[str, int] | None = None):
        self.job, self.t = job, job.train
        self.world, self.rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
        try:
            self.plan = validate(job, self.world)
        # the config alone: every rank finds the same, rank 0 says it (train.py)
        except ConfigError as err:
            err.same_on_every_rank = True
            raise
        self.device = _device(self.t.device)
        # from the config alone: before the meta build
        check_memory(job, self.plan, *memory_limit(self.device), device_type=self.device.type)
        self.sweep = sweep
        self.faults = Faults(
            self.rank,
            self.world,
            job.parallel.timeout_s,
            StepWatchdog(
                self.t.watchdog_factor,
                self.t.watchdog_min_s,
                self.t.watchdog_abort_s,
                prefix=f"rank {self.rank}: " if self.world > 1 else "",
            ),
        )
        self._init_process_group()
        self.run_dir = self._run_dir(sweep)
        self.log = MetricsLogger(
            self.run_dir,
            self.rank,
            self.t.steps,
            self.t.log_every,
            self.t.tensorboard,
            self.t.progress,
            wandb=start_wandb(job, self.run_dir, self.rank),
            world_size=self.world,
        )
        for note in self.plan.notes:
            self.log.info(note)
        self.step, self.nonfinite_steps, self.in_a_row = 0, 0, 0
        self.grad_hook = None  # called with the trainer after clipping, before the update (tests)
        self.losses: list[float] = []
        # this launch's steps that changed the weights (the loss check)
        self.updated_losses: list[float] = []
        _seed(self.t.seed, self.t.deterministic)
        self.model = self._parallel_model_on_meta()
        self.loader = self._build_loader()
        self.held_out = self._held_out() if self.t.val_every else None
        self._materialise()
        self.opt = build_optimizer(
            self.model, job.optim, offload=self.parallel.optimizer_offload == "host"
        )
        if self.parallel.optimizer_offload is not None:
            self.log.info(_offload_line(self.parallel.optimizer_offload, self.model))
        if self.fp8_plan is not None and self.fp8_plan.cache_weights:
            install_weight_cache(self.opt)  # FP8 weight codes live for one optimizer step
        self.sched = build_scheduler(self.opt, job.optim, self.t.steps)
        self.ckpt = CheckpointManager(
            self.run_dir / "checkpoints",
            keep=self.t.keep_checkpoints,
            async_save=self.t.async_checkpoint,
            timeout=timedelta(seconds=job.parallel.timeout_s),
        )
        self._resume()
        if self.rank == 0:  # only now: a relaunch refused above leaves the run's record as it was
            self.run_claim.write_config(OmegaConf.to_yaml(self.job))
        weights_changed()  # (FP8 weight codes of the loaded values, if any, are made at first use)
        self.peak = device_peak_tflops(
            self.device, "bf16" if self._bf16 else "fp32", self.t.peak_tflops
        )
        # train.profile_components / profile_steps (moevlm.train.profile): no-ops when both are off
        self.prof = Profiling(self.t, self.model, self.device, self.run_dir, self.rank, self.log)

    # ------------------------------------------------------------------ set-up
    def _init_process_group(self) -> None:
        self._owns_process_group = False
        if self.world > 1 and not dist.is_initialized():
            self._owns_process_group = True
            backend = self.job.parallel.backend
            if backend == "auto":
                backend = "nccl" if self.device.type == "cuda" else "gloo"
            if self.device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend, timeout=timedelta(seconds=self.job.parallel.timeout_s))

    def _run_dir(self, sweep: tuple[str, int] | None) -> Path:
        """One directory for every rank, claimed by rank 0 for the launch (moevlm.train.run_dir: made
        by moevlm or empty, locked, no links); the others receive it, or the refusal.  A sweep's jobs
        get a subdirectory each (their number) of train.run_dir, or else of the sweep directory."""
        default = sweep is None and not self.t.run_dir
        if sweep is None:
            path = self.t.run_dir or os.path.join("outputs", _STARTED.strftime("%Y-%m-%d/%H-%M-%S"))
        else:
            path = os.path.join(self.t.run_dir or sweep[0], str(sweep[1]))
        refusal = None
        if self.rank == 0:
            try:
                self.run_claim = RunDir.claim(path, default=default)
                path = str(self.run_claim.path)
            except RunDirError as err:
                refusal = str(err)
        if self.world > 1:
            box = [path, refusal]
            dist.broadcast_object_list(box, src=0)
            path, refusal = box
        if refusal is not None:
            err = RunDirError(refusal)
            err.same_on_every_rank = True
            raise err
        if self.rank != 0:
            self.run_claim = RunDir.joined(path)
        return self.run_claim.path

    def _build_loader(self, shards: str | None = None):
        """This rank's loader of data.shards, or of `shards` (validation: the training tokenizer, streams
        looping forever)."""
        d = (
            OmegaConf.to_object(self.job.data)
            if OmegaConf.is_config(self.job.data)
            else copy.deepcopy(self.job.data)
        )
        if shards is not None:
            tokenizer = getattr(self.loader, "tokenizer_path", "")
            d.shards, d.tokenizer, d.epochs = shards, tokenizer, None
        if d.shards == "sample":
            d.shards = str(self._sample_set())
        dims = self.plan.dims
        if self.pipeline is not None and not self.pipeline.holds_first:
            # a later pipeline stage: the first stage's rank shares each micro-batch's text
            return NoData()
        return build_loader(
            d,
            self.plan.model,
            rank=self._dp_rank(),
            world=dims.dp,
            hf_checkpoint=self.job.model.hf_checkpoint,
        )

    def _held_out(self) -> HeldOut:
        """The validation rows' loader over data.val_shards (moevlm.train.evaluate); one it cannot build
        is a config error naming data.val_shards."""
        try:
            loader = self._build_loader(self.job.data.val_shards)
        except ValueError as err:  # ConfigError and DataSetupError included
            err = ConfigError(
                "data.val_shards: " + str(err).replace("data.shards=", "data.val_shards=")
            )
            err.same_on_every_rank = True
            raise err from None
        return HeldOut(
            None if isinstance(loader, NoData) else loader,
            batches=self.t.val_batches,
            grad_accum=self.plan.grad_accum,
            rows=self.t.micro_batch_size,
            model=self.plan.model,
            freeze_vision=self.job.model.freeze_vision,
        )

    def _sample_set(self) -> Path:
        """The cached sample set (moevlm.data.sample_cache): each machine's first rank builds or reuses it
        while the others wait at the barrier, then finds it complete; found once (a held-out loader on
        it reuses the path)."""
        if getattr(self, "_sample_path", None) is not None:
            return self._sample_path
        builder = int(os.environ.get("LOCAL_RANK", self.rank)) == 0
        if not builder:
            _barrier()
        path, built = ensure_sample()
        if builder:
            _barrier()
        if self.rank == 0:
            self.log.info(describe_sample(path, built))
        self._sample_path = path
        return path

    def _parallel_model_on_meta(self) -> torch.nn.Module:
        """Built and laid out without memory: a layout that cannot run fails here, before the data."""
        p, m = self.job.parallel, self.job.model
        self.fp8_plan = fp8 = resolve_fp8(self.plan.model.fp8, self.device)
        model, self.parallel = build_model(
            self.plan.model,
            self.plan.dims,
            dp_mode=p.dp_mode,
            device_type=self.device.type,
            bf16=self._bf16,
            pipeline=self.plan.pipeline,
            recompute=recompute_setting(m),
            offload=offload_setting(m),
            compile=self.t.compile,
            compile_mode=self.t.compile_mode,
            cp_comm=p.cp_comm,
            ep_overlap=p.ep_overlap,
            fp8=fp8,
            fp8_modules=self.plan.model.fp8.modules,
            cuda_graph_scope=m.cuda_graph_scope,
            optimizer_offload=p.optimizer_offload,
        )
        if fp8 is not None:
            self.log.info(
                f"{fp8.describe()}; {self.parallel.fp8_marked} modules "
                f"({', '.join(self.plan.model.fp8.modules)})"
            )
        self.compiled = CompileCounters() if self.t.compile else None
        self.pipeline = self.parallel.pipeline
        if self.pipeline is not None:
            self.log.info(self.plan.pipeline.describe())
        # the capacity all-to-all's dropped rows (every rank: its reads are collective)
        moe = self.plan.model.moe
        self.overflow = (
            None
            if moe.capacity_factor is None
            else OverflowCounter(
                model,
                [self.parallel.loss_group, self.parallel.pp_group],
                moe.capacity_factor,
                moe.capacity_overflow,
            )
        )
        return model

    def _materialise(self) -> None:
        model, m = self.model, self.job.model
        materialize_(model, self.device, self.parallel)
        if m.hf_checkpoint:  # every parameter comes from it (a missing one is an error)
            load_hf_weights_(model, m.hf_checkpoint)
        else:
            init_parameters_(model, self.t.seed, self.parallel)  # the same weights under any layout
        # moe.router_bias_rate: the expert biases start at zero (training state, not in HF files)
        self.biased_routers = [
            r for r in model.modules() if isinstance(r, Router) and hasattr(r, "expert_bias")
        ]
        for r in self.biased_routers:
            r.expert_bias.zero_()
        moe = self.plan.model.moe
        self.frequencies = (
            StepFrequencies(self.parallel.dp_group) if moe.aux_loss == "global_batch" else None
        )
        if self.frequencies is not None and self.pipeline is not None:
            self.pipeline.set_frequencies(self.frequencies)
        if moe.router_force_balance and moe.num_experts:
            self.log.info(
                "WARNING: model.moe_router_force_balance=true: tokens are routed evenly whatever the "
                "router scores (a benchmarking mode: the model trained is not a real MoE); every "
                "record carries moe_router_force_balance=true"
            )
        # (None on pipeline ranks without the first stage)
        if m.freeze_vision and model.vision is not None:
            model.vision.requires_grad_(False)
        if self.pipeline is not None:
            d = self.job.data.pack
            self.pipeline.start(
                self.device,
                rows=self.t.micro_batch_size,
                seq_len=d.seq_len,
                max_patches=d.max_patches,
                seq_shards=self.plan.dims.tp * self.plan.dims.cp,
                autocast=self._autocast,
                **_boundary_dtypes(self._bf16, self.job.parallel.dp_mode),
            )
        # each rank's groups along every dimension (larger jobs: ParallelDims.describe_ranks)
        if 1 < self.world <= 64:
            self.log.info(self.plan.dims.describe_ranks())
        n = sum(p.numel() for p in model.parameters())
        held = " on pp rank 0's stages" if self.pipeline is not None else ""
        self.log.info(
            f"model: {n / 1e6:.1f}M parameters{held} ({self.plan.dims.describe()}), "
            f"{self.plan.grad_accum} micro-batches x {self.t.micro_batch_size} rows per step, "
            f"run dir {self.run_dir}"
        )

    @property
    def _bf16(self) -> bool:
        return self.t.precision == "bf16" or (
            self.t.precision == "auto" and self.device.type == "cuda"
        )

    # ------------------------------------------------------------- checkpoints
    def _resume(self) -> None:
        """resume=auto: the newest checkpoint that verifies (damaged newer ones are moved aside into
        checkpoints/rejected/); a named checkpoint must verify.  Starting at step N (0 for a fresh
        start) sets this run dir's checkpoints from step N on aside (checkpoints/abandoned-<time>/):
        they belong to a line of history this run abandons.  Metrics after N are dropped."""
        r, ck = self.t.resume, self.ckpt
        path = None if r == "none" else ck.newest_verified() if r == "auto" else Path(r)
        for moved, problems in ck.rejected:
            self.log.info(
                f"checkpoint {moved.name} failed verification ({'; '.join(problems[:3])}); moved to "
                f"{moved.parent}"
            )
        step = 0 if path is None else read_marker(path)["step"]
        if step > self.t.steps:  # before anything is set aside
            raise ConfigError(
                f"train.steps={self.t.steps} is below step {step} of the checkpoint to resume "
                f"({path}): set train.steps >= {step} to continue it, or train.resume=none (or "
                "another train.run_dir) to start over"
            )
        moved = ck.set_aside_after(step, keep=path)
        if moved:
            self.log.info(
                f"this run restarts at step {step}: the run dir's checkpoints of the abandoned line "
                f"({', '.join(p.name for p in moved)}) were moved to {moved[0].parent}"
            )
        self.log.resume_at(step, abandoned=moved[0].parent if moved else None)
        if path is None:
            return
        got = ck.load(
            path,
            model=self.model,
            optimizer=self.opt,
            extra={"scheduler": self.sched, "counters": {}},
            per_rank={"rng": None},
        )
        if not self._weights_finite():
            raise CheckpointError(
                f"checkpoint {path} holds non-finite weights: training from it cannot recover; resume "
                "an earlier checkpoint (train.resume=PATH) or start over (train.resume=none)"
            )
        ck.resumed_from = path
        counters = got["extra"]["counters"]
        self.step, self.nonfinite_steps = counters["step"], counters["nonfinite_steps"]
        # a relaunch after a non-finite stop keeps counting
        self.in_a_row = counters.get("in_a_row", 0)
        self.losses = list(counters["losses"])
        # a changed train.steps
        for line in fit_resumed_schedule(self.sched, self.job.optim, self.t.steps):
            self.log.info(line)
        try:
            self.loader.load_state_dict(
                merge_states([d for d in ck.load_all_ranks(path, "data") if d is not None])
            )
        # other shards, seed or streams than the checkpoint's: what to change
        except ValueError as err:
            raise CheckpointError(f"cannot resume the data from {path}: {err}") from None
        if got["per_rank"].get("rng") is not None:
            set_rng_state(got["per_rank"]["rng"])
        self.log.info(f"resumed from {path} at step {self.step}")

    def save(self, complete: bool = False) -> Path:
        """Checkpoint this step.  With train.async_checkpoint the write goes on in the background
        (after the previous one's is waited for); `complete`: return only once it is complete."""
        self._wait_for_checkpoint()
        self.faults.at("checkpoint save", self.step)
        counters = {
            "step": self.step,
            "nonfinite_steps": self.nonfinite_steps,
            "in_a_row": self.in_a_row,
            "losses": list(self.losses),
        }
        if not self._weights_finite():
            raise NonFiniteWeights(self.ckpt.latest())
        path = self.ckpt.save(
            self.step,
            model=self.model,
            optimizer=self.opt,
            extra={"scheduler": self.sched, "counters": counters},
            per_rank={"data": self.loader.state_dict(), "rng": rng_state()},
        )
        if complete:
            self._wait_for_checkpoint()
        return path

    def _wait_for_checkpoint(self) -> None:
        """train.async_checkpoint: until the save in flight is complete (its failure raised here)."""
        if (path := self.ckpt.pending) is not None:
            self.faults.at(f"waiting for the background write of checkpoint {path.name}", self.step)
            self.ckpt.wait()

    # -------------------------------------------------------------------- loop
    def run(self) -> int:
        t_start, first_step = time.perf_counter(), self.step
        window = Window()
        code = ExitCode.OK
        self.faults.start()
        try:
            while self.step < self.t.steps:
                ok = self.train_step(window)
                val = self.validate() if val_due(self.step, self.t) else {}
                # a skipped step is logged, marked; a validated one with its values
                if self.log.should_log(self.step) or not ok or val:
                    self.log.log({**self._record(window), **val})
                    window = Window()
                if not ok and (
                    self.t.nonfinite == "stop" or self.in_a_row >= self.t.max_nonfinite_steps
                ):
                    path = self.save(complete=True)
                    self.log.info(
                        f"stopping at step {self.step}: non-finite loss or gradients "
                        f"({self.in_a_row} step(s) in a row; train.nonfinite={self.t.nonfinite}); "
                        f"checkpoint {path} holds the weights before this step. Lower optim.lr, "
                        "check the data, or use train.nonfinite=skip"
                    )
                    return ExitCode.NONFINITE
                if self.step < self.t.steps and (signum := self.faults.stop_requested(self.device)):
                    return self._interrupted(signum)
                if self._checkpoint_due():
                    self.save()
            if ruined := self._ruined(first_step):
                self.log.info(f"stopping at step {self.step}: {ruined}")
                return ExitCode.NONFINITE
            if self.t.checkpoint_at_end and self.step > first_step and not self._checkpoint_due():
                self.save()
            self._wait_for_checkpoint()
            if self.t.export_hf:
                self._export_hf(self.t.export_hf)
            code = self._summary(time.perf_counter() - t_start, self.step - first_step)
        except NonFiniteWeights as err:  # no checkpoint of them is written
            self.log.info(f"stopping at step {self.step}: {err}")
            code = ExitCode.NONFINITE
        # no room, or the write failed: the earlier checkpoints are intact
        except CheckpointError as err:
            # a peer lost during the save: its code, not a disk's
            code = self.faults.failure_code(err)
            if code is None:
                self.log.info(f"stopping at step {self.step}: {err}")
                code = ExitCode.CHECKPOINT
        except LogWriteError as err:
            print(f"stopping at step {self.step}: {err}", file=sys.stderr, flush=True)
            code = ExitCode.CHECKPOINT
        except DataError as err:  # every rank's own stream: printed where it happened
            print(
                f"{'rank %d: ' % self.rank if self.world > 1 else ''}stopping at step {self.step}: {err}",
                file=sys.stderr,
                flush=True,
            )
            code = ExitCode.DATA
        # a failed collective or a dead data worker: one line, not a traceback
        except Exception as err:
            if (line := worker_death(err)) is not None:  # (torch raises it wherever the step was)
                print(f"stopping at step {self.step}: {line}", file=sys.stderr, flush=True)
                return ExitCode.DATA
            if looks_like_disk_full(err):  # a write of ours other than a checkpoint or the metrics
                print(
                    f"stopping at step {self.step}: {write_failed_line(err)}",
                    file=sys.stderr,
                    flush=True,
                )
                return ExitCode.CHECKPOINT
            code = self.faults.failure_code(err)
            if code is None:
                raise
        finally:
            self.close()
        return code

    def validate(self) -> dict:
        """The held-out loss of the current weights (moevlm.train.evaluate): {"val_loss", "val_tokens"},
        the same on every rank (collective)."""
        return evaluate(self, self.held_out)

    def _export_hf(self, out: str) -> None:
        """Weights and config (collective under a layout), then rank 0 (which reads the data: the first
        stage) adds the tokenizer, chat template and image-processor files: a folder transformers loads."""
        save_hf(self.model, out, ctx=self.parallel)
        if self.rank == 0:
            write_processor_files(
                out,
                tokenizer=self.loader.tokenizer_path,
                image=self.job.data.image,
                source=self.job.model.hf_checkpoint or None,
            )
        self.log.info(
            f"exported Hugging Face checkpoint to {out} (weights, config, tokenizer, chat template, "
            "image processor)"
        )

    def _interrupted(self, signum: int) -> int:
        path = self.save(complete=True)
        again = (
            "" if self.t.run_dir and self.sweep is None else f" with train.run_dir={self.run_dir}"
        )
        self.log.info(
            f"interrupted by {signal.Signals(signum).name}: stopped after step {self.step}/{self.t.steps} "
            f"with checkpoint {path}; to continue, relaunch the same command{again} (train.resume=auto, "
            f"the default, resumes from it); exit code {ExitCode.INTERRUPTED:d}"
        )
        return ExitCode.INTERRUPTED

    def _checkpoint_due(self) -> bool:
        return bool(self.t.checkpoint_every) and self.step % self.t.checkpoint_every == 0

    def train_step(self, window: Window, micro: list[MicroBatch] | None = None) -> bool:
        """One optimizer step; False when it was skipped for non-finite values.  `micro`: the step's
        micro-batches given by the caller (every rank its own) instead of read from the loader."""
        # (a trace of train.profile_steps starts before the step's time)
        self.prof.begin_step(self.step + 1)
        t0, wait0 = time.perf_counter(), self.loader.wait_s
        self.faults.begin_step(self.step + 1)
        with self._phase("data", span="data"):
            micro = self._fetch() if micro is None else micro
        with self._phase("data-parallel token-count all-reduce"):
            dp = self.plan.dims.dp
            # per micro-batch (FSDP's reduce-scatters and the expert all-to-alls meet every one), this
            # data-parallel rank's slowest cp share in its own slot: one SUM gives every rank all slots
            vision_slots = vision_flops_slots(micro, self._dp_rank(), dp)
            totals = _all_reduce(
                [
                    sum(m.loss_tokens for m in micro),
                    sum(m.useful_tokens for m in micro),
                    sum(m.flops for m in micro),
                    sum(m.images for m in micro),
                    sum(m.n_image for m in micro),
                    sum(sum(m.vision_flops_cp) for m in micro),
                    *vision_slots,
                ],
                self.device,
                self.parallel.dp_group,
            )
        loss_tokens = max(totals[0], 1.0)
        if self.frequencies is not None:
            self.frequencies.begin_step()
        with self._phase("forward/backward"):
            fb = (
                self._pipeline_forward_backward
                if self.pipeline is not None
                else self._forward_backward
            )
            loss_sum, aux_sum, counts = fb(micro, loss_tokens)
        if self.overflow is not None and self.overflow.overflow == "error":
            # before the update: the step changes nothing
            with self._phase("expert-capacity overflow check"):
                self.overflow.check(self.device, self.step + 1)
        with self._phase("gradient reduction and clipping", span="grad_reduce_clip"):
            self.parallel.finish_gradients()
            grad_norm = self._clip()
        if self.grad_hook is not None:
            self.grad_hook(self)
        with self._phase("data-parallel loss all-reduce"):
            # cp ranks hold parts
            loss = _all_reduce_tensor(loss_sum, self.parallel.loss_group) / loss_tokens
            aux_sum = _all_reduce_tensor(aux_sum, self.parallel.dp_group)
        ok = bool(torch.isfinite(loss) & torch.isfinite(grad_norm))
        self.step += 1
        self.losses.append(float(loss))
        if ok:
            self.updated_losses.append(float(loss))
        with self._phase("optimizer step", span="optimizer"):
            self._update(ok)
        if ok and self.plan.model.moe.router_bias_rate > 0 and counts is not None:
            with self._phase("router bias update (data-parallel load all-reduce)"):
                load = step_load(counts, self.parallel.dp_group)
                update_router_bias_(self.biased_routers, load, self.plan.model.moe.router_bias_rate)
        self.prof.end_step(self.step)
        window.add(
            loss=float(loss),
            aux=float(aux_sum),
            grad_norm=float(grad_norm),
            lr=self._lr_used,
            useful_tokens=totals[1],
            flops=totals[2],
            seconds=time.perf_counter() - t0,
            wait=self.loader.wait_s - wait0,
            counts=counts,
            updated=ok,
            images=int(totals[3]),
            image_tokens=int(totals[4]),
            # the slowest (dp, cp) rank's vision FLOPs summed over the micro-batches, and the mean rank's
            vision_max=slowest_over_micro_batches(totals[6:], dp),
            vision_mean=totals[5] / (dp * self.plan.dims.cp),
        )
        if self.compiled is not None and self.compiled.warm_at is None:
            self.compiled.warm()  # every block has compiled (forward and backward): what follows is a recompile
        self.prof.after_step(self.step)  # a trace ending here is written outside the step's time
        self.faults.end_step()
        return ok

    @contextlib.contextmanager
    def _phase(self, what: str, span: str | None = None):
        """One phase of a step: `what` is what a hang or a failed collective reports the trainer was doing
        (moevlm.train.faults), `span` the profiler component it is timed as (None: not one of its own).
        A phase that raises leaves its span open: the step is lost and the run ends (`Profiling.close`)."""
        self.faults.at(what)
        if span is not None:
            self.prof.start(span)
        yield
        if span is not None:
            self.prof.stop(span)

    def _fetch(self) -> list[MicroBatch]:
        """The step's micro-batches: read here, or under pipeline stages shared over the pipeline group
        (a rank without the first stage reads nothing and receives them)."""
        reads = not isinstance(self.loader, NoData)
        micro = [self._micro_batch() for _ in range(self.plan.grad_accum)] if reads else None
        if self.pipeline is not None:
            with self._phase("micro-batch share over the pipeline group"):
                micro = self.pipeline.share(micro, self.device)
        return micro

    def _forward_backward(self, micro: list[MicroBatch], loss_tokens: float):
        """Every micro-batch through the whole model: (sum of token losses, aux share, expert counts)."""
        loss_sum = torch.zeros((), device=self.device)
        aux_sum, counts = torch.zeros((), device=self.device), None
        # the aux loss is averaged over micro-batches and ranks
        share = len(micro) * self.plan.dims.dp
        for mb in micro:
            with self._autocast():
                out = self.model(**mb.to(self.device).model_inputs())
            lm_sum = out.lm_loss * out.num_loss_tokens
            moe = self.plan.model.moe
            if out.router_totals is not None:
                # moe.aux_loss=global_batch: the step's frequencies so far (moevlm.parallel.balance)
                t = out.router_totals
                freq_E = self.frequencies(t.counts_E, t.num_tokens)
                out.aux_loss = global_balance_loss(
                    t.prob_sum_E, t.num_tokens, freq_E, moe.num_experts
                )
            # every gradient reduction sums over ranks (moevlm.parallel.data_parallel): each rank's
            # loss is its share of the step's objective
            with self._phase("forward/backward", span="backward"):
                objective(
                    lm_sum,
                    loss_tokens,
                    out.aux_loss,
                    moe.router_aux_loss_coef,
                    share,
                    out.z_loss,
                    moe.z_loss_coeff,
                ).backward()
            aux = out.aux_loss if out.aux_loss is not None else torch.zeros((), device=self.device)
            loss_sum, aux_sum = loss_sum + lm_sum.detach(), aux_sum + aux.detach() / share
            if out.expert_counts is not None:
                counts = out.expert_counts if counts is None else counts + out.expert_counts
        return loss_sum, aux_sum, counts

    def _pipeline_forward_backward(self, micro: list[MicroBatch], loss_tokens: float):
        """The step's micro-batches through the pipeline schedule; the loss sums come from the last
        stage and are summed over the pipeline group (zero elsewhere), so every rank logs them."""
        on_device = [mb.to(self.device) for mb in micro]
        # the schedule, less the forward components
        with self._phase("forward/backward", span="backward"):
            lm_sum, aux, counts = self.pipeline.forward_backward(
                on_device,
                loss_tokens,  # timed inside it
                len(micro) * self.plan.dims.dp,
            )
        sums = _all_reduce_tensor(torch.stack([lm_sum, aux]), self.parallel.pp_group)
        return sums[0], sums[1], counts

    def _update(self, ok: bool) -> None:
        self._lr_used = self.opt.param_groups[0]["lr"]
        if ok:
            self.opt.step()
            self.sched.step()
            self.in_a_row = 0
        else:
            self.nonfinite_steps += 1
            self.in_a_row += 1
        self.opt.zero_grad(set_to_none=True)

    def _clip(self) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.job.optim.grad_clip if self.job.optim.grad_clip > 0 else math.inf
        return self.parallel.clip_grad_norm_(params, max_norm)

    def _micro_batch(self) -> MicroBatch:
        """`train.micro_batch_size` packed rows of this rank's loader, finished data-side (moevlm.data.batch)."""
        return MicroBatch.read(
            self.loader,
            rows_per_batch=self.t.micro_batch_size,
            model=self.plan.model,
            freeze_vision=self.job.model.freeze_vision,
            cp=self.plan.dims.cp,
        )

    def _dp_rank(self) -> int:
        """This rank's data-parallel index (the loader's rank)."""
        dims = self.plan.dims
        return self.rank // (dims.tp * dims.cp) % dims.dp

    def _autocast(self):
        if self._bf16:
            # CUDA graphs are captured inside this autocast and refuse its weight cache (parallel/cuda_graphs.py)
            return torch.autocast(
                self.device.type,
                dtype=torch.bfloat16,
                cache_enabled=not self.job.model.cuda_graph_scope,
            )
        return contextlib.nullcontext()

    # ----------------------------------------------------------------- finish
    def _weights_finite(self) -> bool:
        """Every weight of every rank finite (a collective over all ranks: each holds its shards)."""
        bad = torch.zeros((), dtype=torch.int64, device=self.device)
        for p in self.model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            bad += (~torch.isfinite(local.detach())).sum()
        if self.world > 1:
            dist.all_reduce(bad)
        return int(bad) == 0

    def _ruined(self, first_step: int) -> str | None:
        """Why this launch cannot end well although it ran to the end: weights that are not finite, or
        no step of this launch that changed them."""
        if not self._weights_finite():
            return NonFiniteWeights.message(self.ckpt.latest())
        if self.step > first_step and not self.updated_losses:
            return (
                f"every step of this launch ({first_step + 1}..{self.step}) was skipped for non-finite "
                "loss or gradients: nothing was trained. Lower optim.lr or check the data"
            )
        return None

    def _summary(self, seconds: float, steps: int) -> int:
        # this launch's updates only: not skipped steps, not a resumed past
        real = self.updated_losses
        self.log.info(
            f"done: {steps} steps in {seconds:.1f}s ({steps / max(seconds, 1e-9):.2f} steps/s); "
            f"data: {describe_data(self.loader.stats())}"
        )
        if self.compiled is not None:
            c = self.compiled.record()
            self.log.info(
                f"compile: {c['compiled_graphs']} graphs, {c['graph_breaks']} graph breaks, "
                f"{c['recompiles']} recompiles after the first step"
            )
        if self.t.require_loss_decrease and len(real) < 6:
            self.log.info(
                f"note: train.require_loss_decrease not checked: it compares the mean of the first 3 "
                f"and last 3 losses of steps that updated the weights in this launch, and this launch "
                f"has {len(real)} (run at least 6 steps)"
            )
        if self.t.require_loss_decrease and len(real) >= 6:
            first, last = sum(real[:3]) / 3, sum(real[-3:]) / 3
            if not last < first:
                self.log.info(
                    f"FAIL: loss did not fall (first 3 steps {first:.4f}, last 3 {last:.4f})"
                )
                return ExitCode.NO_PROGRESS
            self.log.info(f"ok: mean loss of the first 3 steps {first:.4f} -> last 3 {last:.4f}")
        return ExitCode.OK

    def _record(self, window: Window) -> dict:
        """The log record of `window` with what only the trainer knows.  Collective under pipeline stages
        and expert capacity: every rank builds it, rank 0 writes it."""
        mem = peak_memory_gib(self.device)
        rec = window.record(
            step=self.step,
            world_size=self.world,
            peak_tflops=self.peak,
            mem_gib=mem,
            expert_counts=_pp_all_layers(self, window.counts),
            mem_gib_by_pp_rank=None if self.pipeline is None else _max_by_pp_rank(self, mem),
            skipped=self.loader.stats()["skipped"],
            nonfinite_steps=self.nonfinite_steps,
        )
        rec["recompute"] = describe_recompute(*recompute_setting(self.job.model))
        rec["offload"] = describe_offload(offload_setting(self.job.model))
        # compiled_graphs, graph_breaks, recompiles (moevlm.parallel.compile)
        if self.compiled is not None:
            rec.update(self.compiled.record())
        if self.prof.timing:  # seconds per component summed over the window, like step_time_s
            rec["components_s"] = self.prof.take_window()
        # collective: moe_dropped_tokens, _fraction, moe_overflowed_dispatches
        if self.overflow is not None:
            rec["moe_dropped_fraction_by_layer"] = self._dropped_by_layer()
            rec.update(self.overflow.record(self.device))  # over the window
        rec["mock"] = self.job.data.mock  # data.mock: "none" for real data
        if self.plan.model.moe.router_force_balance:
            rec["moe_router_force_balance"] = True
        reset_peak_memory(self.device)
        return rec

    def _dropped_by_layer(self) -> list[float | None]:
        """Per MoE layer (decoder order, every pipeline stage's), the capacity dispatchers' dropped over
        routed (token, expert) choices of the window, summed over the ranks holding different tokens;
        read before `OverflowCounter.record` resets the counts.  Collective, like that record."""
        rows = [
            torch.stack(
                [
                    torch.zeros((), dtype=torch.long)
                    if d.dropped is None
                    else d.dropped.cpu().long(),
                    torch.as_tensor(d.routed).cpu().long(),
                ]
            )
            for d in self.overflow.dispatchers
        ]
        local = torch.stack(rows).to(self.device) if rows else None
        # the ranks of one pipeline position hold the same layers
        if local is not None and self.parallel.loss_group is not None:
            dist.all_reduce(local, group=self.parallel.loss_group)
        if self.pipeline is not None:
            local = _pp_all_layers(self, local)
        if local is None:
            return []
        return [round(float(d) / float(r), 6) if r else None for d, r in local.tolist()]

    def close(self) -> None:
        self._settle_checkpoint()
        self.faults.closing()
        if hasattr(self, "prof"):
            self.prof.close()  # the end table of train.profile_components, a trace still open
        self.loader.close()
        if getattr(self, "held_out", None) is not None:
            self.held_out.close()
        self.log.close()
        self.run_claim.release()  # the run directory's lock (the kernel drops it anyway when the process ends)
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()  # a sweep's next job starts its own
        self.faults.close()  # the previous signal handlers, last: a signal while closing cannot cut it short

    def _settle_checkpoint(self) -> None:
        """A run ending early (an error) with an async save in flight: it completes; a failure of its
        write is one more line (the run's exit code is already the first error's)."""
        if not hasattr(self, "ckpt"):
            return
        try:
            self.ckpt.close()
        # (a failed write: CheckpointError; a failed collective or file: those of torch and the OS)
        except (OSError, RuntimeError) as err:
            self.log.info(f"the checkpoint written in the background failed: {err}")


# ------------------------------------------------------------------- helpers
class NonFiniteWeights(RuntimeError):
    """The weights themselves are not finite: no checkpoint of them is written."""

    def __init__(self, newest: Path | None):
        super().__init__(self.message(newest))

    @staticmethod
    def message(newest: Path | None) -> str:
        last = f"the newest checkpoint is {newest}" if newest else "there is no earlier checkpoint"
        return (
            "the weights are non-finite (an update made them so: lower optim.lr or check the data); "
            f"no checkpoint of them is written ({last})"
        )


def _pp_all_layers(tr: Trainer, counts: torch.Tensor | None) -> torch.Tensor | None:
    """Expert counts of every MoE layer: each pipeline rank holds its stages' layers."""
    if tr.pipeline is None:
        return counts
    every: list = [None] * tr.plan.dims.pp
    dist.all_gather_object(
        every, None if counts is None else counts.cpu(), group=tr.parallel.pp_group
    )
    parts = [c for c in every if c is not None]
    return torch.cat(parts) if parts else None


def _max_by_pp_rank(tr: Trainer, value: float) -> list[float]:
    """`value` (peak memory) per pipeline position: the largest over the ranks that hold its stages."""
    t = torch.zeros(tr.plan.dims.pp, dtype=torch.float64, device=tr.device)
    t[tr.pipeline.pp_rank] = value
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [round(x, 3) for x in t.tolist()]


class NoData:
    """The data source of a rank that reads nothing: a pipeline rank without the first stage
    receives each micro-batch's text from that stage's rank (`Pipeline.share`)."""

    wait_s = 0.0

    def stats(self) -> dict:
        return {"skipped": {}, "skipped_total": 0, "data_wait_s": 0.0}

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state) -> None:
        pass

    def close(self) -> None:
        pass


def _boundary_dtypes(bf16: bool, dp_mode: str) -> dict:
    """The dtypes of what crosses a pipeline stage boundary, as one process computes them: the
    residual stream is bf16 when FSDP casts the weights to bf16 (under autocast alone it stays fp32);
    deepstack features are sent in fp32 unless FSDP makes the whole tower bf16 (casting them up is exact)."""
    half = bf16 and dp_mode == "fsdp"
    dtype = torch.bfloat16 if half else torch.float32
    return {"h_dtype": dtype, "vision_dtype": dtype}


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(name)


def _seed(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def describe_data(stats: dict) -> str:
    """The loader's end-of-run counts (PackedLoader.stats) as one line of text."""
    if "samples_read" not in stats:  # NoData: a later pipeline stage reads nothing
        return "read on the first pipeline stage"
    skipped = stats.get("skipped") or {}
    skips = ", ".join(f"{reason} {n}" for reason, n in skipped.items()) if skipped else "none"
    bad = stats.get("shards_all_skipped") or {}
    shards = f"; shards with no usable sample: {', '.join(sorted(bad))}" if bad else ""
    fell = stats.get("fell_back") or {}
    fell = (
        "; trained without their images: " + ", ".join(f"{r} {n}" for r, n in fell.items())
        if fell
        else ""
    )
    images = f" with {stats['images_packed']} images" if "images_packed" in stats else ""
    return (
        f"{stats['samples_read']} samples read, {stats['samples_packed']} packed{images} into "
        f"{stats['batches']} batches (epoch {stats['epoch']}); skipped: {skips}{shards}{fell}; waited "
        f"{stats['data_wait_s']:.1f}s for data"
    )


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_reduce(values: list[float], device: torch.device, group) -> list[float]:
    """Sum over the data-parallel replicas (`group`; None when there is one)."""
    if group is None:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()


def _all_reduce_tensor(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        t = t.clone()
        dist.all_reduce(t, group=group)
    return t


def _offload_line(kind: str, model: torch.nn.Module) -> str:
    """The log line of parallel.optimizer_offload: where the state lives and this rank's host memory
    (16 bytes a trained element: FSDP's fp32 shard, its gradient and the AdamW state, or the host
    AdamW's master, gradient buffer and state)."""
    n = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel()
        for p in model.parameters()
        if p.requires_grad
    )
    what = {
        "fsdp": "FSDP2's CPU offload policy: this rank's fp32 parameter shards, their gradients and AdamW state",
        "host": "a host AdamW: fp32 masters, gradient buffers and AdamW state of this rank's parameters",
    }[kind]
    return f"parallel.optimizer_offload: {what} in host memory ({16 * n / 2**20:.1f} MiB)"
