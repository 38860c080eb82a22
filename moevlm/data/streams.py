"""The data streams: each logical stream reads its shards, shuffles, encodes and packs, and hands the
loader every row beside its state just after it (`Delivery`); `PackedDataset` is what each worker
process serves: this rank's streams, round robin.

    ds = PackedDataset(cfg, shards, counts, tokenizer_path, patch_dim, streams, local, states, offset)
    for d in ds:                      # in a worker: d.row a PackedRow (None: the stream ended), d.state
        ...

A stream that can use nothing goes on while the data set holds a usable sample (sample or image) and
raises DataError, with the counts and the settings to change, only where going on cannot help.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import signal
from collections import Counter
from dataclasses import dataclass

from torch.utils.data import IterableDataset, get_worker_info

from moevlm.data.config import DataConfig
from moevlm.data.encode import SampleEncoder
from moevlm.data.errors import DataError, SkipCounter, SkipSample
from moevlm.data.layouts import image_members
from moevlm.data.lifetime import watch_parent
from moevlm.data.packing import PackedRow, Packer, VisionFlops, collate
from moevlm.data.reader import Pos, ReadAt, ShardPlan, ShuffleBuffer
from moevlm.data.state import ShardTally, StreamState
from moevlm.data.text import ChatEncoder, load_tokenizer
from moevlm.signals import STOP_SIGNALS

# the loader's warnings keep one logger name for all of its parts
log = logging.getLogger("moevlm.data.loader")
# a shard with no sample in it: what usually wrote one
EMPTY_SHARD = (
    "it holds no sample: an empty tar, as img2dataset writes when every download of a shard failed "
    "(its *_stats.json beside the shards counts them), or a tool that stopped before writing"
)

NO_PROGRESS_SAMPLES = 10_000  # skipped in a row by a stream that never packed: check the data set
IMAGELESS_SAMPLES = 1_000  # samples with images read by a stream that used none: check the data set


@dataclass
class Delivery:
    """What a stream hands the loader: a packed row and the stream's state just after it; `row` None
    when the stream has ended (its last state still counts in the loader's stats)."""

    state: StreamState
    row: PackedRow | None = None

    def pin_memory(self) -> Delivery:
        """The row in page-locked memory (torch's DataLoader calls it where pin_memory is on)."""
        return self if self.row is None else dataclasses.replace(self, row=self.row.pin_memory())


class Stream:
    """One logical stream: read -> shuffle -> encode -> pack, yielding each row beside the stream's state."""

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
            cfg.max_video_bytes,
        )
        self.pad_id = encode.chat.eot_id
        self.packer = Packer(cfg.pack, ds.vision)
        saved = ds.states.get(stream)
        self.st = copy.deepcopy(saved) if saved is not None else StreamState(stream=stream)
        self.skips = SkipCounter(self.st.skipped)
        self.over_base = self.st.over_vision_budget
        self.failed = 0  # samples skipped in a row (since the last one that encoded)
        self.shuffle = self._new_buffer(self.st.epoch, self.st.draws)
        self._restore()

    def _new_buffer(self, epoch: int, draws: int = 0) -> ShuffleBuffer:
        return ShuffleBuffer(self.cfg.shuffle_buffer, (self.cfg.seed, epoch, self.stream), draws)

    def _restore(self) -> None:
        """The samples the shuffle buffer and the packer held at the checkpoint, read again.  Ones
        their shard no longer holds: DataError naming data.allow_changed_shards, or with it, skipped
        (counted as gone_on_resume, one warning)."""
        held = self.st.shuffle + self.st.packer
        raw = self.plan.fetch(held) if held else {}
        gone = [p for p in held if p not in raw]
        if gone:
            self._skip_gone(gone)
        self.shuffle.items = [(p, raw[p]) for p in self.st.shuffle if p in raw]
        for p in self.st.packer:
            if p in raw:  # encoded fine before the checkpoint
                self.packer.push(self.encode(raw[p], p))

    def _skip_gone(self, gone: list) -> None:
        where = ", ".join(
            f"{os.path.basename(self.plan.mine(p.epoch)[p.shard])}:{p.sample}" for p in gone[:3]
        ) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
        what = (
            f"data stream {self.stream}: {len(gone)} sample(s) held at the checkpoint (shuffle buffer "
            f"or packer) are gone from their shards ({where}): the shards were rewritten shorter since"
        )
        if not self.cfg.allow_changed_shards:
            raise DataError(
                f"{what}; set data.allow_changed_shards=true to skip them and continue, or put the "
                "original shards back"
            )
        for p in gone:
            self.skips.add(SkipSample("gone_on_resume", f"position {list(p)}"))
            if p in self.st.shuffle:  # (the packer's were settled when they were encoded)
                self._settle_sample(p.shard, usable=False)
        self.st.shuffle = [p for p in self.st.shuffle if p not in gone]
        self.st.packer = [p for p in self.st.packer if p not in gone]
        log.warning("%s; skipped (data.allow_changed_shards=true), counted as gone_on_resume", what)

    def __iter__(self):
        epochs = self.cfg.epochs
        st = self.st
        while epochs is None or st.epoch < epochs:
            epoch = st.epoch
            for pos, raw in self.plan.read(epoch, st.next_read, self.skips, self._read_all):
                st.next_read, st.read = ReadAt(pos.shard, pos.sample + 1), st.read + 1
                tally = st.tally.setdefault(pos.shard, ShardTally())
                tally.read, tally.waiting = tally.read + 1, tally.waiting + 1
                out = self.shuffle.push(pos, raw)
                if out is not None:
                    yield from self._feed(*out)
            while (out := self.shuffle.pop()) is not None:
                yield from self._feed(*out)
            self._end_epoch(epoch, last=epochs is not None and epoch + 1 >= epochs)
            st.epoch += 1
            st.next_read, st.draws, st.epoch_unusable = ReadAt(0, 0), 0, 0
            self.shuffle = self._new_buffer(st.epoch)
        while self.packer.held:
            yield self._deliver(self.packer.pop())
        # the state after the last read, for the loader's stats: skips after the last row count too
        yield Delivery(self._state())

    def _feed(self, pos: Pos, raw: dict):
        where = f"{raw.get('__url__', '?')}:{raw.get('__key__', '?')}"
        self.st.image_samples += self.encode.mock != "image_free" and bool(image_members(raw))
        try:
            sample = self.encode(raw, pos)
        except SkipSample as err:
            self.skips.add(err, where)
            self._settle_sample(pos.shard, usable=False)
            self.failed += 1
            if (
                self.failed >= NO_PROGRESS_SAMPLES
                and self._never_packed()
                and not self.st.data_checked
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
        for choice in sample.fallbacks:
            self.skips.add(SkipSample(choice, "sampled down to fit a row"), where)
        self.st.images_used += len(sample.grids)
        self._check_images(at_end=False)
        self._settle_sample(pos.shard, usable=True)
        self.packer.push(sample)
        while self.packer.full():
            yield self._deliver(self.packer.pop())

    # ------------------------------------------------ shards without a usable sample
    def _read_all(self, s: int, url: str) -> None:
        """The reader finished shard s of this epoch (also one it could not open): reading goes on at
        the next shard, so a resume never opens this one again."""
        self.st.next_read = ReadAt(s + 1, 0)
        self.st.tally.setdefault(s, ShardTally()).done = True
        self._settle(s)

    def _settle_sample(self, s: int, usable: bool) -> None:
        # (a state saved before tallies: counts from here)
        tally = self.st.tally.setdefault(s, ShardTally())
        tally.waiting -= 1
        tally.usable += usable
        self._settle(s)

    def _settle(self, s: int) -> None:
        """Once shard s is read to its end and none of its samples waits in the shuffle buffer: a
        shard that gave no usable sample is counted by name and the stream goes on with the next."""
        st, tally = self.st, self.st.tally[s]
        if not tally.done or tally.waiting > 0:
            return
        del st.tally[s]
        if tally.usable:
            return
        name = os.path.basename(self.plan.mine(st.epoch)[s])
        st.shards_all_skipped[name] = st.shards_all_skipped.get(name, 0) + 1
        st.epoch_unusable += 1
        log.warning(
            "data stream %d: shard %s gave no usable sample (%s); going on with the next shard "
            "(skipped so far: %s)",
            self.stream,
            name,
            f"all {tally.read} samples skipped" if tally.read else EMPTY_SHARD,
            ", ".join(f"{r}={n}" for r, n in self.skips.most_common()) or "none",
        )

    def _end_epoch(self, epoch: int, last: bool) -> None:
        """A stream that could use nothing goes on to its next epoch (other shards) while the data set
        holds a usable sample; it stops only where going on cannot help."""
        if self._never_packed() and not self.st.data_checked:
            self._check_data_set(f"in all of epoch {epoch}")
        self._check_images(at_end=True)
        mine = self.plan.mine(epoch)
        if self.st.epoch_unusable == len(mine) and not self.plan.shuffle and not last:
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
        if st.images_used or st.images_checked or not st.image_samples:
            return
        # a text-only budget: images are too_long by choice
        if not (pk.max_patches and pk.max_images):
            return
        if at_end or st.image_samples >= IMAGELESS_SAMPLES:
            self._check_data_set(f"in its first {st.image_samples} samples with images", True)

    def _check_data_set(self, when: str, need_image: bool = False) -> None:
        """Reads the whole data set (every shard of the epoch, other streams' first) until one sample
        encodes (`need_image`: with an image): the stream goes on if one does (not checked again), else
        DataError with the counts.  Reads only: what the stream yields does not change."""
        epoch = self.st.epoch
        mine = set(self.plan.mine(epoch))
        order = [u for u in self.plan.shards if u not in mine] + self.plan.mine(epoch)
        probe, read, unusable = SkipCounter(), 0, 0
        for url in order:
            usable = False
            for k, raw in enumerate(self.plan.read_shard(url, probe)):
                read += 1
                try:
                    sample = self.encode(raw, Pos(epoch, -1, k))
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
                self.st.images_checked = True
                log.warning(
                    "data stream %d could use no image %s (%s); other shards hold usable images, so it "
                    "goes on reading",
                    self.stream,
                    when,
                    self._skip_summary(),
                )
                return
            if usable:
                self.st.data_checked = True
                log.warning(
                    "data stream %d could pack no sample %s (skipped: %s); other shards hold usable "
                    "samples, so it goes on reading",
                    self.stream,
                    when,
                    self._skip_summary(),
                )
                return
            unusable += 1
        if read == 0 and not sum(probe.values()):  # no sample in any shard, none unreadable
            raise DataError(
                f"no shard of the data set holds a sample ({len(self.plan.shards)} shards, 0 samples "
                f"read): {EMPTY_SHARD}"
            )
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
            f"data stream {self.stream} read {self.st.image_samples} samples carrying images and could "
            f"use none of their images ({self._skip_summary()}); no sample of the whole data set "
            f"gives a usable image either ({len(self.plan.shards)} shards, {read} samples read: "
            f"{self._summary(data)}); {fix}, or set data.mock=image_free to train on the text alone"
        )

    def _never_packed(self) -> bool:
        """No sample of this stream ever encoded: none packed into a row and none held for one."""
        return self.st.packed == 0 and not self.packer.held

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
            f"data stream {self.stream} read {self.st.read} samples but could pack none {when}: "
            f"every one was skipped ({self._skip_summary()}); no sample of the whole data set is "
            f"usable either: {n} shards, {read} samples read, {unusable} of the {n} shards without a "
            f"usable sample, skipped: {self._summary(data)}; {', or '.join(fixes)}"
        )

    def _state(self) -> StreamState:
        """A copy of the stream's state now (what a row delivered now resumes from)."""
        st = self.st
        st.draws = self.shuffle.draws
        st.shuffle = self.shuffle.positions()
        st.packer = [s.pos for s in self.packer.held]
        st.over_vision_budget = self.over_base + self.packer.over_budget
        st.skipped = dict(self.skips)
        return copy.deepcopy(st)

    def _deliver(self, samples) -> Delivery:
        # check_config's budgets make this unreachable; an empty row must never train
        if not samples:
            raise RuntimeError(
                f"data stream {self.stream}: the packer produced an empty row "
                f"(data.pack={self.cfg.pack})"
            )
        self.st.packed += len(samples)
        self.st.images_packed += sum(len(s.grids) for s in samples)
        self.st.videos_packed += sum(len(s.video_grids) for s in samples)
        self.st.batches += 1
        row = collate(samples, self.cfg.pack, self.ds.patch_dim, self.pad_id)
        return Delivery(self._state(), row)


def round_robin(iterators):
    """One item from each iterator in turn; an exhausted one drops out."""
    live = list(iterators)
    while live:
        for it in list(live):
            try:
                yield next(it)
            except StopIteration:
                live.remove(it)


@dataclass
class PackedDataset(IterableDataset):
    """What each worker process receives (pickled): config, shards, this rank's
    streams (`local`), their states and the local index of the next one due."""

    cfg: DataConfig
    shards: list[str]
    counts: dict[str, int]  # samples per shard (the builder's summary.json, where present)
    tokenizer_path: str
    patch_dim: int
    streams: int  # L, the job's streams
    local: list[int]  # this rank's streams, in delivery order
    states: dict[int, StreamState]
    offset: int  # local index of the stream whose row comes next
    vision: VisionFlops | None = None  # the model's vision FLOPs (data.pack.max_vision_flops)
    # built in the training process, pickled to the workers
    main_pid: int = dataclasses.field(default_factory=os.getpid)

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
            cfg.video,
        )
        return round_robin([iter(Stream(self, s, encode)) for s in self.mine(p, workers)])
