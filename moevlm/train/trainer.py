"""The training loop: optimizer steps over a set-up `Run` until `train.steps`, checkpoints, the end.

    trainer = Trainer(job)          # a composed config; moevlm.train.setup builds the run
    code = trainer.run()            # a moevlm.train.exit_codes.ExitCode; train.py exits with it

One step = `grad_accum` micro-batches per data-parallel rank, all fetched first so the loss is
normalized by the step's global count of loss tokens before any backward.  docs/architecture.md
says why each part of the loop is built as it is.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moevlm.data.batch import MicroBatch
from moevlm.data.loader import NoData
from moevlm.model.moe import global_balance_loss, update_router_bias_
from moevlm.model.objective import objective
from moevlm.parallel.balance import step_load
from moevlm.parallel.compile import use_static_masks
from moevlm.train.checkpoint import CheckpointError, rng_state
from moevlm.train.evaluate import evaluate, val_due
from moevlm.train.exit_codes import ExitCode
from moevlm.train.export import export_run
from moevlm.train.failures import RUN, FailureContext, NonFiniteWeights, classify
from moevlm.train.faults import checkpoint_write_line
from moevlm.train.metrics import (
    Window,
    slowest_over_micro_batches,
    vision_flops_slots,
)
from moevlm.train.report import collapsed, ruined_by_skips, summary, window_record
from moevlm.train.setup import Run, autocast, data_rank, setup, weights_finite
from moevlm.train.step_graph import StepGraph


class Trainer:
    def __init__(self, job, sweep: tuple[str, int] | None = None, run: Run | None = None):
        """The loop over `run`, or over the run `setup` makes of `job` (`sweep`: its sweep dir and
        job number)."""
        run = run if run is not None else setup(job, sweep)
        self.plan, self.t, self.sweep = run.plan, run.plan.train, sweep
        self.launch, self.run_claim = run.launch, run.run_dir
        self.rank, self.world, self.device = run.launch.rank, run.launch.world, run.launch.device
        self.run_dir, self.log, self.faults = run.run_dir.path, run.log, run.faults
        self.model, self.parallel = run.built.model, run.built.parallel
        self.pipeline, self.compiled = run.built.parallel.pipeline, run.built.compiled
        self.overflow, self.frequencies = run.built.overflow, run.built.frequencies
        self.biased_routers = run.built.biased_routers
        self.loader, self.held_out = run.loader, run.held_out
        self.opt, self.sched, self.ckpt = run.optimizer, run.scheduler, run.ckpt
        self.peak, self.prof = run.peak_tflops, run.prof
        c = run.counters
        self.step, self.nonfinite_steps, self.in_a_row = c.step, c.nonfinite_steps, c.in_a_row
        self.losses: list[float] = list(c.losses)
        self.updated_losses: list[float] = []  # this launch's steps that changed the weights
        # this launch's last step with a finite loss: (loss, gradient norm), for the collapse check
        self.last_finite: tuple[float, float] | None = None
        self.grad_hook = None  # called with the trainer after clipping, before the update (tests)
        self._lr_used = self.opt.param_groups[0]["lr"]
        self.step_graph: StepGraph | None = None
        if self.t.cuda_graph == "step":
            use_static_masks(self.model)
            self.step_graph = StepGraph(
                self._step_gradients,
                self.opt,
                self.plan.model,
                self.device,
                warmup=self.t.cuda_graph_warmup,
            )

    # ------------------------------------------------------------- checkpoints
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
        try:
            path = self.ckpt.save(
                self.step,
                model=self.model,
                optimizer=self.opt,
                extra={"scheduler": self.sched, "counters": counters},
                per_rank={"data": self.loader.state_dict(), "rng": rng_state()},
            )
        except (OSError, MemoryError) as err:  # a read-only or full folder: one line, exit 7
            raise CheckpointError(
                checkpoint_write_line(err, self.ckpt.root, self.ckpt.latest())
            ) from err
        if complete:
            self._wait_for_checkpoint()
        return path

    def _wait_for_checkpoint(self) -> None:
        """train.async_checkpoint: until the save in flight is complete (its failure raised here)."""
        if (path := self.ckpt.pending) is not None:
            self.faults.at(f"waiting for the background write of checkpoint {path.name}", self.step)
            try:
                self.ckpt.wait()
            except (OSError, MemoryError) as err:
                raise CheckpointError(
                    checkpoint_write_line(err, self.ckpt.root, self.ckpt.latest())
                ) from err

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
                    self.log.log({**window_record(self, window), **val})
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
                if self.step < self.t.steps:
                    self.log.check_tensorboard()  # a TensorBoard failure: after the due checkpoint
            if ruined := self._ruined(first_step):
                self.log.info(f"stopping at step {self.step}: {ruined}")
                return ExitCode.NONFINITE
            if self.t.checkpoint_at_end and self.step > first_step and not self._checkpoint_due():
                self.save()
            self._wait_for_checkpoint()
            self.log.check_tensorboard()
            self.export()
            code = summary(self, time.perf_counter() - t_start, self.step - first_step)
        # every failure class (moevlm.train.failures.FAILURES): one line and its code; else a bug
        except Exception as err:
            failure = classify(err, phase=RUN, ctx=self._failure_context())
            if failure.code == ExitCode.BUG:
                raise
            failure.say(self.log.info, self.faults.prefix)
            code = failure.code
        finally:
            self.close()
        return code

    def _failure_context(self) -> FailureContext:
        w = self.faults.watchdog
        return FailureContext(
            step=self.step,
            doing=w.describe(),
            elapsed_s=w.elapsed(),
            timeout_s=self.faults.timeout_s,
            intact=lambda: (self.ckpt.complete() or [None])[-1],
        )

    def validate(self) -> dict:
        """The held-out loss of the current weights (moevlm.train.evaluate): {"val_loss", "val_tokens"},
        the same on every rank (collective)."""
        return evaluate(self, self.held_out)

    def export(self) -> None:
        """train.export_adapter and train.export_hf, at the end of the run (moevlm.train.export)."""
        export_run(self)

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
        dp = self.plan.dims.dp
        with self._phase("data-parallel token-count all-reduce"):
            # per micro-batch (FSDP's reduce-scatters and the expert all-to-alls meet every one), this
            # data-parallel rank's slowest cp share in its own slot: one SUM gives every rank all slots
            vision_slots = vision_flops_slots(micro, data_rank(self.plan, self.launch), dp)
            totals = all_reduce_values(
                [
                    sum(m.loss_tokens for m in micro),
                    sum(m.useful_tokens for m in micro),
                    sum(m.flops for m in micro),
                    sum(m.images for m in micro),
                    sum(m.n_image for m in micro),
                    sum(sum(m.vision_flops_cp) for m in micro),
                    sum(m.videos for m in micro),
                    sum(m.n_video for m in micro),
                    *vision_slots,
                ],
                self.device,
                self.parallel.dp_group,
            )
        loss_tokens = max(totals[0], 1.0)
        if self.frequencies is not None:
            self.frequencies.begin_step()
        if self.step_graph is not None:
            with self._phase(
                "forward/backward, gradient reduction and clipping (train.cuda_graph=step)"
            ):
                loss_sum, aux_sum, counts, grad_norm = self.step_graph.gradients(micro, loss_tokens)
            if self.step_graph.replays == 1 and self.step_graph.grads_graph is not None:
                self.log.info(
                    f"train.cuda_graph=step: step {self.step + 1} captured; later steps replay it"
                )
        else:
            with self._phase("forward/backward"):
                fb = self._pipeline_forward_backward if self.pipeline else self._forward_backward
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
            loss = sum_over(loss_sum, self.parallel.loss_group) / loss_tokens
            aux_sum = sum_over(aux_sum, self.parallel.dp_group)
        ok = bool(torch.isfinite(loss) & torch.isfinite(grad_norm))
        self.step += 1
        self.losses.append(float(loss))
        if ok:
            self.updated_losses.append(float(loss))
        if math.isfinite(float(loss)):
            self.last_finite = (float(loss), float(grad_norm))
        with self._phase("optimizer step", span="optimizer"):
            self._update(ok)
        rate = self.plan.model.moe.router_bias_rate
        if ok and rate > 0 and counts is not None:
            with self._phase("router bias update (data-parallel load all-reduce)"):
                load = step_load(counts, self.parallel.dp_group)
                update_router_bias_(self.biased_routers, load, rate)
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
            videos=int(totals[6]),
            video_tokens=int(totals[7]),
            # the slowest (dp, cp) rank's vision FLOPs summed over the micro-batches, and the mean rank's
            vision_max=slowest_over_micro_batches(totals[8:], dp),
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
        inputs = (mb.to(self.device).forward_kwargs() for mb in micro)  # each copied when it runs
        return self._run_micro_batches(inputs, len(micro), loss_tokens)

    def _step_gradients(self, inputs: list[dict], loss_tokens: torch.Tensor):
        """What train.cuda_graph=step captures (moevlm.train.step_graph): the micro-batches' forward
        and backward, the gradient reduction and the clip: (loss sum, aux share, counts, norm)."""
        loss_sum, aux_sum, counts = self._run_micro_batches(inputs, len(inputs), loss_tokens)
        self.parallel.finish_gradients()
        return loss_sum, aux_sum, counts, self._clip()

    def _run_micro_batches(self, inputs, n: int, loss_tokens: float | torch.Tensor):
        """The model's inputs of `n` micro-batches (an iterable of keyword arguments), each forward
        then backward: (sum of token losses, aux share, expert counts)."""
        loss_sum = torch.zeros((), device=self.device)
        aux_sum, counts = torch.zeros((), device=self.device), None
        # the aux loss is averaged over micro-batches and ranks
        share = n * self.plan.dims.dp
        moe = self.plan.model.moe
        for kwargs in inputs:
            with self._autocast():
                out = self.model(**kwargs)
            lm_sum = out.lm_loss * out.num_loss_tokens
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
        # the schedule, less the forward components (timed inside it)
        with self._phase("forward/backward", span="backward"):
            lm_sum, aux, counts = self.pipeline.forward_backward(
                on_device, loss_tokens, len(micro) * self.plan.dims.dp
            )
        sums = sum_over(torch.stack([lm_sum, aux]), self.parallel.pp_group)
        return sums[0], sums[1], counts

    def _update(self, ok: bool) -> None:
        self._lr_used = self.opt.param_groups[0]["lr"]
        if ok:
            self.step_graph.update() if self.step_graph is not None else self.opt.step()
            self.sched.step()
            self.in_a_row = 0
        else:
            self.nonfinite_steps += 1
            self.in_a_row += 1
        if self.step_graph is None or not self.step_graph.captured:
            self.opt.zero_grad(set_to_none=True)  # (a captured step's graph rewrites its gradients)

    def _clip(self) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.plan.optim.grad_clip if self.plan.optim.grad_clip > 0 else math.inf
        return self.parallel.clip_grad_norm_(params, max_norm)

    def _micro_batch(self) -> MicroBatch:
        """`train.micro_batch_size` packed rows of this rank's loader, finished data-side (moevlm.data.batch)."""
        return MicroBatch.read(
            self.loader,
            rows_per_batch=self.t.micro_batch_size,
            model=self.plan.model,
            freeze_vision=self.plan.job.model.freeze_vision,
            cp=self.plan.dims.cp,
        )

    def _autocast(self):
        return autocast(self.plan, self.device)

    # ----------------------------------------------------------------- finish
    def _weights_finite(self) -> bool:
        return weights_finite(self.model, self.launch)

    def _ruined(self, first_step: int) -> str | None:
        """Why this launch cannot end well although it ran to the end (exit 3, however few steps it
        took): weights that are not finite; most of its steps skipped (more than half of them, as
        `ruined_by_skips` counts); or the model collapsed (`collapsed`)."""
        if not self._weights_finite():
            return NonFiniteWeights.message(self.ckpt.latest())
        ran = self.step - first_step
        if why := ruined_by_skips(ran, ran - len(self.updated_losses), first_step):
            return why
        if self.last_finite is not None:
            return collapsed(*self.last_finite, self.plan.model.text.vocab_size)
        return None

    def close(self) -> None:
        self._settle_checkpoint()
        self.faults.closing()
        self.prof.close()  # the end table of train.profile_components, a trace still open
        self.loader.close()
        if self.held_out is not None:
            self.held_out.close()
        self.log.close()
        self.run_claim.release()  # the run directory's lock (the kernel drops it anyway at exit)
        if self.launch.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()  # a sweep's next job starts its own
        self.faults.close()  # the previous signal handlers, last: a signal while closing cannot cut it short

    def _settle_checkpoint(self) -> None:
        """A run ending early (an error) with an async save in flight: it completes; a failure of its
        write is one more line (the run's exit code is already the first error's)."""
        try:
            self.ckpt.close()
        # (a failed write: CheckpointError; a failed collective or file: those of torch and the OS)
        except (OSError, RuntimeError) as err:
            self.log.info(f"the checkpoint written in the background failed: {err}")


def all_reduce_values(values: list[float], device: torch.device, group) -> list[float]:
    """Sum over the data-parallel replicas (`group`; None when there is one)."""
    if group is None:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()


def sum_over(t: torch.Tensor, group) -> torch.Tensor:
    """A copy of `t` summed over `group` (None: `t` itself)."""
    if group is not None:
        t = t.clone()
        dist.all_reduce(t, group=group)
    return t
