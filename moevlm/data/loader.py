"""The training data loader: shards -> logical streams (decode, tokenize, pack)
-> fixed-shape micro-batches of one packed row, with a resumable state and skip
statistics.

    loader = build_loader(cfg.data, model_cfg, rank=dp_rank, world=dp_size)
    for batch in loader:              # dict of fixed-shape tensors + counts (see packing.py)
        ...                           # (batch.MicroBatch.read makes one micro-batch of several rows)
    with build_loader(DataConfig(shards="sample"), model_cfg) as loader:   # workers stopped at the end
        batch = next(loader)
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
  data-parallel size and num_workers.  data.streams = 0 (auto) means L = DEFAULT_STREAMS = 16, the
  same for every layout: dp in {1, 2, 4, 8, 16} x any num_workers read the same rows (before, auto was
  dp x workers, so an FSDP run and a 3-D run of one recipe trained on different rows).  16, not 32 or
  64: a small dataset needs one shard per stream, and 16 still gives each of 8 ranks 2 workers.
  `rank`/`world` are the
  data-parallel rank and size, not the global ones (with TP/CP/PP several
  global ranks share one data-parallel rank and must see the same rows).
- Fitted, not refused (`resolve_streams`, a logged warning each): with fewer
  shards than L streams the job reads the largest divisor of L that the shards
  can feed (16 -> 8 -> 4 ...: it depends on the shards only, so every layout
  still gets the same L, and the state header records it for resume); with
  auto streams and a dp that does not divide 16 (3, 6, 12, > 16) it reads the
  largest multiple of dp up to max(16, dp) shards (layout-dependent, said in
  the warning); num_workers is lowered to a divisor of the streams per rank
  (the rows do not change).  Refused in one line only where no layout works:
  a rank without a stream (dp above the shards), or an explicit data.streams
  that is not a multiple of dp (or whose fitted value is not).
- Workers pack.  Physical worker p of W = max(1, num_workers) (W divides n)
  serves the local streams i = offset + p (mod W), one row from each in turn,
  starting at i = offset + p; `DataLoader(batch_size=None, in_order=True)`
  takes one row from each worker in turn, which is exactly the cycling order
  from local stream `offset` on.  The main process only pins and hands over
  tensors.  A worker holds a shuffle buffer and a packer per stream it serves.
- Worker processes start with `forkserver` (configurable): forking a process
  that has initialized CUDA (or PIL with CUDA) is unsafe; forkserver forks from
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
- Workers die with the training process, however it ends (moevlm.data.lifetime):
  a clean exit or an exception closes every open loader (below; `with` and
  `close()` do it earlier), and a killed one (SIGKILL, a signal's default
  action) takes its fork server with it, whose workers the kernel then kills
  (parent-death signal); a pid probe in each worker is the fallback.  torch's
  own parent watchdog never fires here: a forkserver worker's parent is the
  fork server.  No orphaned decoders, and a script using the loader ends
  without calling `close()`.
- A library, not only the trainer's: `with build_loader(...) as loader:` stops
  the workers when the block ends (also on an exception), and
  `shards="sample"` resolves to the cached sample set as the trainer does
  (moevlm.data.sample_cache, built once per content version).
- Checked before anything is read (`check_config`): every field on its own
  (a packing budget that holds no sample, such as max_samples=0 which packed
  empty rows forever, non-positive sizes, min_pixels > max_pixels, a zero
  std, ...), then against the model and the layout; one line naming the field,
  its value and what to set.  max_patches=0 is a text-only budget.
- Bad data is never fatal while usable data remains.  A shard that gives no
  usable sample (every sample skipped, or none readable) is counted by name
  in the stream's state (`shards_all_skipped`, summed in `stats()`; its
  samples keep their skip reasons) and logged, and the stream goes on with its
  next shard; a stream whose whole epoch gave nothing goes on to its next
  epoch, whose shard permutation gives it other shards.  The loader stops
  (`DataError`, a RuntimeError) only where going on cannot help: when the
  whole data set has no usable sample.  A stream that never packed or held a
  sample checks that when it ends an epoch, or after NO_PROGRESS_SAMPLES
  (10,000) samples skipped in a row (only samples that reached the encoder
  count): it reads every shard of the epoch (other streams' first) until one
  sample encodes.  One does: the stream goes on (and never checks again;
  the check only reads, so the rows do not change).  None does: the message
  gives this stream's and the whole data set's counts (shards, samples read,
  shards without a usable sample, skips by reason with the first example of
  each) and the settings to change.  In that case every such stream reads the
  data set once more before the error.  The one other stop: with
  data.shuffle_shards=false a stream reads the same shards every epoch, so one
  whose shards all gave nothing would read them forever; it stops naming them.
  From a worker process the error is re-raised in the training process as the
  same one line (without torch's wrapper text) and the workers are stopped at
  once.
- Images are never dropped silently.  A sample that trains without image
  members it carries (its record names none of them, e.g. data.format=moevlm
  on third-party shards) is counted as `images_unused` (`stats()["fell_back"]`,
  not a skip); a stream whose samples carry images but which could use none
  of them (every one skipped, or trained without them) after
  IMAGELESS_SAMPLES (1,000) such samples or at the end of an epoch reads the
  data set for one usable image, as above, and stops with a DataError naming
  data.format when there is none (not under a text-only budget,
  max_patches=0 or max_images=0, nor data.mock=image_free, which drop images
  by choice).
- A finished stream (finite `epochs`) hands its last state to the loader
  after its last row, so skips read after that row still count in `stats()`.
- Shards are identified in the state by name, size and a hash of both ends
  (reader.shard_identity; 23 sample-set shards: ~20 ms, two 64 KiB reads per
  shard whatever its size, on 16 threads).  A resume on shards whose identity
  changed is refused naming them (at most 3), unless
  data.allow_changed_shards=true, which logs a warning (logger
  moevlm.data.loader) and continues.  STATE_VERSION 3; a version-2 state
  (without identities) still loads, with a warning that the contents cannot
  be checked.  Every rank computes the same identities, so `merge_states`
  still finds identical headers.
- Workers and the fork server ignore the stop signals (SIGINT, SIGTERM,
  SIGHUP, SIGUSR1, SIGQUIT): Ctrl-C and a scheduler's SIGTERM reach the whole
  process group, and the trainer finishes its step and checkpoints
  (moevlm.train.faults) only if its workers are still there; they end with
  the trainer (above).  The fork server ignores them from its first import
  (`moevlm.data.deaf`, first in its preload list), so the training process
  never changes its own handlers and a signal sent while the server starts
  reaches the trainer.
- A dead worker never hangs the trainer.  Because workers ignore SIGTERM,
  torch's shutdown (which terminates with SIGTERM) and Python's exit (which
  terminates daemonic children, then joins them) would wait on them forever
  once one worker died: `close` lets torch stop them in order, then SIGKILLs
  any that are left (the loader's state lives in the training process, so
  nothing is lost), and every loader still open is closed at interpreter
  exit, by an exit hook registered after multiprocessing's own (torch imports
  it first), so it runs before that one terminates and joins the workers.  torch's error for a dead worker becomes one line (`worker_death`:
  which pid, how it ended, the likely cause and memory available), raised as
  a DataError (exit 8); a relaunch resumes exactly from the last checkpoint.
- data.mock (none, image_free, random_pixels; moevlm.data.encode) is part of
  the data identity: the state header records it (only when not none, so
  older states still load) and a resume with another value is refused.  One
  warning line at build time says mock data is in use.
- Streams are infinite by default (`epochs: null`): each stream starts its next
  epoch (a new shard permutation) when its shards run out.  Exact resume and
  layout independence hold for infinite streams; with a finite `epochs` the
  tail after the first stream runs out is neither (exhausted streams are
  skipped).
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import re
import signal
import time
import weakref
from collections import Counter

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from moevlm.data.config import FORMATS, MOCK, OVERSIZE, PIN_MEMORY, DataConfig, shown_path
from moevlm.data.encode import SampleEncoder
from moevlm.data.errors import FALLBACKS, DataError, DataSetupError, SkipCounter, SkipSample
from moevlm.data.layouts import image_members
from moevlm.data.lifetime import watch_parent
from moevlm.data.packing import Packer, VisionFlops, collate, vision_budget, vision_budget_set
from moevlm.data.reader import (
    ShardPlan,
    ShuffleBuffer,
    expand_shards,
    fingerprint,
    shard_counts,
    shard_identities,
)
from moevlm.data.sample_cache import describe as describe_sample, ensure_sample
from moevlm.data.text import ChatEncoder, load_tokenizer
from moevlm.signals import STOP_SIGNALS

log = logging.getLogger(__name__)

STATE_VERSION = (
    3  # 3: the header records each shard's identity ("files"); 2 (without it) still loads
)
NO_PROGRESS_SAMPLES = 10_000  # skipped in a row by a stream that never packed: check the data set
IMAGELESS_SAMPLES = 1_000  # samples with images read by a stream that used none: check the data set


def fresh_state(stream: int) -> dict:
    return {
        "stream": stream,
        "epoch": 0,
        "next": [0, 0],
        "shuffle": [],
        "draws": 0,
        "packer": [],
        "skipped": {},
        "read": 0,
        "packed": 0,
        "batches": 0,
        "tally": [],  # [shard index, read, still in the shuffle buffer, encoded, read to its end]
        "epoch_unusable": 0,  # shards of this epoch that gave no usable sample
        "shards_all_skipped": {},  # shard name -> passes that gave no usable sample
        "data_checked": False,  # the whole data set was seen to hold a usable sample
        "image_samples": 0,  # samples read that carry image members
        "images_used": 0,  # images of the samples that encoded
        "images_packed": 0,  # images in the rows produced
        "images_checked": False,  # the whole data set was seen to hold a usable image
        "over_vision_budget": 0,  # rows of one sample over data.pack.max_vision_flops (it went alone)
    }


DEFAULT_STREAMS = (
    16  # data.streams=0 (auto): the same rows for dp in {1, 2, 4, 8, 16}, any num_workers
)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def resolve_streams(cfg: DataConfig, rank: int, world: int, num_shards: int) -> tuple[int, int]:
    """(L, workers): the job's logical streams and this rank's worker processes, fitted to the shards
    and the layout (a warning for each reduction; an error only where no stream layout can work)."""
    if not 0 <= rank < world:
        raise ValueError(f"data-parallel rank {rank} is outside 0..{world - 1}")
    asked = check_streams(cfg, world)
    # depends on the shards only, never on the layout
    L = _largest_divisor_at_most(asked, num_shards)
    if L < asked:
        log.warning(
            "%d shards cannot feed %d data streams (each needs a shard): reading them as %d streams "
            "(data.streams=%d%s); for more, rebuild with a smaller --samples-per-shard",
            num_shards,
            asked,
            L,
            cfg.streams,
            " (auto)" if not cfg.streams else "",
        )
    if L % world and not cfg.streams and world <= num_shards:
        L = world * (min(max(DEFAULT_STREAMS, world), num_shards) // world)
        log.warning(
            "data.streams=0 (auto): the %d data-parallel ranks cannot share %d streams evenly; reading "
            "%d streams, so the rows of a step differ from a run on 1, 2, 4, 8 or 16 ranks; set "
            "data.streams to a common multiple of the data-parallel sizes you use to make them equal",
            world,
            min(DEFAULT_STREAMS, num_shards),
            L,
        )
    if L % world:
        raise ValueError(
            f"{num_shards} shards cannot feed {world} data-parallel ranks with data.streams={asked}"
            f"{' (auto)' if not cfg.streams else ''}: they give {L} streams, not a multiple of {world}; "
            f"rebuild the shards with a smaller --samples-per-shard (at least {asked} shards), or "
            f"set data.streams to a multiple of {world} that is at most {num_shards}"
        )
    return L, _workers(cfg, L // world)


def _workers(cfg: DataConfig, per_rank: int) -> int:
    """data.num_workers, lowered (with a warning) to a divisor of the streams each rank serves."""
    if cfg.num_workers <= 1:
        return cfg.num_workers
    w = _largest_divisor_at_most(per_rank, cfg.num_workers)
    if w < cfg.num_workers:
        log.warning(
            "data.num_workers=%d lowered to %d: each data-parallel rank serves %d streams, which %d "
            "workers cannot share evenly (the rows are the same; raise data.streams for more workers)",
            cfg.num_workers,
            w,
            per_rank,
            cfg.num_workers,
        )
    return w


def check_streams(cfg: DataConfig, world: int) -> int:
    """The asked-for L (data.streams, or DEFAULT_STREAMS for 0), checked alone (no shards needed)."""
    if cfg.streams < 0:
        raise ValueError(
            f"data.streams={cfg.streams}; use 0 (auto: {DEFAULT_STREAMS}) or a positive multiple "
            "of the data-parallel size"
        )
    if cfg.streams and cfg.streams % world:
        raise ValueError(
            f"data.streams={cfg.streams} is not a multiple of the data-parallel size {world}; set "
            f"data.streams to a multiple of {world} (or 0: auto)"
        )
    return cfg.streams or DEFAULT_STREAMS


class Stream:
    """One logical stream: read -> shuffle -> encode -> pack, yielding rows with state."""

    def __init__(self, ds: PackedDataset, stream: int, encode: SampleEncoder):
        cfg = ds.cfg
        self.cfg, self.ds, self.stream, self.encode = cfg, ds, stream, encode
        self.plan = ShardPlan(
            ds.shards,
            cfg.seed,
            stream,
            ds.streams,
            cfg.shuffle_shards,
            ds.counts,
            cfg.max_text_bytes,
            cfg.max_image_bytes,
        )
        self.pad_id = encode.chat.eot_id
        self.packer = Packer(cfg.pack, ds.vision)
        self.st = {**fresh_state(stream), **copy.deepcopy(ds.states.get(stream) or {})}
        self.skips = SkipCounter(self.st["skipped"])
        self.over_base = self.st.get("over_vision_budget", 0)
        self.tally = {t[0]: list(t[1:]) for t in self.st["tally"]}  # shard index -> counts
        self.failed = 0  # samples skipped in a row (since the last one that encoded)
        self.shuffle = self._new_buffer(self.st["epoch"], self.st["draws"])
        self._restore()

    def _new_buffer(self, epoch: int, draws: int = 0) -> ShuffleBuffer:
        return ShuffleBuffer(self.cfg.shuffle_buffer, (self.cfg.seed, epoch, self.stream), draws)

    def _restore(self) -> None:
        held = [tuple(p) for p in self.st["shuffle"]] + [tuple(p) for p in self.st["packer"]]
        raw = self.plan.fetch(held) if held else {}
        self.shuffle.items = [(tuple(p), raw[tuple(p)]) for p in self.st["shuffle"]]
        for p in self.st["packer"]:
            # encoded fine before the checkpoint
            self.packer.push(self.encode(raw[tuple(p)], tuple(p)))

    def __iter__(self):
        epochs = self.cfg.epochs
        while epochs is None or self.st["epoch"] < epochs:
            epoch = self.st["epoch"]
            for pos, raw in self.plan.read(
                epoch, tuple(self.st["next"]), self.skips, self._read_all
            ):
                self.st["next"], self.st["read"] = [pos[1], pos[2] + 1], self.st["read"] + 1
                t = self.tally.setdefault(pos[1], [0, 0, 0, 0])
                t[0], t[1] = t[0] + 1, t[1] + 1
                out = self.shuffle.push(pos, raw)
                if out is not None:
                    yield from self._feed(*out)
            while (out := self.shuffle.pop()) is not None:
                yield from self._feed(*out)
            self._end_epoch(epoch, last=epochs is not None and epoch + 1 >= epochs)
            self.st["epoch"] += 1
            self.st["next"], self.st["draws"], self.st["epoch_unusable"] = [0, 0], 0, 0
            self.shuffle = self._new_buffer(self.st["epoch"])
        while self.packer.held:
            yield self._batch(self.packer.pop())
        # the state after the last read, for the loader's stats: skips after the last row count too
        yield {"state": self._state(), "end": True}

    def _feed(self, pos, raw):
        where = f"{raw.get('__url__', '?')}:{raw.get('__key__', '?')}"
        self.st["image_samples"] += self.encode.mock != "image_free" and bool(image_members(raw))
        try:
            sample = self.encode(raw, pos)
        except SkipSample as err:
            self.skips.add(err, where)
            self._settle_sample(pos[1], usable=False)
            self.failed += 1
            if (
                self.failed >= NO_PROGRESS_SAMPLES
                and self._never_packed()
                and not self.st["data_checked"]
            ):
                self._check_data_set(f"in its first {self.failed} samples")
            self._check_images(at_end=False)
            return
        self.failed = 0
        if sample.unused:
            if not self.skips["images_unused"]:
                log.warning(
                    "data stream %d: sample %s trains without its image member(s) %s, which its record "
                    "does not name (data.format=%s); such samples are counted as images_unused",
                    self.stream,
                    where,
                    sample.unused[:3],
                    self.encode.fmt,
                )
            self.skips.add(
                SkipSample("images_unused", f"{sample.unused[:3]} not named by the record"), where
            )
        self.st["images_used"] += len(sample.grids)
        self._check_images(at_end=False)
        self._settle_sample(pos[1], usable=True)
        self.packer.push(sample)
        while self.packer.full():
            yield self._batch(self.packer.pop())

    # ------------------------------------------------ shards without a usable sample
    def _read_all(self, s: int, url: str) -> None:
        """The reader finished shard s of this epoch (also one it could not open): reading goes on at
        the next shard, so a resume never opens this one again."""
        self.st["next"] = [s + 1, 0]
        self.tally.setdefault(s, [0, 0, 0, 0])[3] = 1
        self._settle(s)

    def _settle_sample(self, s: int, usable: bool) -> None:
        # (a state saved before tallies: counts from here)
        t = self.tally.setdefault(s, [0, 0, 0, 0])
        t[1] -= 1
        t[2] += usable
        self._settle(s)

    def _settle(self, s: int) -> None:
        """Once shard s is read to its end and none of its samples waits in the shuffle buffer: a
        shard that gave no usable sample is counted by name and the stream goes on with the next."""
        read, waiting, usable, done = self.tally[s]
        if not done or waiting > 0:
            return
        del self.tally[s]
        if usable:
            return
        name = os.path.basename(self.plan.mine(self.st["epoch"])[s])
        self.st["shards_all_skipped"][name] = self.st["shards_all_skipped"].get(name, 0) + 1
        self.st["epoch_unusable"] += 1
        log.warning(
            "data stream %d: shard %s gave no usable sample (%s); going on with the next shard "
            "(skipped so far: %s)",
            self.stream,
            name,
            f"all {read} samples skipped" if read else "no sample could be read",
            ", ".join(f"{r}={n}" for r, n in self.skips.most_common()),
        )

    def _end_epoch(self, epoch: int, last: bool) -> None:
        """A stream that could use nothing goes on to its next epoch (other shards) while the data set
        holds a usable sample; it stops only where going on cannot help."""
        if self._never_packed() and not self.st["data_checked"]:
            self._check_data_set(f"in all of epoch {epoch}")
        self._check_images(at_end=True)
        mine = self.plan.mine(epoch)
        if self.st["epoch_unusable"] == len(mine) and not self.plan.shuffle and not last:
            names = ", ".join(os.path.basename(u) for u in mine[:3])
            more = f" and {len(mine) - 3} more" if len(mine) > 3 else ""
            raise DataError(
                f"data stream {self.stream} could use no sample of its shards ({names}{more}; "
                f"skipped: {self._skip_summary()}) and with data.shuffle_shards=false it reads the same "
                "shards in every epoch, while other shards hold usable samples; set "
                "data.shuffle_shards=true, or fix or remove those shards"
            )

    def _check_images(self, at_end: bool) -> None:
        """Samples carrying images of which none could be used (skipped, or trained without them):
        after IMAGELESS_SAMPLES of them, or at the end of an epoch, the stream reads the data set
        for one usable image; none there is a DataError (a run on images must not train text only)."""
        st, pk = self.st, self.cfg.pack
        if st["images_used"] or st["images_checked"] or not st["image_samples"]:
            return
        # a text-only budget: images are too_long by choice
        if not (pk.max_patches and pk.max_images):
            return
        if at_end or st["image_samples"] >= IMAGELESS_SAMPLES:
            self._check_data_set(f"in its first {st['image_samples']} samples with images", True)

    def _check_data_set(self, when: str, need_image: bool = False) -> None:
        """Reads the whole data set (every shard of the epoch, other streams' first) until one sample
        encodes (`need_image`: with an image): the stream goes on if one does (not checked again), else
        DataError with the counts.  Reads only: what the stream yields does not change."""
        epoch = self.st["epoch"]
        mine = set(self.plan.mine(epoch))
        order = [u for u in self.plan.shards if u not in mine] + self.plan.mine(epoch)
        probe, read, unusable = SkipCounter(), 0, 0
        for url in order:
            usable = False
            for k, raw in enumerate(self.plan.read_shard(url, probe)):
                read += 1
                try:
                    sample = self.encode(raw, (epoch, -1, k))
                except SkipSample as err:
                    probe.add(err, f"{raw.get('__url__', '?')}:{raw.get('__key__', '?')}")
                    continue
                if sample.unused:
                    detail = f"{sample.unused[:3]} not named by the record"
                    probe.add(SkipSample("images_unused", detail), raw.get("__url__", "?"))
                if need_image and not sample.grids:
                    continue
                usable = True
                break
            if usable and need_image:
                self.st["images_checked"] = True
                log.warning(
                    "data stream %d could use no image %s (%s); other shards hold usable images, so it "
                    "goes on reading",
                    self.stream,
                    when,
                    self._skip_summary(),
                )
                return
            if usable:
                self.st["data_checked"] = True
                log.warning(
                    "data stream %d could pack no sample %s (skipped: %s); other shards hold usable "
                    "samples, so it goes on reading",
                    self.stream,
                    when,
                    self._skip_summary(),
                )
                return
            unusable += 1
        if need_image:
            raise self._imageless(probe, read)
        raise self._stuck(when, probe, read, unusable)

    def _imageless(self, data: SkipCounter, read: int) -> DataError:
        both = Counter(self.skips) + Counter(data)
        fix = (
            "the json records name no image member (images_unused): read third-party image-text shards "
            f"with data.format=auto or image_caption (now data.format={self.encode.fmt})"
            if both["images_unused"]
            else "fix the images (skip reasons: moevlm.data.errors.REASONS)"
        )
        return DataError(
            f"data stream {self.stream} read {self.st['image_samples']} samples carrying images and could "
            f"use none of their images ({self._skip_summary()}); no sample of the whole data set "
            f"gives a usable image either ({len(self.plan.shards)} shards, {read} samples read: "
            f"{self._summary(data)}); {fix}, or set data.mock=image_free to train on the text alone"
        )

    def _never_packed(self) -> bool:
        """No sample of this stream ever encoded: none packed into a row and none held for one."""
        return self.st["packed"] == 0 and not self.packer.held

    @staticmethod
    def _summary(skips: SkipCounter) -> str:
        counts = ", ".join(f"{r}={n}" for r, n in skips.most_common()) or "nothing"
        firsts = "; ".join(ex[0] for ex in skips.examples.values() if ex)
        return counts + (f"; first: {firsts}" if firsts else "")

    def _skip_summary(self) -> str:
        return self._summary(self.skips)

    def _stuck(self, when: str, data: SkipCounter, read: int, unusable: int) -> DataError:
        """The error for data of which no sample is usable (a stream would loop forever): this stream's
        skips, then the whole data set's (`data`: one pass over every shard)."""
        pk, fixes = self.cfg.pack, []
        both = Counter(self.skips) + Counter(data)
        if both["too_long"]:
            fixes.append(
                f"raise data.pack.seq_len={pk.seq_len} / max_patches={pk.max_patches} / "
                f"max_images={pk.max_images}"
                + (" or set data.pack.oversize=truncate" if pk.oversize != "truncate" else "")
            )
        if both["text_too_large"]:
            fixes.append(f"raise data.max_text_bytes={self.cfg.max_text_bytes}")
        if both["file_too_large"]:
            fixes.append(f"raise data.max_image_bytes={self.cfg.max_image_bytes}")
        if both["image_too_large"] or both["decode_too_large"]:
            im = self.cfg.image
            fixes.append(
                f"raise data.image.max_image_pixels={im.max_image_pixels} / "
                f"max_decode_bytes={im.max_decode_bytes}"
            )
        fixes.append("fix the shards (skip reasons: moevlm.data.errors.REASONS)")
        n = len(self.plan.shards)
        return DataError(
            f"data stream {self.stream} read {self.st['read']} samples but could pack none {when}: "
            f"every one was skipped ({self._skip_summary()}); no sample of the whole data set is "
            f"usable either: {n} shards, {read} samples read, {unusable} of the {n} shards without a "
            f"usable sample, skipped: {self._summary(data)}; {', or '.join(fixes)}"
        )

    def _state(self) -> dict:
        st = self.st
        st["draws"] = self.shuffle.draws
        st["shuffle"] = [list(p) for p in self.shuffle.positions()]
        st["packer"] = [list(s.pos) for s in self.packer.held]
        st["over_vision_budget"] = self.over_base + self.packer.over_budget
        st["skipped"] = dict(self.skips)
        st["tally"] = [[s, *t] for s, t in sorted(self.tally.items())]
        return copy.deepcopy(st)

    def _batch(self, samples) -> dict:
        # check_config's budgets make this unreachable; an empty row must never train
        if not samples:
            raise RuntimeError(
                f"data stream {self.stream}: the packer produced an empty row "
                f"(data.pack={self.cfg.pack})"
            )
        self.st["packed"] += len(samples)
        self.st["images_packed"] += sum(len(s.grids) for s in samples)
        self.st["batches"] += 1
        batch = collate(samples, self.cfg.pack, self.ds.patch_dim, self.pad_id)
        batch["state"] = self._state()
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

    def __init__(
        self,
        cfg: DataConfig,
        shards,
        counts,
        tokenizer_path,
        patch_dim,
        streams,
        local,
        states,
        offset,
        vision: VisionFlops | None = None,
    ):
        self.vision = vision  # the model's vision FLOPs (data.pack.max_vision_flops)
        self.cfg, self.shards, self.counts, self.tokenizer_path = (
            cfg,
            shards,
            counts,
            tokenizer_path,
        )
        self.patch_dim, self.streams, self.local, self.states, self.offset = (
            patch_dim,
            streams,
            local,
            states,
            offset,
        )
        self.main_pid = os.getpid()  # built in the training process, pickled to the workers

    def mine(self, p: int, workers: int) -> list[int]:
        """The streams physical worker p serves, in the order it takes rows from them."""
        n = len(self.local)
        return [self.local[(self.offset + p + j * workers) % n] for j in range(n // workers)]

    def __iter__(self):
        info = get_worker_info()
        p, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            for s in STOP_SIGNALS:
                signal.signal(s, signal.SIG_IGN)
            watch_parent(self.main_pid, through_fork_server=self.cfg.start_method == "forkserver")
        cfg = self.cfg
        encode = SampleEncoder(
            ChatEncoder(load_tokenizer(self.tokenizer_path)),
            cfg.image,
            cfg.pack,
            cfg.caption_prompt,
            cfg.mock,
            cfg.format,
        )
        return round_robin([iter(Stream(self, s, encode)) for s in self.mine(p, workers)])


_OPEN: weakref.WeakSet = weakref.WeakSet()  # loaders with workers, closed at interpreter exit
_DIED = re.compile(r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) (.*)")


def worker_death(err: BaseException, workers=()) -> str | None:
    """One line for torch's error about a dead DataLoader worker (None for any other error): which
    worker, how it ended (its exit code or signal, from `workers`' processes where known) and the likely
    cause."""
    match = _DIED.search(str(err))
    if match is None:
        return None
    pids, how = match.group(1).strip(), match.group(2).strip().split(". ")[0].rstrip(".")
    codes = [w.exitcode for w in workers if str(w.pid) in pids.split(", ") and w.exitcode]
    if codes and codes[0] < 0:
        how = f"was killed by {signal.Signals(-codes[0]).name}"
    elif codes:
        how = f"exited with code {codes[0]}"
    if "Killed" in how or "SIGKILL" in how or "exited unexpectedly" == how:
        free = _available_gib()
        cause = (
            "most likely the kernel's out-of-memory killer (see dmesg"
            + (f"; {free:.1f} GiB available now" if free is not None else "")
            + "): lower data.num_workers, data.prefetch_factor or data.image.max_pixels"
        )
    elif "Bus error" in how:
        cause = "most likely shared memory (/dev/shm) ran out: enlarge it or lower data.num_workers"
    else:
        cause = "run with data.num_workers=0 to see the error in this process"
    return (
        f"data worker (pid {pids}) {how}: {cause}; the run stops, and a relaunch resumes exactly from "
        "the last checkpoint"
    )


# a killed worker is reaped within milliseconds; a busy machine may take more
WORKER_REAP_GRACE_S = 30.0


def _dead_workers(workers, grace_s: float) -> list:
    """The workers that have ended, waiting up to `grace_s` for one to be reported (its exit reaches
    the trainer only once its parent, the fork server, reaps it); empty if all are alive by then."""
    workers = list(workers)
    deadline = time.monotonic() + grace_s
    while True:
        dead = [w for w in workers if not w.is_alive()]
        if dead or not workers or time.monotonic() >= deadline:
            return dead
        mp_connection.wait([w.sentinel for w in workers], timeout=0.1)


def _available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(x.split()[1]) for x in f if x.startswith("MemAvailable:"))
        return kib / 2**20
    except (OSError, StopIteration, ValueError):
        return None


@atexit.register
def _close_open_loaders() -> None:
    for loader in list(_OPEN):
        loader.close()


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
            keys = sorted(k for k in head.keys() | other.keys() if head.get(k) != other.get(k))
            shown = "; ".join(
                f"{k}: {other.get(k)!r} vs {head.get(k)!r}" for k in keys if k != "files"
            )
            raise ValueError(
                f"cannot merge data-loader states of different jobs: they differ in {keys} ({shown}); "
                "merge the states saved at one step of one run"
            )
        for s, st in sd["states"].items():
            if out.setdefault(s, st) != st:
                raise ValueError(
                    f"two data-loader states hold different states for stream {s}: merge the "
                    "states saved at one step, one per rank"
                )
    return copy.deepcopy({**head, "states": dict(sorted(out.items(), key=lambda kv: int(kv[0])))})


class PackedLoader:
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
        self.files = shard_identities(self.shards)  # [name, size, hash] each, checked on resume
        self.streams, self.workers = resolve_streams(cfg, rank, world, len(self.shards))
        # this rank's streams, in delivery order
        self.local = list(range(rank, self.streams, world))
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
        while True:
            batch, error = self._next_row()
            # the workers are stopped already; a later iteration restarts them
            if error is not None:
                raise DataError(error)
            state = batch.pop("state")
            self.states[state["stream"]] = state
            if not batch.pop("end", False):  # a row, not a finished stream's last state
                break
        self.wait_s += time.perf_counter() - t0
        self.offset = (self.offset + 1) % len(self.local)
        return batch

    def _next_row(self) -> tuple[dict | None, str | None]:
        """The next row, or the one-line message of a DataError (from a worker, torch's text is
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
            dead = _dead_workers(getattr(self._it, "_workers", ()), grace_s=WORKER_REAP_GRACE_S)
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
        _OPEN.add(self)
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
    def _header(self) -> dict:
        head = {
            "version": STATE_VERSION,
            "shards": fingerprint(self.shards),
            "seed": self.cfg.seed,
            "streams": self.streams,
            "files": copy.deepcopy(self.files),
        }
        # absent for real data, so states saved before data.mock existed still match
        if self.cfg.mock != "none":
            head["mock"] = self.cfg.mock
        return head

    def state_dict(self) -> dict:
        """This rank's streams' states, keyed by global stream id (merge the ranks' with `merge_states`)."""
        return {
            **self._header(),
            "states": {str(s): copy.deepcopy(st) for s, st in sorted(self.states.items())},
        }

    def load_state_dict(self, sd: dict) -> None:
        """Takes this rank's streams from `sd` (one rank's state or several merged)."""
        if sd.get("version") not in (2, STATE_VERSION):
            raise ValueError(
                f"data-loader state version {sd.get('version')!r} is not one this loader reads (2 or "
                f"{STATE_VERSION}); resume with the moevlm version that saved it or start the data fresh"
            )
        head = self._header()
        diff = {
            k: (sd.get(k), head[k]) for k in ("shards", "seed", "streams") if sd.get(k) != head[k]
        }
        if diff:
            raise ValueError(
                "the data-loader state does not belong to this loader: "
                + ", ".join(f"{k} saved {a!r} vs now {b!r}" for k, (a, b) in diff.items())
                + "; resume with the same shards, data.seed and number of streams (set "
                "data.streams to the saved value; with data.streams=0 it is "
                f"{DEFAULT_STREAMS} or fewer, as many as the shards can feed)"
            )
        if sd.get("mock", "none") != self.cfg.mock:
            raise ValueError(
                f"the data-loader state was saved with data.mock={sd.get('mock', 'none')} but this run "
                f"has data.mock={self.cfg.mock}: mock and real data are different data; resume with "
                f"data.mock={sd.get('mock', 'none')}, or start a new run"
            )
        self._check_files(sd.get("files"))
        self.close()
        self.states = {
            int(s): copy.deepcopy(st) for s, st in sd["states"].items() if int(s) in self.local
        }
        self.offset = sum(st["batches"] for st in self.states.values()) % len(self.local)

    def _check_files(self, saved: list | None) -> None:
        """The shards' sizes and content hashes against the state's (refused or warned)."""
        if saved is None:
            log.warning(
                "the data-loader state predates shard fingerprints (state version 2): cannot check that "
                "the %d shards are unchanged since the checkpoint",
                len(self.shards),
            )
            return
        changed = [(a, b) for a, b in zip(saved, self.files) if list(a) != list(b)]
        if not changed:
            return
        names = ", ".join(
            f"{b[0]} ({a[1]} -> {b[1]} bytes)"
            if a[1] != b[1]
            else f"{b[0]} (same size, other bytes)"
            for a, b in changed[:3]
        ) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        what = f"{len(changed)} of {len(self.files)} shards changed since the checkpoint: {names}"
        if not self.cfg.allow_changed_shards:
            raise ValueError(
                f"{what}; the saved positions would point at other samples. Put the original shards "
                "back, or set data.allow_changed_shards=true to continue on the new contents"
            )
        log.warning(
            "%s; continuing because data.allow_changed_shards=true (saved positions inside them now point "
            "at other samples)",
            what,
        )

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict:
        skipped, unusable = Counter(), Counter()
        for s in self.states.values():
            skipped.update(s["skipped"])
            unusable.update(s.get("shards_all_skipped", {}))
        fell_back = {r: skipped.pop(r) for r in sorted(FALLBACKS) if r in skipped}
        return {
            "skipped": dict(sorted(skipped.items())),
            "skipped_total": sum(skipped.values()),
            "fell_back": fell_back,
            "images_packed": sum(s.get("images_packed", 0) for s in self.states.values()),
            "over_vision_budget": sum(s.get("over_vision_budget", 0) for s in self.states.values()),
            "shards_all_skipped": dict(sorted(unusable.items())),
            "samples_read": sum(s["read"] for s in self.states.values()),
            "samples_packed": sum(s["packed"] for s in self.states.values()),
            "batches": sum(s["batches"] for s in self.states.values()),
            "epoch": min((s["epoch"] for s in self.states.values()), default=0),
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
    if cfg.shards == "sample":
        cfg = dataclasses.replace(cfg, shards=str(sample_set(log_it=rank == 0)))
    tok = find_tokenizer(cfg, expand_shards(cfg.shards), hf_checkpoint)
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


def sample_set(log_it: bool = True):
    """data.shards=sample: the embedded sample set's folder, built once per content version in the
    cache (moevlm.data.sample_cache; safe when several processes ask at once) and logged."""
    path, built = ensure_sample()
    if log_it:
        log.info(describe_sample(path, built))
    return path


def find_tokenizer(cfg: DataConfig, shards: list[str], hf_checkpoint: str = "") -> str:
    """The tokenizer.json to use: data.tokenizer, else the one beside the (first) shards, else the
    checkpoint's; one message naming all three when none is there."""
    if cfg.tokenizer:
        if not os.path.isfile(cfg.tokenizer):
            raise DataSetupError(
                f"data.tokenizer={shown_path(cfg.tokenizer)} is not a file; point it at a tokenizer.json "
                "(e.g. the checkpoint's) or leave it empty to use <shards folder>/tokenizer.json"
            )
        return cfg.tokenizer
    beside = os.path.join(os.path.dirname(os.path.abspath(shards[0])), "tokenizer.json")
    ckpt = os.path.join(hf_checkpoint, "tokenizer.json") if hf_checkpoint else ""
    for path in (beside, ckpt):
        if path and os.path.isfile(path):
            return path
    raise DataSetupError(
        f"no tokenizer: data.tokenizer is not set, {beside} does not exist and "
        + (f"{ckpt} does not either" if ckpt else "model.hf_checkpoint is not set")
        + "; do one of: set data.tokenizer=FILE (a tokenizer.json, e.g. the checkpoint's), rebuild the shards "
        "with `python -m moevlm.data.build_shards ... --tokenizer FILE` (copies it beside them), or set "
        "model.hf_checkpoint=DIR (a folder holding tokenizer.json)"
    )


def check_config(cfg: DataConfig, model_cfg=None, world: int = 1) -> None:
    """Every check that needs no file: each field's range, image geometry against the model, budgets,
    the streams' layout."""
    check_fields(cfg)
    im, pk = cfg.image, cfg.pack
    if model_cfg is not None:
        v = model_cfg.vision
        mine = (im.patch_size, im.temporal_patch_size, im.merge_size)
        theirs = (v.patch_size, v.temporal_patch_size, v.spatial_merge_size)
        if mine != theirs:
            raise ValueError(
                f"data.image (patch, temporal, merge) = {mine} but the model's vision config has "
                f"{theirs}; set data.image to the model's values"
            )
    unit = im.patch_size**2
    # 0: a text-only budget
    if pk.max_patches and pk.max_images and im.max_pixels // unit > pk.max_patches:
        raise ValueError(
            f"one image may need up to {im.max_pixels // unit} patches (data.image.max_pixels="
            f"{im.max_pixels}) but a micro-batch holds data.pack.max_patches={pk.max_patches}; "
            "raise max_patches or lower max_pixels (or set max_patches=0 to train on text only)"
        )
    if pk.max_patches % im.merge_size**2:
        raise ValueError(
            f"data.pack.max_patches={pk.max_patches} must be a multiple of merge_size^2="
            f"{im.merge_size**2} (the padding patches are merged like an image's)"
        )
    check_streams(cfg, world)


def _require(ok: bool, field: str, value, want: str) -> None:
    if not ok:
        raise ValueError(f"data.{field}={value!r} is invalid: set it to {want}")


def _one_of(values) -> str:
    *head, last = map(repr, values)
    return f"{', '.join(head)} or {last}" if head else last


def check_fields(cfg: DataConfig) -> None:
    """Each DataConfig field on its own: a value that cannot work (a packing budget that holds no
    sample, a non-positive size) is refused with the field, its value and what to set."""
    im, pk = cfg.image, cfg.pack
    _require(
        pk.seq_len >= 2,
        "pack.seq_len",
        pk.seq_len,
        "at least 2 tokens (a sample and its next-token target)",
    )
    _require(
        pk.max_samples >= 1,
        "pack.max_samples",
        pk.max_samples,
        "at least 1 (documents per packed row)",
    )
    _require(
        pk.max_patches >= 0, "pack.max_patches", pk.max_patches, "0 (text only) or more patches"
    )
    _require(pk.max_images >= 0, "pack.max_images", pk.max_images, "0 (text only) or more images")
    _require(pk.lookahead >= 0, "pack.lookahead", pk.lookahead, "0 or more samples")
    _require(pk.oversize in OVERSIZE, "pack.oversize", pk.oversize, _one_of(OVERSIZE))
    vision_budget(pk.max_vision_flops, pk.max_patches)  # off, auto or a positive number: ValueError
    for name in ("patch_size", "temporal_patch_size", "merge_size"):
        _require(getattr(im, name) >= 1, f"image.{name}", getattr(im, name), "a positive integer")
    _require(im.min_pixels >= 1, "image.min_pixels", im.min_pixels, "a positive pixel count")
    _require(
        im.max_pixels >= im.min_pixels,
        "image.max_pixels",
        im.max_pixels,
        f"at least data.image.min_pixels={im.min_pixels} (or lower min_pixels)",
    )
    _require(
        im.max_image_pixels >= 1,
        "image.max_image_pixels",
        im.max_image_pixels,
        "a positive width*height limit (default 100000000)",
    )
    _require(
        im.max_decode_bytes >= 1,
        "image.max_decode_bytes",
        im.max_decode_bytes,
        "a positive byte budget (default 400000000)",
    )
    _require(len(im.mean) == 3, "image.mean", list(im.mean), "three per-channel values (R, G, B)")
    _require(
        len(im.std) == 3 and all(x > 0 for x in im.std),
        "image.std",
        list(im.std),
        "three positive per-channel values (pixels are divided by them)",
    )
    _require(
        cfg.max_text_bytes >= 1,
        "max_text_bytes",
        cfg.max_text_bytes,
        "a positive byte cap (default 1048576)",
    )
    _require(
        cfg.max_image_bytes >= 1,
        "max_image_bytes",
        cfg.max_image_bytes,
        "a positive byte cap (default 33554432)",
    )
    _require(
        cfg.num_workers >= 0,
        "num_workers",
        cfg.num_workers,
        "0 (read in the training process) or more",
    )
    _require(
        cfg.prefetch_factor >= 1,
        "prefetch_factor",
        cfg.prefetch_factor,
        "at least 1 row per worker",
    )
    _require(
        cfg.shuffle_buffer >= 0,
        "shuffle_buffer",
        cfg.shuffle_buffer,
        "0 (shard order) or more samples",
    )
    _require(
        cfg.epochs is None or cfg.epochs >= 1,
        "epochs",
        cfg.epochs,
        "null (loop forever) or at least 1",
    )
    _require(
        str(cfg.pin_memory).lower() in PIN_MEMORY, "pin_memory", cfg.pin_memory, _one_of(PIN_MEMORY)
    )
    _require(cfg.mock in MOCK, "mock", cfg.mock, _one_of(MOCK))
    _require(cfg.format in FORMATS, "format", cfg.format, _one_of(FORMATS))
    _require(
        cfg.start_method in mp.get_all_start_methods(),
        "start_method",
        cfg.start_method,
        f"one of {mp.get_all_start_methods()}",
    )


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
