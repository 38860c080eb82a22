"""The training data loader: this rank's rows of the job's logical streams, fixed-shape packed rows
(packing.PackedRow), a resumable state and skip statistics.

    loader = build_loader(cfg.data, model_cfg, rank=dp_rank, world=dp_size)
    for row in loader:                # PackedRow: fixed-shape tensors + counts (batch.MicroBatch.read
        ...                           # makes one micro-batch of several rows)
    with build_loader(DataConfig(shards="sample"), model_cfg) as loader:   # workers stopped at the end
        row = next(loader)
    ckpt["data"] = loader.state_dict()          # what each of this rank's streams has delivered
    loader.load_state_dict(state.merge_states(saved))   # exactly there, on any data-parallel layout
    loader.stats()                              # skipped by reason, samples read/packed, data wait
Its parts: checks.py (the config), streams.py (read, encode, pack), state.py, lifetime.py (workers).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from moevlm.data.checks import (
    SAMPLE_TOKENIZER,
    check_config,
    resolve_streams,
    sample_tokenizer_fits,
    tokenizer_choice,
)
from moevlm.data.config import DataConfig
from moevlm.data.converted import ensure_converted
from moevlm.data.errors import FALLBACKS, DataError, DataSetupError
from moevlm.data.hf_datasets import is_dataset, open_dataset
from moevlm.data.lifetime import WORKER_REAP_GRACE_S, close_at_exit, dead_workers, worker_death
from moevlm.data.packing import PackedRow, VisionFlops, vision_budget_set
from moevlm.data.reader import expand_shards, fingerprint, shard_counts, shard_identities
from moevlm.data.sample_cache import describe as describe_sample
from moevlm.data.sample_cache import ensure_sample
from moevlm.data.state import DataIdentity, StreamState
from moevlm.data.streams import Delivery, PackedDataset
from moevlm.data.text import ChatEncoder, load_tokenizer

log = logging.getLogger(__name__)


class PackedLoader:
    """This rank's rows of the job's streams, in the same order for every data-parallel size and
    num_workers (docs/architecture.md, Data), with the streams' resumable state and skip statistics."""

    def __init__(
        self,
        cfg: DataConfig,
        *,
        tokenizer_path: str,
        patch_dim: int,
        rank: int = 0,
        world: int = 1,
        vision: VisionFlops | None = None,
    ):
        self.vision = vision
        self.cfg, self.tokenizer_path, self.patch_dim, self.rank, self.world = (
            cfg,
            tokenizer_path,
            patch_dim,
            rank,
            world,
        )
        self.shards = expand_shards(cfg.shards)
        self.counts = shard_counts(self.shards)
        self.streams, self.workers = resolve_streams(cfg, rank, world, len(self.shards))
        # what a saved state must match (each shard's [name, size, hash] included)
        self.identity = DataIdentity(
            fingerprint(self.shards),
            shard_identities(self.shards),
            cfg.seed,
            self.streams,
            cfg.mock,
        )
        # this rank's streams, in delivery order
        self.local = list(range(rank, self.streams, world))
        self.states: dict[int, StreamState] = {}
        self.offset = 0  # local index of the stream whose row comes next
        self.wait_s = 0.0
        self._it = None

    # ---------------------------------------------------------------- iteration
    def __iter__(self):
        if self._it is None:
            self._it = iter(self._dataloader())
        return self

    def __next__(self) -> PackedRow:
        if self._it is None:
            iter(self)
        t0 = time.perf_counter()
        while True:
            delivery, error = self._next_row()
            # the workers are stopped already; a later iteration restarts them
            if error is not None:
                raise DataError(error)
            self.states[delivery.state.stream] = delivery.state
            if delivery.row is not None:  # a row, not a finished stream's last state
                break
        self.wait_s += time.perf_counter() - t0
        self.offset = (self.offset + 1) % len(self.local)
        return delivery.row

    def _next_row(self) -> tuple[Delivery | None, str | None]:
        """The next delivery, or the one-line message of a DataError (from a worker, torch's text is
        a header, the worker's traceback, then our line; a dead worker: `worker_death`'s line)."""
        try:
            return next(self._it), None
        except DataError as err:
            # torch's re-raise leaves a reference cycle through this traceback that keeps the worker
            # iterator alive until a garbage collection, which then waits 5 s per worker: drop both now
            err.__traceback__ = None
            self.close()
            return None, str(err).strip().rsplit("\n", 1)[-1].split("DataError: ", 1)[-1]
        except RuntimeError as err:  # (after DataError, a RuntimeError too)
            line = worker_death(err, getattr(self._it, "_workers", ()))
            if line is None:
                raise
            self.close()
            return None, line
        except (ConnectionError, EOFError) as err:
            # a worker killed while its batch was in transit: the batch's shared-memory handle comes
            # from the dead worker's socket (a reset connection), and torch, asking before the fork
            # server reaped it, took the worker for alive and raised the socket's error as it was
            dead = dead_workers(getattr(self._it, "_workers", ()), grace_s=WORKER_REAP_GRACE_S)
            if not dead:
                raise
            pids = ", ".join(str(w.pid) for w in dead)
            torch_text = f"DataLoader worker (pid(s) {pids}) exited unexpectedly"
            line = worker_death(RuntimeError(torch_text), dead)
            err.__traceback__ = None
            self.close()
            return None, line

    def _dataloader(self) -> DataLoader:
        cfg = self.cfg
        ds = PackedDataset(
            cfg,
            self.shards,
            self.counts,
            self.tokenizer_path,
            self.patch_dim,
            self.streams,
            self.local,
            dict(self.states),
            self.offset,
            self.vision,
        )
        pin = (
            torch.cuda.is_available()
            if cfg.pin_memory == "auto"
            else str(cfg.pin_memory).lower() == "true"
        )
        if self.workers == 0:
            return DataLoader(ds, batch_size=None, num_workers=0, pin_memory=pin)
        ctx = mp.get_context(cfg.start_method)
        if cfg.start_method == "forkserver":
            ctx.set_forkserver_preload(["moevlm.data.deaf", "moevlm.data.loader"])
        close_at_exit(self)
        return DataLoader(
            ds,
            batch_size=None,
            num_workers=self.workers,
            pin_memory=pin,
            persistent_workers=True,
            prefetch_factor=cfg.prefetch_factor,
            multiprocessing_context=ctx,
            in_order=True,
        )

    def __enter__(self) -> PackedLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stops the worker processes (a later iteration starts new ones from the current state): torch's
        orderly stop, then SIGKILL for any left (they ignore SIGTERM)."""
        it, self._it = self._it, None
        workers = list(getattr(it, "_workers", ()))
        if hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        for w in workers:
            if w.is_alive():
                w.kill()
                w.join(timeout=10)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """This rank's streams' states, keyed by global stream id (merge the ranks' with `merge_states`)."""
        return {
            **self.identity.header(),
            "states": {str(s): st.to_dict() for s, st in sorted(self.states.items())},
        }

    def load_state_dict(self, sd: dict) -> None:
        """Takes this rank's streams from `sd` (one rank's state or several merged)."""
        self.identity.check(sd, self.cfg.allow_changed_shards)
        self.close()
        self.states = {
            int(s): StreamState.from_dict(st)
            for s, st in sd["states"].items()
            if int(s) in self.local
        }
        self.offset = sum(st.batches for st in self.states.values()) % len(self.local)

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict:
        states = self.states.values()
        skipped, unusable = Counter(), Counter()
        for s in states:
            skipped.update(s.skipped)
            unusable.update(s.shards_all_skipped)
        fell_back = {r: skipped.pop(r) for r in sorted(FALLBACKS) if r in skipped}
        return {
            "skipped": dict(sorted(skipped.items())),
            "skipped_total": sum(skipped.values()),
            "fell_back": fell_back,
            "images_packed": sum(s.images_packed for s in states),
            "videos_packed": sum(s.videos_packed for s in states),
            "over_vision_budget": sum(s.over_vision_budget for s in states),
            "shards_all_skipped": dict(sorted(unusable.items())),
            "samples_read": sum(s.read for s in states),
            "samples_packed": sum(s.packed for s in states),
            "batches": sum(s.batches for s in states),
            "epoch": min((s.epoch for s in states), default=0),
            "data_wait_s": self.wait_s,
        }


def build_loader(
    cfg: DataConfig, model_cfg=None, *, rank: int = 0, world: int = 1, hf_checkpoint: str = ""
) -> PackedLoader:
    """Checks the data config against the model's (patch geometry, special token ids,
    budgets) before any worker starts, then returns the loader (a context manager: `with`
    closes it).  `cfg.shards="sample"` is the embedded sample set (`sample_set`).
    `hf_checkpoint` is the model.hf_checkpoint folder, the tokenizer's last fallback
    (`find_tokenizer`)."""
    check_config(cfg, model_cfg, world)
    beside = None  # the shards whose folder may hold a tokenizer.json: cfg's
    say = rank == 0 and cfg.shards != "sample"  # the sample set's line names its folder
    if cfg.shards == "sample":
        cfg = dataclasses.replace(cfg, shards=str(sample_set(log_it=rank == 0)))
    elif is_dataset(cfg.shards):
        cfg, beside = dataclasses.replace(cfg, shards=str(converted(cfg, rank == 0))), []
    tok = _tokenizer(cfg, model_cfg, hf_checkpoint, beside, say)
    if model_cfg is not None:
        ChatEncoder(load_tokenizer(tok)).check_model(model_cfg)
    im = cfg.image
    patch_dim = 3 * im.temporal_patch_size * im.patch_size**2
    if cfg.mock != "none" and rank == 0:
        log.warning(
            "data.mock=%s: MOCK DATA, %s; the same loader path and batch shapes as real data, for "
            "measuring only",
            cfg.mock,
            "text only (images and their tokens dropped)"
            if cfg.mock == "image_free"
            else "random pixels in place of the decoded images",
        )
    if model_cfg is None and vision_budget_set(cfg.pack.max_vision_flops):
        raise ValueError(
            f"data.pack.max_vision_flops={cfg.pack.max_vision_flops} counts vision FLOPs with the model's "
            "formula: build the loader with the model config"
        )
    vision = None if model_cfg is None else VisionFlops.for_images(model_cfg, im)
    return PackedLoader(
        cfg, tokenizer_path=tok, patch_dim=patch_dim, rank=rank, world=world, vision=vision
    )


def converted(cfg: DataConfig, log_it: bool = True) -> Path:
    """data.shards=<a datasets output>: its shards, converted once into the cache (moevlm.data.hf_datasets;
    safe when several processes ask at once), and said in a line (the builder shows progress)."""
    try:
        src = open_dataset(Path(cfg.shards), cfg.split or None)
    except (ValueError, FileNotFoundError) as err:
        raise DataSetupError(f"data.shards={cfg.shards}: {err}") from None
    folder, built = ensure_converted(src, say=log.info)
    if log_it and not built:
        log.info("data.shards=%s: reusing its conversion %s", cfg.shards, folder)
    return folder


def _tokenizer(cfg: DataConfig, model_cfg, hf_checkpoint: str, shards, say: bool) -> str:
    """tokenizer_choice for the loader (`shards` None: cfg's; []: none beside), the sample set's for a
    model its ids fit when nothing else is there; where it came from said in a line unless
    data.tokenizer set it (and `say`)."""
    fits = model_cfg is not None and not hf_checkpoint and sample_tokenizer_fits(model_cfg)
    built = []

    def sample() -> str:
        path, now = ensure_sample()
        built.append(now)
        return str(path / "tokenizer.json")

    listed = expand_shards(cfg.shards) if shards is None else shards
    tok, source = tokenizer_choice(cfg, listed, hf_checkpoint, sample if fits else None)
    if say and source == SAMPLE_TOKENIZER:
        log.info(
            "tokenizer: the sample set's %s (%s; no data.tokenizer, none beside the shards, no "
            "model.hf_checkpoint: the tiny model's ids)",
            tok,
            "built now" if built[0] else "reused",
        )
    elif say and source != "data.tokenizer":
        log.info("tokenizer: %s (%s)", tok, source)
    return tok


def sample_set(log_it: bool = True):
    """data.shards=sample: the embedded sample set's folder, built once per content version in the
    cache (moevlm.data.sample_cache; safe when several processes ask at once) and logged."""
    path, built = ensure_sample()
    if log_it:
        log.info(describe_sample(path, built))
    return path


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
