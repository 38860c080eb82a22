"""Reading WebDataset shards: which shards a data stream reads in an epoch,
a seeded shuffle buffer, and positions that make the stream resumable.

    shards = expand_shards("data/shards")                 # dir, brace pattern or comma list
    plan = ShardPlan(shards, seed=0, stream=s, streams=L)
    for pos, raw in plan.read(epoch, start=(0, 0), counter=skips): ...

Design choices:
- Shards are split, not samples, over the job's L logical streams: in epoch e
  stream s reads `order[s::L]` of one seeded permutation of all shards shared
  by everybody (`plan.mine(e)`), so each sample is read once per epoch across
  the job and no reader reads bytes it throws away.  Which rank and which
  worker process serve a stream is the loader's business (loader.py), so what
  a stream reads does not depend on the parallel layout.  That is also why
  webdataset's split_by_node/split_by_worker (global rank, no epoch) are not
  used.
- Tar parsing is webdataset's (`tar_file_expander` + `group_by_keys`), one shard
  at a time so a damaged shard cannot bleed into the next; damage is counted
  as `truncated_shard` (once per shard) and the samples before it are kept.
  A tar cut exactly between members parses without error, so a shard is also
  checked against its sample count in the builder's summary.json (when
  present) and for the tar end-of-archive zero blocks.
- A position is (epoch, shard index in this stream's list, sample index in the
  shard).  Seeking to a position opens that shard and skips members without
  decoding them, so resuming never re-decodes images it does not need.
- The shuffle buffer draws with a counter-based hash of (seed, epoch, stream,
  draw number): its whole state is the positions it holds and the draw count,
  both small enough to checkpoint every step.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from webdataset.tariterators import group_by_keys, tar_file_expander

from moevlm.data.errors import SkipCounter, SkipSample

Pos = tuple[int, int, int]  # (epoch, shard index in the stream's list, sample index in the shard)


def expand_shards(spec: str | list[str]) -> list[str]:
    """A folder (its *.tar, *.tar.gz, *.tgz, sorted), a brace pattern, a glob, or a comma list."""
    if isinstance(spec, (list, tuple)):
        out = [str(s) for s in spec]
    elif os.path.isdir(spec):
        out = sorted(p for ext in ("*.tar", "*.tar.gz", "*.tgz") for p in glob.glob(os.path.join(spec, ext)))
    else:
        import braceexpand

        out = [p for part in spec.split(",") if part for b in braceexpand.braceexpand(part.strip())
               for p in (sorted(glob.glob(b)) if any(c in b for c in "*?[") else [b])]
    if not out:
        raise FileNotFoundError(f"no shards found for data.shards={spec!r}; give a folder of .tar files, a brace "
                                "pattern (dir/shard-{000000..000009}.tar) or build some with "
                                "`python -m moevlm.data.build_shards`")
    return out


def shard_counts(shards: list[str]) -> dict[str, int]:
    """Per-shard sample counts from each folder's summary.json, where the builder left one."""
    counts: dict[str, int] = {}
    for folder in sorted({os.path.dirname(os.path.abspath(s)) for s in shards}):
        try:
            summary = json.loads(Path(folder, "summary.json").read_text())
            for entry in summary.get("shards", []):
                counts[os.path.join(folder, entry["name"])] = int(entry["samples"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return counts


def fingerprint(shards: list[str]) -> str:
    """Identifies the shard list a loader state belongs to (names, not contents)."""
    return hashlib.sha1("\n".join(os.path.basename(s) for s in shards).encode()).hexdigest()[:16]


def mix(*xs: int) -> int:
    """A 64-bit hash of integers (splitmix64 over their sequence): counter-based randomness."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h


@dataclass
class ShardPlan:
    """The shards of stream `stream` of `streams` (the loader checks the numbers
    with config-level messages first)."""

    shards: list[str]
    seed: int = 0
    stream: int = 0
    streams: int = 1
    shuffle: bool = True
    counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        if not 0 <= self.stream < self.streams <= len(self.shards):
            raise ValueError(f"stream {self.stream} of {self.streams}: {len(self.shards)} shards cannot feed "
                             f"{self.streams} streams (each needs at least one shard)")

    def mine(self, epoch: int) -> list[str]:
        order = list(self.shards)
        if self.shuffle:
            random.Random(mix(self.seed, epoch, 0x5A4D)).shuffle(order)
        return order[self.stream::self.streams]

    def read(self, epoch: int, start: tuple[int, int], counter: SkipCounter | None) -> Iterator[tuple[Pos, dict]]:
        """Raw samples (dicts of member bytes) of this stream's epoch from (shard, sample) `start` on."""
        for s, url in enumerate(self.mine(epoch)):
            if s < start[0]:
                continue
            skip = start[1] if s == start[0] else 0
            for k, raw in enumerate(self.read_shard(url, counter)):
                if k >= skip:
                    yield (epoch, s, k), raw

    def read_shard(self, url: str, counter: SkipCounter | None) -> Iterator[dict]:
        damaged = []

        def handler(exn: Exception) -> bool:
            damaged.append(exn)
            return True

        try:
            stream = open(url, "rb")
        except OSError as exn:
            if counter is not None:
                counter.add(SkipSample("unreadable_shard", str(exn)), os.path.basename(url))
            return
        n = 0
        with stream:
            for raw in group_by_keys(tar_file_expander([{"url": url, "stream": stream}], handler=handler),
                                     handler=handler):
                n += 1
                yield raw
        problem = self._damage(url, n, damaged)
        if problem and counter is not None:
            counter.add(SkipSample("truncated_shard", problem), os.path.basename(url))

    def _damage(self, url: str, n: int, errors: list[Exception]) -> str:
        expected = self.counts.get(os.path.abspath(url))
        if errors:
            return f"{errors[0]!r}; {n} samples read" + (f" of {expected}" if expected is not None else "")
        if expected is not None and n < expected:
            return f"{n} of {expected} samples (per summary.json) read"
        if url.endswith(".tar") and not _has_end_of_archive(url):
            return f"no end-of-archive marker after {n} samples: the file was cut short"
        return ""

    def fetch(self, positions: list[Pos]) -> dict[Pos, dict]:
        """Re-read the raw samples at `positions` (for a resume): each needed shard is
        opened once and read only up to the last needed sample; nothing is decoded."""
        want: dict[tuple[int, int], set[int]] = {}
        for e, s, k in positions:
            want.setdefault((e, s), set()).add(k)
        out: dict[Pos, dict] = {}
        for (e, s), ks in sorted(want.items()):
            url, last = self.mine(e)[s], max(ks)
            for k, raw in enumerate(self.read_shard(url, None)):
                if k in ks:
                    out[(e, s, k)] = raw
                if k >= last:
                    break
        missing = [p for p in positions if p not in out]
        if missing:
            raise RuntimeError(f"resume: samples at positions {missing[:4]} are gone; were the shards "
                               "rewritten since the checkpoint?")
        return out


def _has_end_of_archive(url: str) -> bool:
    """A complete tar ends with (at least) two 512-byte zero blocks."""
    try:
        with open(url, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size < 1024 or size % 512:
                return False
            f.seek(size - 1024)
            return f.read(1024) == bytes(1024)
    except OSError:
        return False


class ShuffleBuffer:
    """Holds up to `size` (pos, item); each push past `size` emits one item drawn by
    the counter hash.  State: the held positions (in order) and the draw count."""

    def __init__(self, size: int, key: tuple[int, ...], draws: int = 0):
        self.size, self.key, self.draws = size, key, draws
        self.items: list[tuple[Pos, dict]] = []

    def push(self, pos: Pos, item: dict) -> tuple[Pos, dict] | None:
        self.items.append((pos, item))
        return self.pop() if len(self.items) > self.size else None

    def pop(self) -> tuple[Pos, dict] | None:
        if not self.items:
            return None
        j = mix(*self.key, self.draws) % len(self.items)
        self.draws += 1
        self.items[j], self.items[-1] = self.items[-1], self.items[j]
        return self.items.pop()

    def positions(self) -> list[Pos]:
        return [p for p, _ in self.items]
