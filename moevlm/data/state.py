"""The loader's resumable state: each data stream's `StreamState` (typed here, builtins on disk) and the
header naming the data it belongs to (`DataIdentity`), checked on load.

    st = StreamState(stream=s)                  # a fresh stream; StreamState.from_dict(saved) resumes one
    st.to_dict()                                # what a checkpoint holds (STATE_VERSION's layout)
    sd = {**identity.header(), "states": {"0": st.to_dict(), ...}}   # PackedLoader.state_dict()
    merge_states([sd_rank0, sd_rank1])          # the union of the ranks' states: any data-parallel size

Positions are reader.Pos (epoch, shard, sample), stored as [epoch, shard, sample] lists.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field

from moevlm.data.config import DEFAULT_STREAMS
from moevlm.data.reader import Pos, ReadAt

# the loader's warnings keep one logger name for all of its parts
log = logging.getLogger("moevlm.data.loader")

# 3: the header records each shard's identity ("files"); 2 (without it) still loads
STATE_VERSION = 3


@dataclass
class ShardTally:
    """One shard of the current epoch until it is settled: read to its end and none of its samples
    waiting in the shuffle buffer (then it is dropped, and counted by name if none was usable)."""

    read: int = 0  # samples read from it
    waiting: int = 0  # of those, still in the shuffle buffer
    usable: int = 0  # of those, encoded
    done: bool = False  # read to its end


@dataclass
class StreamState:
    """Everything a stream needs to continue exactly where its last delivered row left it."""

    stream: int
    epoch: int = 0
    next_read: ReadAt = ReadAt(0, 0)  # where reading continues in this epoch
    shuffle: list[Pos] = field(default_factory=list)  # held in the shuffle buffer, in order
    draws: int = 0  # the shuffle buffer's draw count
    packer: list[Pos] = field(default_factory=list)  # held by the packer, in order
    skipped: dict[str, int] = field(default_factory=dict)  # skip reason -> samples
    read: int = 0  # samples read
    packed: int = 0  # samples packed into rows
    batches: int = 0  # rows produced
    tally: dict[int, ShardTally] = field(default_factory=dict)  # shard index -> its tally
    epoch_unusable: int = 0  # shards of this epoch that gave no usable sample
    shards_all_skipped: dict[str, int] = field(default_factory=dict)  # name -> such passes
    data_checked: bool = False  # the whole data set was seen to hold a usable sample
    image_samples: int = 0  # samples read that carry image members
    images_used: int = 0  # images of the samples that encoded
    images_packed: int = 0  # images in the rows produced
    videos_packed: int = 0  # videos in the rows produced
    images_checked: bool = False  # the whole data set was seen to hold a usable image
    over_vision_budget: int = (
        0  # rows of one sample over data.pack.max_vision_flops (it went alone)
    )

    def to_dict(self) -> dict:
        """The checkpoint's form: keys and value layout of STATE_VERSION (lists, dicts, ints, bools)."""
        return {
            "stream": self.stream,
            "epoch": self.epoch,
            "next": list(self.next_read),
            "shuffle": [list(p) for p in self.shuffle],
            "draws": self.draws,
            "packer": [list(p) for p in self.packer],
            "skipped": dict(self.skipped),
            "read": self.read,
            "packed": self.packed,
            "batches": self.batches,
            # [shard index, read, still in the shuffle buffer, encoded, read to its end]
            "tally": [
                [s, t.read, t.waiting, t.usable, int(t.done)] for s, t in sorted(self.tally.items())
            ],
            "epoch_unusable": self.epoch_unusable,
            "shards_all_skipped": dict(self.shards_all_skipped),
            "data_checked": self.data_checked,
            "image_samples": self.image_samples,
            "images_used": self.images_used,
            "images_packed": self.images_packed,
            "videos_packed": self.videos_packed,
            "images_checked": self.images_checked,
            "over_vision_budget": self.over_vision_budget,
        }

    @classmethod
    def from_dict(cls, d: dict) -> StreamState:
        """A saved state (`to_dict`'s form); keys an older state lacks take their fresh values."""
        d = copy.deepcopy(d)
        fresh = cls(stream=d["stream"])
        return cls(
            **{k: d[k] for k in _SAVED_AS_IS if k in d},
            next_read=ReadAt(*d.get("next", fresh.next_read)),
            shuffle=[Pos(*p) for p in d.get("shuffle", [])],
            packer=[Pos(*p) for p in d.get("packer", [])],
            tally={
                s: ShardTally(read, waiting, usable, bool(done))
                for s, read, waiting, usable, done in d.get("tally", [])
            },
        )


# the fields whose saved value is their value (the others: positions and tallies as lists)
_SAVED_AS_IS = tuple(
    f.name
    for f in dataclasses.fields(StreamState)
    if f.name not in ("next_read", "shuffle", "packer", "tally")
)


@dataclass(frozen=True)
class DataIdentity:
    """What a saved state must match to resume: the shard list (reader.fingerprint), each shard's
    identity (name, size, hash: reader.shard_identities), data.seed, the number of streams, data.mock."""

    shards: str
    files: list
    seed: int
    streams: int
    mock: str = "none"

    def header(self) -> dict:
        """The state_dict()'s keys beside "states"."""
        head = {
            "version": STATE_VERSION,
            "shards": self.shards,
            "seed": self.seed,
            "streams": self.streams,
            "files": copy.deepcopy(self.files),
        }
        # absent for real data, so states saved before data.mock existed still match
        if self.mock != "none":
            head["mock"] = self.mock
        return head

    def check(self, sd: dict, allow_changed_shards: bool = False) -> None:
        """ValueError, naming what to set, unless the state `sd` belongs to this data."""
        if sd.get("version") not in (2, STATE_VERSION):
            raise ValueError(
                f"data-loader state version {sd.get('version')!r} is not one this loader reads (2 or "
                f"{STATE_VERSION}); resume with the moevlm version that saved it or start the data fresh"
            )
        head = self.header()
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
        if sd.get("mock", "none") != self.mock:
            raise ValueError(
                f"the data-loader state was saved with data.mock={sd.get('mock', 'none')} but this run "
                f"has data.mock={self.mock}: mock and real data are different data; resume with "
                f"data.mock={sd.get('mock', 'none')}, or start a new run"
            )
        self._check_files(sd.get("files"), allow_changed_shards)

    def _check_files(self, saved: list | None, allow_changed_shards: bool) -> None:
        """The shards' sizes and content hashes against the state's (refused or warned)."""
        if saved is None:
            log.warning(
                "the data-loader state predates shard fingerprints (state version 2): cannot check that "
                "the %d shards are unchanged since the checkpoint",
                len(self.files),
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
        if not allow_changed_shards:
            raise ValueError(
                f"{what}; the saved positions would point at other samples. Put the original shards "
                "back, or set data.allow_changed_shards=true to continue on the new contents"
            )
        log.warning(
            "%s; continuing because data.allow_changed_shards=true (saved positions inside them now point "
            "at other samples)",
            what,
        )


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
