"""Reading WebDataset shards: which shards a data stream reads in an epoch, a seeded shuffle buffer,
and positions that make the stream resumable.

    shards = expand_shards("data/shards")                 # dir, brace pattern or comma list
    plan = ShardPlan(shards, seed=0, stream=s, streams=L)
    for pos, raw in plan.read(epoch, ReadAt(0, 0), skips): ...   # pos: Pos(epoch, shard, sample)

In epoch e stream s reads order[s::L] of one seeded permutation of all shards.  A member over its
byte cap is passed over unread (an `Oversize` marker); damage is `truncated_shard`.  Each shard's
identity (name, size, hash of both ends) lets a resume notice rewritten shards.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import re
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

from webdataset.tariterators import group_by_keys

from moevlm.data.errors import DataSetupError, SkipCounter, SkipSample


class Pos(NamedTuple):
    """Where a sample is: its epoch, its shard's index in the stream's list of the epoch, its index in
    the shard."""

    epoch: int
    shard: int
    sample: int


class ReadAt(NamedTuple):
    """Where a stream reads next in its epoch: a shard index in its list and a sample index in it."""

    shard: int
    sample: int


def shard_spec(paths: list[str]) -> str:
    """A spec that `expand_shards` reads back as `paths`, in order: a numbered range `pre{000..009}suf`
    when they are consecutive numbers of one width between a common prefix and suffix, else a comma
    list.  (What to write for shards a shell's brace expansion turned into many arguments.)"""
    paths = [str(p) for p in paths]
    if len(paths) > 1:
        pre = os.path.commonprefix(paths)
        suf = os.path.commonprefix([p[len(pre) :][::-1] for p in paths])[::-1]
        # whole numbers, not their common leading digits: s-000..s-002 is s-{000..002}, not s-00{0..2}
        while pre and pre[-1].isdigit():
            pre = pre[:-1]
        while suf and suf[0].isdigit():
            suf = suf[1:]
        mid = [p[len(pre) : len(p) - len(suf)] for p in paths]
        widths = {len(m) for m in mid}
        if all(m.isdigit() for m in mid) and len(widths) == 1:
            numbers = [int(m) for m in mid]
            if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
                return f"{pre}{{{mid[0]}..{mid[-1]}}}{suf}"
    return ",".join(paths)


def _top_level_parts(spec: str) -> list[str]:
    """`spec` cut at the commas outside braces: `a.tar,/d/{x,y}.tar` is `a.tar` and `/d/{x,y}.tar`
    (a comma list of patterns, each pattern's own `{a,b}` alternatives kept for braceexpand)."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(spec):
        depth += (c == "{") - (c == "}" and depth > 0)
        if c == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    parts.append(spec[start:])
    return [p.strip() for p in parts if p.strip()]


def expand_shards(spec: str | list[str]) -> list[str]:
    """A folder (its *.tar, *.tar.gz, *.tgz, sorted), a brace pattern, a glob, or a comma list."""
    if isinstance(spec, (list, tuple)):
        out = [str(s) for s in spec]
    elif os.path.isdir(spec):
        out = sorted(
            p for ext in ("*.tar", "*.tar.gz", "*.tgz") for p in glob.glob(os.path.join(spec, ext))
        )
    else:
        import braceexpand

        out = [
            p
            for part in _top_level_parts(spec)
            for b in braceexpand.braceexpand(part)
            for p in (sorted(glob.glob(b)) if any(c in b for c in "*?[") else [b])
        ]
    # some missing: skipped as unreadable_shard
    if not out or not any(os.path.exists(p) for p in out):
        what = (
            "is a folder without .tar shards"
            if isinstance(spec, str) and os.path.isdir(spec)
            else "names no folder or file that exists"
        )
        raise DataSetupError(
            f"no shards found for data.shards={spec!r}"
            + (f" (in {os.getcwd()})" if isinstance(spec, str) and not os.path.isabs(spec) else "")
            + f": it {what}; give a folder of .tar files, "
            "a brace pattern (dir/shard-{000000..000009}.tar) or build some with "
            "`python -m moevlm.data.build_shards`"
        )
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


IDENTITY_BYTES = 64 * 1024  # hashed at each end of a shard


def shard_identity(path: str) -> list:
    """[name, size, hash of the first and last IDENTITY_BYTES]: cheap for any shard size
    (size -1 and hash "unreadable" for a shard that cannot be opened)."""
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(0)
            h = hashlib.sha1(f.read(IDENTITY_BYTES))
            f.seek(max(0, size - IDENTITY_BYTES))
            h.update(f.read(IDENTITY_BYTES))
    except OSError:
        return [name, -1, "unreadable"]
    return [name, size, h.hexdigest()[:16]]


def shard_identities(shards: list[str]) -> list[list]:
    """`shard_identity` of every shard, read on a few threads (I/O bound)."""
    with ThreadPoolExecutor(max(1, min(16, len(shards)))) as pool:
        return list(pool.map(shard_identity, shards))


@dataclass(frozen=True)
class Oversize:
    """Stands for a tar member whose bytes were not read: it is over its cap."""

    name: str
    size: int
    cap: int

    @property
    def reason(self) -> str:
        return "text_too_large" if is_text_member(self.name) else "file_too_large"


def is_text_member(name: str) -> bool:
    return name.rsplit(".", 1)[-1].lower() in ("json", "txt")


VIDEO_EXTS = ("mp4", "mov", "m4v", "mkv", "webm", "avi")


def is_video_member(name: str) -> bool:
    return name.rsplit(".", 1)[-1].lower() in VIDEO_EXTS


def member_cap(name: str, max_text: int, max_file: int, max_video: int | None = None) -> int:
    """The byte cap of a tar member: data.max_text_bytes (json, txt), data.max_video_bytes (videos),
    else data.max_image_bytes."""
    if is_text_member(name):
        return max_text
    return max_file if max_video is None or not is_video_member(name) else max_video


_META = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members (skipped, as webdataset does)


def members(
    url: str, stream, max_text: int, max_file: int, damaged: list, max_video: int | None = None
) -> Iterator[dict]:
    """{fname, data, __url__} for each regular member of the tar `stream` (data: the
    bytes, or an `Oversize` marker for a member over its cap), then {} (end of
    shard).  The first error ends the shard and is appended to `damaged`."""
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as tar:
            for info in tar:
                if not info.isreg() or _META.match(info.name):
                    continue
                cap = member_cap(info.name, max_text, max_file, max_video)
                data = (
                    Oversize(info.name, info.size, cap)
                    if info.size > cap
                    else tar.extractfile(info).read()
                )
                yield {"fname": info.name, "data": data, "__url__": url}
                tar.members = []  # stream mode keeps every header otherwise
    except Exception as exn:  # a damaged or foreign file: keep what came before
        damaged.append(exn)
        return
    yield {}


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
    max_text_bytes: int = 1 << 20  # member caps (data.max_text_bytes / data.max_image_bytes)
    max_file_bytes: int = 32 << 20
    max_video_bytes: int | None = None  # data.max_video_bytes; None: videos capped as other files

    def __post_init__(self):
        if not 0 <= self.stream < self.streams <= len(self.shards):
            raise ValueError(
                f"stream {self.stream} of {self.streams}: {len(self.shards)} shards cannot feed "
                f"{self.streams} streams (each needs at least one shard)"
            )

    def mine(self, epoch: int) -> list[str]:
        order = list(self.shards)
        if self.shuffle:
            random.Random(mix(self.seed, epoch, 0x5A4D)).shuffle(order)
        return order[self.stream :: self.streams]

    def read(
        self,
        epoch: int,
        start: ReadAt,
        counter: SkipCounter | None,
        shard_done: Callable[[int, str], None] | None = None,
    ) -> Iterator[tuple[Pos, dict]]:
        """Raw samples (dicts of member bytes) of this stream's epoch from (shard, sample) `start` on;
        `shard_done(s, url)` is called after each shard is read to its end (or could not be opened)."""
        for s, url in enumerate(self.mine(epoch)):
            if s < start.shard:
                continue
            skip = start.sample if s == start.shard else 0
            for k, raw in enumerate(self.read_shard(url, counter)):
                if k >= skip:
                    yield Pos(epoch, s, k), raw
            if shard_done is not None:
                shard_done(s, url)

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
            for raw in group_by_keys(
                members(
                    url,
                    stream,
                    self.max_text_bytes,
                    self.max_file_bytes,
                    damaged,
                    self.max_video_bytes,
                ),
                handler=handler,
            ):
                n += 1
                yield raw
        problem = self._damage(url, n, damaged)
        if problem and counter is not None:
            counter.add(SkipSample("truncated_shard", problem), os.path.basename(url))

    def _damage(self, url: str, n: int, errors: list[Exception]) -> str:
        expected = self.counts.get(os.path.abspath(url))
        if errors:
            return f"{errors[0]!r}; {n} samples read" + (
                f" of {expected}" if expected is not None else ""
            )
        if expected is not None and n < expected:
            return f"{n} of {expected} samples (per summary.json) read"
        if url.endswith(".tar") and not _has_end_of_archive(url):
            return f"no end-of-archive marker after {n} samples: the file was cut short"
        return ""

    def fetch(self, positions: list[Pos]) -> dict[Pos, dict]:
        """Re-read the raw samples at `positions` (for a resume): each needed shard is
        opened once and read only up to the last needed sample; nothing is decoded.  A position
        its shard no longer holds (rewritten shorter since the checkpoint) is absent from the result."""
        want: dict[tuple[int, int], set[int]] = {}
        for e, s, k in positions:
            want.setdefault((e, s), set()).add(k)
        out: dict[Pos, dict] = {}
        for (e, s), ks in sorted(want.items()):
            url, last = self.mine(e)[s], max(ks)
            for k, raw in enumerate(self.read_shard(url, None)):
                if k in ks:
                    out[Pos(e, s, k)] = raw
                if k >= last:
                    break
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
