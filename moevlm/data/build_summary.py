"""What a shard build wrote: the running counts, the summary (OUT/summary.json) and its printed form.

stats = BuildStats(); stats.count(rec, image_files, video_files)   # per sample written
summary = stats.summary(out, shards, skips, args); print(format_summary(summary, out))
"""

from __future__ import annotations

from pathlib import Path

from moevlm.data.errors import SkipCounter
from moevlm.data.records import KINDS, Record


class BuildStats:
    """Running counts of what was written."""

    def __init__(self):
        self.samples, self.images, self.image_bytes = 0, 0, 0
        self.videos, self.video_bytes = 0, 0
        self.kinds = dict.fromkeys(KINDS, 0)
        self.seen_ids: set[str] = set()
        self.duplicates: list[str] = []

    def count(
        self,
        rec: Record,
        files: list[tuple[bytes, str]],
        videos: list[tuple[bytes, str]] = (),
    ) -> None:
        self.samples += 1
        self.kinds[rec.kind] += 1
        self.images += len(files)
        self.image_bytes += sum(len(data) for data, _ in files)
        self.videos += len(videos)
        self.video_bytes += sum(len(data) for data, _ in videos)
        if rec.id in self.seen_ids:
            self.duplicates.append(rec.id)
        self.seen_ids.add(rec.id)

    def summary(self, out: Path, shards: list[dict], skips: SkipCounter, args: dict) -> dict:
        return {
            "samples": self.samples,
            "kinds": self.kinds,
            "images": self.images,
            "image_bytes": self.image_bytes,
            # only with videos: an image build's summary stays as it was
            **({"videos": self.videos, "video_bytes": self.video_bytes} if self.videos else {}),
            "bytes": sum((out / s["name"]).stat().st_size for s in shards),
            "skipped": dict(sorted(skips.items())),
            "skipped_examples": dict(sorted(skips.examples.items())),
            "duplicate_ids": len(self.duplicates),
            "duplicate_id_examples": self.duplicates[:3],
            "shards": shards,
            "args": args,
        }


def format_summary(s: dict, out: Path) -> str:
    kinds = ", ".join(f"{k} {n}" for k, n in s["kinds"].items())
    videos = f"{s['videos']} videos, " if s.get("videos") else ""
    lines = [
        f"wrote {s['samples']} samples ({kinds}), {s['images']} images, {videos}"
        f"{s['bytes'] / 1e6:.1f} MB in {len(s['shards'])} shard(s) to {out}"
    ]
    skipped = sum(s["skipped"].values())
    lines.append(f"skipped {skipped} record(s)" + (":" if skipped else ""))
    for reason, n in s["skipped"].items():
        lines.append(f"  {reason}: {n}   e.g. " + " | ".join(s["skipped_examples"].get(reason, [])))
    if s["duplicate_ids"]:
        lines.append(
            f"duplicate ids (kept): {s['duplicate_ids']}, e.g. {s['duplicate_id_examples']}"
        )
    return "\n".join(lines)
