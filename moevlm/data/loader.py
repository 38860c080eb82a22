"""The training data loader: shards -> workers (decode, tokenize, pack) ->
fixed-shape micro-batches, with a resumable state and skip statistics.

    loader = build_loader(cfg.data, model_cfg, rank=dp_rank, world=dp_size)
    for batch in loader:              # dict of fixed-shape tensors + counts (see packing.py)
        ...
    ckpt["data"] = loader.state_dict()          # what each worker has delivered
    loader.load_state_dict(ckpt["data"])        # continues exactly there
    loader.stats()                              # skipped by reason, samples, tokens, data wait

Design choices:
- Workers pack.  Each worker runs read -> shuffle -> encode -> pack and yields
  whole micro-batches, so the main process only pins and hands over tensors;
  `DataLoader(batch_size=None)` keeps its order (round robin over workers).
- Worker processes start with `forkserver` (configurable): forking a process
  that has initialised CUDA (or PIL with CUDA) is unsafe; forkserver forks from
  a clean server that preloads this module, so starting is cheap too.
- Exact resume.  Every batch carries its worker's state after producing it:
  epoch, next read position, the positions held in the shuffle buffer and in
  the packer, the shuffle draw count, skip counters.  The loader keeps the
  state of the last *delivered* batch of each worker (prefetched batches do not
  count).  Workers are logical: physical worker p plays logical worker
  (p + offset) % W, and the saved offset is the logical worker whose batch
  would have come next, so the round robin resumes at the right worker.  On
  resume a worker re-reads (never re-decodes more than) the samples it held
  and continues reading where it stopped.
- Workers re-import the launching script as a module (forkserver, like
  spawn): scripts need the `if __name__ == "__main__":` guard.
- Resuming needs the same shards, seed, data-parallel size and num_workers
  (checked, with a message); anything else would change which worker reads
  which shard.
- Streams are infinite by default (`epochs: null`): each worker starts its next
  epoch (a new shard permutation) when its shards run out.  Exact resume is
  guaranteed for infinite streams; with a finite `epochs` the tail after the
  first worker runs out is not resumable (DataLoader skips exhausted workers).
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import time
from collections import Counter

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from moevlm.data.config import DataConfig
from moevlm.data.encode import SampleEncoder
from moevlm.data.errors import SkipCounter, SkipSample
from moevlm.data.packing import Packer, collate
from moevlm.data.reader import ShardPlan, ShuffleBuffer, expand_shards, fingerprint, shard_counts
from moevlm.data.text import ChatEncoder, load_tokenizer

STATE_VERSION = 1


def fresh_state(worker: int) -> dict:
    return {"worker": worker, "epoch": 0, "next": [0, 0], "shuffle": [], "draws": 0, "packer": [],
            "skipped": {}, "read": 0, "packed": 0, "batches": 0}


class WorkerStream:
    """One logical worker: read -> shuffle -> encode -> pack, yielding batches with state."""

    def __init__(self, ds: PackedDataset, worker: int, num_workers: int):
        cfg = ds.cfg
        self.cfg, self.ds, self.worker = cfg, ds, worker
        self.plan = ShardPlan(ds.shards, cfg.seed, ds.rank, ds.world, worker, num_workers,
                              cfg.shuffle_shards, ds.counts)
        chat = ChatEncoder(load_tokenizer(ds.tokenizer_path))
        self.pad_id = chat.eot_id
        self.encode = SampleEncoder(chat, cfg.image, cfg.pack, cfg.caption_prompt)
        self.packer = Packer(cfg.pack)
        self.st = copy.deepcopy(ds.states.get(worker)) or fresh_state(worker)
        self.skips = SkipCounter(self.st["skipped"])
        self.shuffle = self._new_buffer(self.st["epoch"], self.st["draws"])
        self._restore()

    def _new_buffer(self, epoch: int, draws: int = 0) -> ShuffleBuffer:
        return ShuffleBuffer(self.cfg.shuffle_buffer, (self.cfg.seed, epoch, self.ds.rank, self.worker), draws)

    def _restore(self) -> None:
        held = [tuple(p) for p in self.st["shuffle"]] + [tuple(p) for p in self.st["packer"]]
        raw = self.plan.fetch(held) if held else {}
        self.shuffle.items = [(tuple(p), raw[tuple(p)]) for p in self.st["shuffle"]]
        for p in self.st["packer"]:
            self.packer.push(self.encode(raw[tuple(p)], tuple(p)))  # encoded fine before the checkpoint

    def __iter__(self):
        epochs = self.cfg.epochs
        while epochs is None or self.st["epoch"] < epochs:
            read_before = self.st["read"]
            for pos, raw in self.plan.read(self.st["epoch"], tuple(self.st["next"]), self.skips):
                self.st["next"], self.st["read"] = [pos[1], pos[2] + 1], self.st["read"] + 1
                out = self.shuffle.push(pos, raw)
                if out is not None:
                    yield from self._feed(*out)
            while (out := self.shuffle.pop()) is not None:
                yield from self._feed(*out)
            if self.st["read"] == read_before and self.st["next"] == [0, 0]:
                raise RuntimeError(f"worker {self.worker} of rank {self.ds.rank} read no sample in epoch "
                                   f"{self.st['epoch']} from {self.plan.mine(self.st['epoch'])}: its shards are "
                                   "empty or unreadable (see the skip counts)")
            self.st["epoch"] += 1
            self.st["next"], self.st["draws"] = [0, 0], 0
            self.shuffle = self._new_buffer(self.st["epoch"])
        while self.packer.held:
            yield self._batch(self.packer.pop())

    def _feed(self, pos, raw):
        try:
            self.packer.push(self.encode(raw, pos))
        except SkipSample as err:
            self.skips.add(err, f"{raw.get('__url__', '?')}:{raw.get('__key__', '?')}")
            return
        while self.packer.full():
            yield self._batch(self.packer.pop())

    def _batch(self, samples) -> dict:
        st = self.st
        st["packed"] += len(samples)
        st["batches"] += 1
        st["draws"] = self.shuffle.draws
        st["shuffle"] = [list(p) for p in self.shuffle.positions()]
        st["packer"] = [list(s.pos) for s in self.packer.held]
        st["skipped"] = dict(self.skips)
        batch = collate(samples, self.cfg.pack, self.ds.patch_dim, self.pad_id)
        batch["state"] = copy.deepcopy(st)
        return batch


class PackedDataset(IterableDataset):
    """What each worker process receives (pickled): config, shard list, states."""

    def __init__(self, cfg: DataConfig, shards, counts, tokenizer_path, patch_dim, rank, world, states, offset):
        self.cfg, self.shards, self.counts, self.tokenizer_path = cfg, shards, counts, tokenizer_path
        self.patch_dim, self.rank, self.world, self.states, self.offset = patch_dim, rank, world, states, offset

    def __iter__(self):
        info = get_worker_info()
        n = info.num_workers if info is not None else 1
        p = info.id if info is not None else 0
        return iter(WorkerStream(self, (p + self.offset) % n, n))


class PackedLoader:
    def __init__(self, cfg: DataConfig, *, tokenizer_path: str, patch_dim: int, rank: int = 0, world: int = 1):
        self.cfg, self.tokenizer_path, self.patch_dim, self.rank, self.world = cfg, tokenizer_path, patch_dim, rank, world
        self.shards = expand_shards(cfg.shards)
        self.counts = shard_counts(self.shards)
        self.num_streams = max(1, cfg.num_workers)
        ShardPlan(self.shards, world=world, rank=rank, num_workers=self.num_streams)  # validates the split early
        self.states: dict[int, dict] = {}
        self.offset = self.delivered = 0
        self.wait_s = 0.0
        self._it = None

    # ---------------------------------------------------------------- iteration
    def __iter__(self):
        if self._it is None:
            self._it = iter(self._dataloader())
        return self

    def __next__(self) -> dict:
        if self._it is None:
            iter(self)
        t0 = time.perf_counter()
        batch = next(self._it)
        self.wait_s += time.perf_counter() - t0
        state = batch.pop("state")
        self.states[state["worker"]] = state
        self.delivered += 1
        return batch

    def _dataloader(self) -> DataLoader:
        cfg = self.cfg
        ds = PackedDataset(cfg, self.shards, self.counts, self.tokenizer_path, self.patch_dim, self.rank,
                           self.world, dict(self.states), (self.offset + self.delivered) % self.num_streams)
        self.offset, self.delivered = (self.offset + self.delivered) % self.num_streams, 0
        pin = torch.cuda.is_available() if cfg.pin_memory == "auto" else str(cfg.pin_memory).lower() == "true"
        if cfg.num_workers == 0:
            return DataLoader(ds, batch_size=None, num_workers=0, pin_memory=pin)
        ctx = mp.get_context(cfg.start_method)
        if cfg.start_method == "forkserver":
            ctx.set_forkserver_preload(["moevlm.data.loader"])
        return DataLoader(ds, batch_size=None, num_workers=cfg.num_workers, pin_memory=pin,
                          persistent_workers=True, prefetch_factor=cfg.prefetch_factor,
                          multiprocessing_context=ctx, in_order=True)

    def close(self) -> None:
        """Stops the worker processes (a later iteration starts new ones from the current state)."""
        self._it = None

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "shards": fingerprint(self.shards), "seed": self.cfg.seed,
                "rank": self.rank, "world": self.world, "num_workers": self.num_streams,
                "offset": (self.offset + self.delivered) % self.num_streams,
                "workers": {str(w): copy.deepcopy(s) for w, s in sorted(self.states.items())}}

    def load_state_dict(self, sd: dict) -> None:
        want = {"version": STATE_VERSION, "shards": fingerprint(self.shards), "seed": self.cfg.seed,
                "rank": self.rank, "world": self.world, "num_workers": self.num_streams}
        diff = {k: (sd.get(k), v) for k, v in want.items() if sd.get(k) != v}
        if diff:
            raise ValueError("the data-loader state does not belong to this loader: "
                             + ", ".join(f"{k} saved {a!r} vs now {b!r}" for k, (a, b) in diff.items())
                             + "; resume with the same shards, data.seed, data-parallel size and data.num_workers")
        self.close()
        self.states = {int(w): copy.deepcopy(s) for w, s in sd["workers"].items()}
        self.offset, self.delivered = int(sd["offset"]), 0

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict:
        skipped = Counter()
        for s in self.states.values():
            skipped.update(s["skipped"])
        return {"skipped": dict(sorted(skipped.items())), "skipped_total": sum(skipped.values()),
                "samples_read": sum(s["read"] for s in self.states.values()),
                "samples_packed": sum(s["packed"] for s in self.states.values()),
                "batches": sum(s["batches"] for s in self.states.values()),
                "epoch": min((s["epoch"] for s in self.states.values()), default=0),
                "data_wait_s": self.wait_s}


def build_loader(cfg: DataConfig, model_cfg=None, *, rank: int = 0, world: int = 1) -> PackedLoader:
    """Checks the data config against the model's (patch geometry, special token ids,
    budgets) before any worker starts, then returns the loader."""
    im, pk = cfg.image, cfg.pack
    tok = cfg.tokenizer or os.path.join(cfg.shards if os.path.isdir(cfg.shards) else os.path.dirname(cfg.shards),
                                         "tokenizer.json")
    chat = ChatEncoder(load_tokenizer(tok))
    if model_cfg is not None:
        chat.check_model(model_cfg)
        v = model_cfg.vision
        mine = (im.patch_size, im.temporal_patch_size, im.merge_size)
        theirs = (v.patch_size, v.temporal_patch_size, v.spatial_merge_size)
        if mine != theirs:
            raise ValueError(f"data.image (patch, temporal, merge) = {mine} but the model's vision config has "
                             f"{theirs}; set data.image to the model's values")
    unit = im.patch_size**2
    if im.max_pixels // unit > pk.max_patches:
        raise ValueError(f"one image may need up to {im.max_pixels // unit} patches (data.image.max_pixels="
                         f"{im.max_pixels}) but a micro-batch holds data.pack.max_patches={pk.max_patches}; "
                         "raise max_patches or lower max_pixels")
    if pk.oversize not in ("skip", "truncate"):
        raise ValueError(f"data.pack.oversize={pk.oversize!r}; choose 'skip' or 'truncate'")
    patch_dim = 3 * im.temporal_patch_size * im.patch_size**2
    return PackedLoader(cfg, tokenizer_path=tok, patch_dim=patch_dim, rank=rank, world=world)
