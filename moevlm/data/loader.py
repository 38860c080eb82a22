"""The training data loader: shards -> logical streams (decode, tokenize, pack)
-> fixed-shape micro-batches of one packed row, with a resumable state and skip
statistics.

    loader = build_loader(cfg.data, model_cfg, rank=dp_rank, world=dp_size)
    for batch in loader:              # dict of fixed-shape tensors + counts (see packing.py)
        ...                           # (packing.stack_rows makes one micro-batch of several rows)
    ckpt["data"] = loader.state_dict()          # what each of this rank's streams has delivered
    loader.load_state_dict(merge_states(saved)) # continues exactly there, on any data-parallel layout
    loader.stats()                              # skipped by reason, samples, tokens, data wait

Design choices:
- Global streams.  The job reads L = data.streams logical streams.  Stream s
  reads the shards order[s::L] of the epoch's permutation (shared by everybody)
  through a shuffle buffer seeded by (seed, epoch, s): what it yields depends
  on nothing else.  Global row k is row k // L of stream k % L.  Rank r of
  `world` delivers the global rows k = r (mod world): it owns the streams
  r, r + world, r + 2 world, ... (local index i = 0..n-1, n = L / world) and
  delivers them cycling in that order.  So every global batch (rows jG to
  jG + G - 1, G a multiple of world) holds the same rows whatever the
  data-parallel size and num_workers.  data.streams = 0 (auto) means L = world x max(1, num_workers):
  simple, but then the data changes with the layout.  `rank`/`world` are the
  data-parallel rank and size, not the global ones (with TP/CP/PP several
  global ranks share one data-parallel rank and must see the same rows).
- Workers pack.  Physical worker p of W = max(1, num_workers) (W divides n)
  serves the local streams i = offset + p (mod W), one row from each in turn,
  starting at i = offset + p; `DataLoader(batch_size=None, in_order=True)`
  takes one row from each worker in turn, which is exactly the cycling order
  from local stream `offset` on.  The main process only pins and hands over
  tensors.  A worker holds a shuffle buffer and a packer per stream it serves.
- Worker processes start with `forkserver` (configurable): forking a process
  that has initialised CUDA (or PIL with CUDA) is unsafe; forkserver forks from
  a clean server that preloads this module, so starting is cheap too.
- Exact resume.  Every row carries its stream's state after producing it:
  epoch, next read position, the positions held in the shuffle buffer and in
  the packer, the shuffle draw count, skip counters, rows produced.  The loader
  keeps the state of each stream's last *delivered* row (prefetched rows do
  not count).  On resume a stream re-reads (never re-decodes more than) the
  samples it held and continues reading where it stopped.
- Resuming on another layout.  The state is per stream, keyed by global stream
  id; the trainer merges the ranks' states (`merge_states`) and each rank takes
  its own streams (missing ones start fresh).  The data-parallel size and
  num_workers may change; the shards, data.seed and L may not (checked, with a
  message).  The cycle position is derived, not saved: offset = (rows its
  streams delivered) mod n.  That is the right position whenever the rows the
  whole job delivered are whole rounds of both the old and the new world (a
  multiple of both data-parallel sizes, e.g. whole global batches), which the
  trainer guarantees by saving at optimizer-step boundaries.
- Workers re-import the launching script as a module (forkserver, like
  spawn): scripts need the `if __name__ == "__main__":` guard.
- Workers die with the training process.  A forkserver worker's parent is the
  fork server, which itself waits for its children, so torch's parent
  watchdog never fires after the trainer is SIGKILLed: each worker watches the
  trainer's pid and exits when it is gone (no orphaned decoders).
- Workers and the fork server ignore SIGINT and SIGTERM: Ctrl-C and a
  scheduler's SIGTERM reach the whole process group, and the trainer finishes
  its step and checkpoints (moevlm.train.faults) only if its workers are still
  there; they end with the trainer (above).  The fork server is started with
  the two signals blocked and ignored (both survive its exec); the trainer's
  own handlers are put back and a signal that came meanwhile is delivered.
- Streams are infinite by default (`epochs: null`): each stream starts its next
  epoch (a new shard permutation) when its shards run out.  Exact resume and
  layout independence hold for infinite streams; with a finite `epochs` the
  tail after the first stream runs out is neither (exhausted streams are
  skipped).
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import signal
import threading
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

STATE_VERSION = 2


def fresh_state(stream: int) -> dict:
    return {"stream": stream, "epoch": 0, "next": [0, 0], "shuffle": [], "draws": 0, "packer": [],
            "skipped": {}, "read": 0, "packed": 0, "batches": 0}


def resolve_streams(cfg: DataConfig, rank: int, world: int, num_shards: int) -> int:
    """The job's number of logical streams L, checked against the layout and the shards."""
    if not 0 <= rank < world:
        raise ValueError(f"data-parallel rank {rank} is outside 0..{world - 1}")
    L = check_streams(cfg, world)
    if num_shards < L:
        w = max(1, cfg.num_workers)
        what = f"data.streams={L} streams" if cfg.streams else \
            f"{world} data-parallel ranks x {w} workers = {L} streams (data.streams=0: auto)"
        raise ValueError(f"{num_shards} shards cannot feed {what} (each stream needs at least one shard); "
                         "rebuild with a smaller --samples-per-shard or use fewer data.streams / data.num_workers")
    return L


