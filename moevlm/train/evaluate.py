"""Validation: the loss on fixed held-out rows, on a schedule, the same number under any layout.

    held = HeldOut(loader, batches=4, grad_accum=2, rows=1, model=model_cfg)   # Trainer.__init__
    if val_due(step, train_cfg):
        record.update(evaluate(trainer, held))   # {"val_loss": ..., "val_tokens": ...}, every rank
    held.close()

Configured by `data.val_shards` (the forms of data.shards, `sample` included), `train.val_every`
(steps; 0 = off) and `train.val_batches` (global batches of held-out rows per evaluation).  Due
after every val_every-th step and after the last; `val_loss` is the LM loss alone, from the same
held-out rows each time, with training left untouched (why: docs/architecture.md).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from moevlm.data.batch import MicroBatch
from moevlm.train.checkpoint import rng_state, set_rng_state


class HeldOut:
    """The held-out rows of this rank: `loader` None on a pipeline rank without the first stage (it
    receives each micro-batch from that stage's rank, as in training)."""

    def __init__(
        self,
        loader,
        *,
        batches: int,
        grad_accum: int,
        rows: int,
        model,
        freeze_vision: bool = False,
    ):
        self.loader, self.batches, self.grad_accum, self.rows = loader, batches, grad_accum, rows
        self.model, self.freeze_vision = model, freeze_vision
        self.fresh = None if loader is None else loader.state_dict()

    def global_batches(self):
        """This rank's micro-batches of each held-out global batch, from the loader's fresh state (None
        per global batch where this rank reads nothing)."""
        if self.loader is None:
            yield from (None for _ in range(self.batches))
            return
        self.loader.load_state_dict(self.fresh)
        try:
            for _ in range(self.batches):
                yield [
                    MicroBatch.read(
                        self.loader,
                        rows_per_batch=self.rows,
                        model=self.model,
                        freeze_vision=self.freeze_vision,
                    )
                    for _ in range(self.grad_accum)
                ]
        finally:
            self.loader.close()  # no worker reads ahead while training goes on

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()


def val_due(step: int, t) -> bool:
    """Whether validation follows step `step` (train config `t`)."""
    return bool(t.val_every) and (step % t.val_every == 0 or step == t.steps)


def evaluate(tr, held: HeldOut) -> dict:
    """The held-out loss of the trainer's current weights: {"val_loss", "val_tokens"}, the same on every
    rank (collective over all of them)."""
    model, state = tr.model, rng_state()
    saved = _capacity_counts(tr.overflow)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _not_recompiles(tr.compiled):
            lm_sum, tokens = _forward(tr, held)
    finally:
        model.train(was_training)
        _reshard(model)
        _restore_capacity_counts(tr.overflow, saved)
        set_rng_state(state)
    tr.faults.at("validation loss all-reduce")
    lm_sum = _sum(lm_sum, tr.parallel.loss_group)
    if tr.pipeline is not None:
        lm_sum = _sum(lm_sum, tr.parallel.pp_group)
    tokens = _sum(tokens, tr.parallel.dp_group)
    n = int(tokens)
    return {"val_loss": float(lm_sum) / n if n else None, "val_tokens": n}


def _forward(tr, held: HeldOut) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (sum of token losses, loss tokens) over the held-out global batches, float64."""
    lm_sum = torch.zeros((), dtype=torch.float64, device=tr.device)
    tokens = torch.zeros((), dtype=torch.float64, device=tr.device)
    for micro in held.global_batches():
        tr.faults.at("validation data")
        if tr.pipeline is not None:
            micro = tr.pipeline.share(micro, tr.device)
        tokens += sum(mb.loss_tokens for mb in micro)
        tr.faults.at("validation forward")
        on_device = [mb.to(tr.device) for mb in micro]
        if tr.pipeline is not None:  # (its stages run under the trainer's autocast)
            lm_sum += tr.pipeline.forward_only(on_device)
            continue
        for mb in on_device:
            with tr._autocast():
                out = tr.model(**mb.forward_kwargs())
            lm_sum += (out.lm_loss * out.num_loss_tokens).double()
    return lm_sum, tokens


def _sum(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        t = t.clone()
        dist.all_reduce(t, group=group)
    return t


def _reshard(model: torch.nn.Module) -> None:
    """FSDP2 units back to their shards: a forward with no backward leaves the roots' weights whole."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _capacity_counts(overflow) -> list | None:
    if overflow is None:
        return None
    return [(d.dropped, d.flagged, d.routed) for d in overflow.dispatchers]


def _restore_capacity_counts(overflow, saved: list | None) -> None:
    if overflow is None:
        return
    for d, (dropped, flagged, routed) in zip(overflow.dispatchers, saved):
        d.dropped, d.flagged, d.routed = dropped, flagged, routed


@contextlib.contextmanager
def _not_recompiles(compiled):
    """Graphs compiled inside (the no-grad variants of train.compile's blocks) are not recompiles of the
    training step: moevlm.parallel.compile.CompileCounters starts its count later by as many."""
    from moevlm.parallel.compile import compile_counters

    before = compile_counters() if compiled is not None else None
    try:
        yield
    finally:
        if before is not None and compiled.warm_at is not None:
            grown = compile_counters()["frames"] - before["frames"]
            compiled.warm_at = {**compiled.warm_at, "frames": compiled.warm_at["frames"] + grown}