def check_streams(cfg: DataConfig, world: int) -> int:
    """L checked against the data-parallel size and the workers (no shards needed)."""
    w = max(1, cfg.num_workers)
    if cfg.streams < 0:
        raise ValueError(f"data.streams={cfg.streams}; use 0 (auto) or a positive multiple of the data-parallel size")
    L = cfg.streams or world * w
    if L % world:
        raise ValueError(f"data.streams={L} is not a multiple of the data-parallel size {world}; set data.streams "
                         f"to a multiple of {world} (e.g. {world * w} for num_workers={w})")
    if (L // world) % w:
        raise ValueError(f"data.streams={L} gives {L // world} streams per data-parallel rank ({world} ranks), "
                         f"which data.num_workers={w} workers cannot share evenly; set data.num_workers to a "
                         f"divisor of {L // world} or data.streams to a multiple of {world * w}")
    return L


class Stream:
    """One logical stream: read -> shuffle -> encode -> pack, yielding rows with state."""

    def __init__(self, ds: PackedDataset, stream: int, encode: SampleEncoder):
        cfg = ds.cfg
        self.cfg, self.ds, self.stream, self.encode = cfg, ds, stream, encode
        self.plan = ShardPlan(ds.shards, cfg.seed, stream, ds.streams, cfg.shuffle_shards, ds.counts)
        self.pad_id = encode.chat.eot_id
        self.packer = Packer(cfg.pack)
        self.st = copy.deepcopy(ds.states.get(stream)) or fresh_state(stream)
        self.skips = SkipCounter(self.st["skipped"])
        self.shuffle = self._new_buffer(self.st["epoch"], self.st["draws"])
        self._restore()

    def _new_buffer(self, epoch: int, draws: int = 0) -> ShuffleBuffer:
        return ShuffleBuffer(self.cfg.shuffle_buffer, (self.cfg.seed, epoch, self.stream), draws)

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
                raise RuntimeError(f"data stream {self.stream} read no sample in epoch {self.st['epoch']} from "
                                   f"{self.plan.mine(self.st['epoch'])}: its shards are empty or unreadable "
                                   "(see the skip counts)")
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


def round_robin(iterators):
    """One item from each iterator in turn; an exhausted one drops out."""
    live = list(iterators)
    while live:
        for it in list(live):
            try:
                yield next(it)
            except StopIteration:
                live.remove(it)


class PackedDataset(IterableDataset):
    """What each worker process receives (pickled): config, shards, this rank's
    streams (`local`), their states and the local index of the next one due."""

    def __init__(self, cfg: DataConfig, shards, counts, tokenizer_path, patch_dim, streams, local, states, offset):
        self.cfg, self.shards, self.counts, self.tokenizer_path = cfg, shards, counts, tokenizer_path
        self.patch_dim, self.streams, self.local, self.states, self.offset = patch_dim, streams, local, states, offset
        self.main_pid = os.getpid()  # built in the training process, pickled to the workers

    def mine(self, p: int, workers: int) -> list[int]:
        """The streams physical worker p serves, in the order it takes rows from them."""
        n = len(self.local)
        return [self.local[(self.offset + p + j * workers) % n] for j in range(n // workers)]

    def __iter__(self):
        info = get_worker_info()
        p, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            for s in _STOP_SIGNALS:
                signal.signal(s, signal.SIG_IGN)
            threading.Thread(target=_exit_without, args=(self.main_pid,), daemon=True).start()
        cfg = self.cfg
        encode = SampleEncoder(ChatEncoder(load_tokenizer(self.tokenizer_path)), cfg.image, cfg.pack,
                               cfg.caption_prompt)
        return round_robin([iter(Stream(self, s, encode)) for s in self.mine(p, workers)])


def _exit_without(pid: int, every_s: float = 1.0) -> None:
    """Worker thread: end this process once the training process `pid` is gone."""
    while True:
        time.sleep(every_s)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:  # a reused pid of another user: ours is gone
            os._exit(0)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _start_forkserver_deaf_to_stop_signals() -> None:
    """Start multiprocessing's fork server (once per process) ignoring SIGINT/SIGTERM, so do the workers it
    forks.  Blocked meanwhile here: a signal sent during the switch waits for the handler put back."""
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only change in the main thread: torch's default start
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    old = {s: signal.signal(s, signal.SIG_IGN) for s in _STOP_SIGNALS}
    try:
        forkserver.ensure_running()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def merge_states(states: list[dict]) -> dict:
    """The union of several ranks' `state_dict()`s of one job: what a loader of
    any data-parallel size loads (each rank takes its own streams)."""
    if not states:
        raise ValueError("merge_states needs at least one data-loader state")
    head = {k: v for k, v in states[0].items() if k != "states"}
    out: dict = {}
    for sd in states:
        other = {k: v for k, v in sd.items() if k != "states"}
        if other != head:
            raise ValueError(f"cannot merge data-loader states of different jobs: {other} vs {head}")
        for s, st in sd["states"].items():
            if out.setdefault(s, st) != st:
                raise ValueError(f"two data-loader states hold different states for stream {s}: merge the "
                                 "states saved at one step, one per rank")
    return copy.deepcopy({**head, "states": dict(sorted(out.items(), key=lambda kv: int(kv[0])))})


class PackedLoader:
    def __init__(self, cfg: DataConfig, *, tokenizer_path: str, patch_dim: int, rank: int = 0, world: int = 1):
        self.cfg, self.tokenizer_path, self.patch_dim, self.rank, self.world = cfg, tokenizer_path, patch_dim, rank, world
        self.shards = expand_shards(cfg.shards)
        self.counts = shard_counts(self.shards)
        self.streams = resolve_streams(cfg, rank, world, len(self.shards))
        self.local = list(range(rank, self.streams, world))  # this rank's streams, in delivery order
        self.states: dict[int, dict] = {}
        self.offset = 0  # local index of the stream whose row comes next
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
        self.states[state["stream"]] = state
        self.offset = (self.offset + 1) % len(self.local)
        return batch

    def _dataloader(self) -> DataLoader:
        cfg = self.cfg
        ds = PackedDataset(cfg, self.shards, self.counts, self.tokenizer_path, self.patch_dim, self.streams,
                           self.local, dict(self.states), self.offset)
        pin = torch.cuda.is_available() if cfg.pin_memory == "auto" else str(cfg.pin_memory).lower() == "true"
        if cfg.num_workers == 0:
            return DataLoader(ds, batch_size=None, num_workers=0, pin_memory=pin)
        ctx = mp.get_context(cfg.start_method)
        if cfg.start_method == "forkserver":
            ctx.set_forkserver_preload(["moevlm.data.loader"])
            _start_forkserver_deaf_to_stop_signals()
        return DataLoader(ds, batch_size=None, num_workers=cfg.num_workers, pin_memory=pin,
                          persistent_workers=True, prefetch_factor=cfg.prefetch_factor,
                          multiprocessing_context=ctx, in_order=True)

    def close(self) -> None:
        """Stops the worker processes (a later iteration starts new ones from the current state)."""
        self._it = None

    # ---------------------------------------------------------------- state
    def _header(self) -> dict:
        return {"version": STATE_VERSION, "shards": fingerprint(self.shards), "seed": self.cfg.seed,
                "streams": self.streams}

    def state_dict(self) -> dict:
        """This rank's streams' states, keyed by global stream id (merge the ranks' with `merge_states`)."""
        return {**self._header(), "states": {str(s): copy.deepcopy(st) for s, st in sorted(self.states.items())}}

    def load_state_dict(self, sd: dict) -> None:
        """Takes this rank's streams from `sd` (one rank's state or several merged)."""
        diff = {k: (sd.get(k), v) for k, v in self._header().items() if sd.get(k) != v}
        if diff:
            raise ValueError("the data-loader state does not belong to this loader: "
                             + ", ".join(f"{k} saved {a!r} vs now {b!r}" for k, (a, b) in diff.items())
                             + "; resume with the same shards, data.seed and number of streams (data.streams; "
                             "with data.streams=0 it is dp size x num_workers, so set data.streams to the saved "
                             "value to change the layout)")
        self.close()
        self.states = {int(s): copy.deepcopy(st) for s, st in sd["states"].items() if int(s) in self.local}
        self.offset = sum(st["batches"] for st in self.states.values()) % len(self.local)

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
    check_config(cfg, model_cfg, world)
    tok = cfg.tokenizer or os.path.join(cfg.shards if os.path.isdir(cfg.shards) else os.path.dirname(cfg.shards),
                                         "tokenizer.json")
    if model_cfg is not None:
        ChatEncoder(load_tokenizer(tok)).check_model(model_cfg)
    im = cfg.image
    patch_dim = 3 * im.temporal_patch_size * im.patch_size**2
    return PackedLoader(cfg, tokenizer_path=tok, patch_dim=patch_dim, rank=rank, world=world)


def check_config(cfg: DataConfig, model_cfg=None, world: int = 1) -> None:
    """Every check that needs no file: image geometry against the model, budgets, the streams' layout."""
    im, pk = cfg.image, cfg.pack
    if model_cfg is not None:
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
    if pk.max_patches % im.merge_size**2:
        raise ValueError(f"data.pack.max_patches={pk.max_patches} must be a multiple of merge_size^2="
                         f"{im.merge_size**2} (the padding patches are merged like an image's)")
    if pk.oversize not in ("skip", "truncate"):
        raise ValueError(f"data.pack.oversize={pk.oversize!r}; choose 'skip' or 'truncate'")
    check_streams(cfg, world)
