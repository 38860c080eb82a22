"""Build WebDataset tar shards from image folders and annotation files.

    python -m moevlm.data.build_shards --images DIR --annotations a.json b.jsonl --out SHARDS
    python -m moevlm.data.build_shards --sample SHARDS      # the bundled sample set + tokenizer.json

Layout: `OUT/shard-000000.tar, ...` and `OUT/summary.json`.  Sample i (a
running count of samples written) is stored as the tar members

    000000042.json       canonical record (records.py), UTF-8, sort_keys, compact
    000000042.img0.jpg   the image file's original bytes (no re-encode) ...

`images` in the json lists the member names (`img0.jpg`, ...) in tag order.
summary.json holds the counts printed at the end, per-shard sample counts
(`{"shards": [{"name": "shard-000000.tar", "samples": N}, ...]}`, which the
reader uses to skip whole shards on resume and to spot truncated ones) and the
build arguments.

Design choices:
- Keys are the running index, not the record id: ids may contain dots, which
  webdataset reads as a field separator.  The id is kept in the json.
- Byte-deterministic output: a fixed member mtime/owner/mode, members in
  sorted order (webdataset's TarWriter), the json sort_keys'd, samples in input
  order even though images are checked on a thread pool (results are consumed
  in submission order from a bounded window, so memory stays flat).
- Nothing is re-encoded: an image is written exactly as read; its member
  extension is the file's own (lowercase, jpeg -> jpg; the PIL format when
  the file has none).  The reader sniffs the format from the bytes anyway.
- Images are checked before writing, cheaply: PIL identifies the header
  among the reader's allowed formats (image.allowed_formats, so nothing the
  reader would refuse is written; `not_an_image`), `verify()` checks structure (PNG chunk CRCs: `bad_image`),
  and because verify() is a no-op for JPEG, a JPEG is also decoded at 1/8
  scale (libjpeg DCT scaling, a few ms), which finds truncated files.
- Bad input is skipped and counted by reason (errors.py), never fatal: a
  malformed JSONL line (`bad_json`, with its line number), a record that does
  not normalise, a missing / empty / broken image.  Only setup errors abort,
  checked before anything is written: a missing annotation file, a .json file
  that does not start with a JSON list, a non-empty OUT without --overwrite.
  (A .json list that is broken further in is found when the file is parsed,
  which may be after earlier files were written; the build then stops with
  the parse error and no summary.json.)
- Duplicate ids are kept (ids are the dataset's business) and counted in the
  summary.
- Captions stay captions (the prompt is then a training-time setting,
  DataConfig.caption_prompt) unless --caption-prompt is given: the builder then
  bakes the prompt in and writes the sample as a chat.
- --sample interleaves the sample set's image records with its text ones
  (sample_records() lists them by kind) so its shards, split across ranks and
  workers, each carry a similar share of the images.
- A shard is written as `name.tmp` and renamed when complete, so a crashed
  build never leaves a truncated `.tar` that looks finished.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

from PIL import Image, UnidentifiedImageError
from tqdm import tqdm
from webdataset import TarWriter

from moevlm.data.errors import SkipCounter, SkipSample
from moevlm.data.image import allowed_formats
from moevlm.data.records import KINDS, Record, normalize_record, parse_json_bytes

SHARD_NAME = "shard-{:06d}.tar"
SHARD_GLOB = "shard-*.tar"
MTIME = 0  # fixed member mtime: the same input gives the same bytes
SAMPLE_SHARDS_MIN = 8  # --sample: enough shards to split across ranks x workers
DEFAULT_WORKERS = min(8, os.cpu_count() or 1)


# ---- images -------------------------------------------------------------

def check_image(path: Path) -> tuple[bytes, str]:
    """The file's bytes and its member extension; SkipSample when unusable."""
    if not path.is_file():
        raise SkipSample("missing_image", f"{path} does not exist" if not path.exists() else f"{path} is not a file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SkipSample("missing_image", f"{path} cannot be read: {e.strerror or e}") from None
    if not data:
        raise SkipSample("empty_image", f"{path} has zero bytes")
    return data, image_ext(path, verify_image(data, path))


def verify_image(data: bytes, path: Path) -> str:
    """Header + structure check (see module docstring); returns PIL's format name."""
    try:
        with Image.open(io.BytesIO(data), formats=allowed_formats()) as im:
            fmt = im.format
            im.verify()
        if fmt == "JPEG":
            _decode_small(data)
    except Image.DecompressionBombError as e:
        raise SkipSample("image_too_large", f"{path}: {e}") from None
    except UnidentifiedImageError:
        raise SkipSample("not_an_image", f"{path}: not a {'/'.join(allowed_formats())} image") from None
    except Exception as e:  # PIL reports damage with many exception types
        raise SkipSample("bad_image", f"{path}: {type(e).__name__}: {e}") from None
    return fmt


def _decode_small(data: bytes) -> None:
    with Image.open(io.BytesIO(data)) as im:
        im.draft(None, (max(1, im.width // 8), max(1, im.height // 8)))
        im.load()


def image_ext(path: Path, fmt: str | None) -> str:
    ext = path.suffix.lower().lstrip(".")
    if not re.fullmatch(r"[a-z0-9]{1,8}", ext):
        ext = (fmt or "img").lower()
    return "jpg" if ext == "jpeg" else ext


def resolve_image(p: str, image_root: Path | None) -> Path:
    path = Path(p).expanduser()
    return path if path.is_absolute() or image_root is None else image_root / path


# ---- annotations --------------------------------------------------------

def read_annotations(paths: list[Path], skips: SkipCounter) -> Iterator[tuple[str, dict]]:
    """(where, object) for every record of every file; bad JSONL lines go to `skips`."""
    for path in paths:
        if path.suffix == ".jsonl":
            yield from _read_jsonl(path, skips)
        else:
            yield from _read_json_list(path)


def check_annotation_files(paths: list[Path]) -> None:
    for path in paths:
        if path.suffix not in (".json", ".jsonl"):
            raise ValueError(f"annotation file {path} must end in .json (a JSON list) or .jsonl (one object a line)")
        if not path.is_file():
            raise FileNotFoundError(f"annotation file {path} does not exist")
        if path.suffix == ".json" and _first_char(path) != "[":
            raise ValueError(f"{path} does not start with '['; a .json annotation file must hold one JSON list "
                             "of records (use .jsonl for one object per line)")


def _first_char(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4096).decode("utf-8-sig", errors="replace").lstrip()
    return head[:1]


def _read_jsonl(path: Path, skips: SkipCounter) -> Iterator[tuple[str, dict]]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path.name}:{lineno}"
            try:
                yield where, parse_json_bytes(line)
            except SkipSample as e:
                skips.add(e, where)


def _read_json_list(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        items = json.loads(path.read_bytes().decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is not valid UTF-8 JSON ({e}); a .json annotation file must hold one JSON list "
                         "(use .jsonl for one object per line)") from None
    if not isinstance(items, list):
        raise ValueError(f"{path} holds a JSON {type(items).__name__}; a .json annotation file must hold a list "
                         "of records (use .jsonl for one object per line)")
    for i, obj in enumerate(items):
        yield f"{path.name}[{i}]", obj


# ---- writing ------------------------------------------------------------

class ShardSink:
    """Writes samples into OUT/shard-NNNNNN.tar, `per_shard` each (tmp + rename)."""

    def __init__(self, out: Path, per_shard: int):
        self.out, self.per_shard = out, per_shard
        self.shards: list[dict] = []
        self._file = self._tar = None

    def write(self, sample: dict) -> None:
        if self._tar is None or self.shards[-1]["samples"] == self.per_shard:
            self._open_next()
        self._tar.write(sample)
        self.shards[-1]["samples"] += 1

    def _open_next(self) -> None:
        self.close()
        name = SHARD_NAME.format(len(self.shards))
        self._file = open(self.out / (name + ".tmp"), "wb")
        self._tar = TarWriter(self._file, encoder=False, mtime=MTIME)
        self.shards.append({"name": name, "samples": 0})

    def close(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        self._file.close()
        name = self.shards[-1]["name"]
        os.replace(self.out / (name + ".tmp"), self.out / name)
        self._file = self._tar = None


def prepare_out(out: Path, overwrite: bool) -> None:
    """Creates OUT; refuses (or with overwrite clears) earlier shards there."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(SHARD_GLOB + ".tmp"):
        stale.unlink()
    old = sorted(out.glob(SHARD_GLOB))
    if old and not overwrite:
        raise FileExistsError(f"{out} already holds {len(old)} shard(s) ({old[0].name} ...); pass --overwrite "
                              "(overwrite=True) to replace them, or choose another --out")
    for path in old + [out / "summary.json"]:
        path.unlink(missing_ok=True)


def tar_sample(index: int, rec: Record, files: list[tuple[bytes, str]], bake_prompt: bool) -> dict:
    """The tar members of sample `index`: canonical json + original image bytes."""
    names = [f"img{k}.{ext}" for k, (_, ext) in enumerate(files)]
    if bake_prompt and rec.caption is not None:
        rec = replace(rec, caption=None)  # written as the chat that carries the prompt
    doc = json.dumps(rec.canonical(names), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    sample = {"__key__": f"{index:09d}", "json": doc.encode("utf-8")}
    sample.update((name, data) for name, (data, _) in zip(names, files))
    return sample


# ---- the build ----------------------------------------------------------

def build_shards(records: Iterable, image_root: Path | None, out: Path, samples_per_shard: int = 1000, *,
                 caption_prompt: str = "", overwrite: bool = False, skips: SkipCounter | None = None,
                 build_args: dict | None = None, workers: int = DEFAULT_WORKERS,
                 progress: bool | None = None) -> dict:
    """Writes shards from `records` and returns the summary (also OUT/summary.json).

    `records` yields annotation dicts, Records (images as paths, written as
    given), or (where, dict | Record) pairs; `where` labels skip examples and is
    the fallback id.  Relative image paths resolve against `image_root` (the
    working directory when None).  `skips` may already be shared with the
    annotation reader, which counts its bad lines there."""
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard={samples_per_shard}; it must be at least 1")
    out, skips = Path(out), skips if skips is not None else SkipCounter()
    prepare_out(out, overwrite)
    encode = _encoder(image_root, caption_prompt)
    stats = _Stats()
    sink = ShardSink(out, samples_per_shard)
    results = _ordered_map(encode, _located(records), workers)
    for where, result in tqdm(results, desc="build_shards", unit=" rec", file=sys.stderr,
                              disable=None if progress is None else not progress):
        if isinstance(result, SkipSample):
            skips.add(result, where)
            continue
        rec, files = result
        sink.write(tar_sample(stats.samples, rec, files, bool(caption_prompt)))
        stats.count(rec, files)
    sink.close()
    args = {"image_root": str(image_root) if image_root else None, "samples_per_shard": samples_per_shard,
            "caption_prompt": caption_prompt, **(build_args or {})}
    summary = stats.summary(out, sink.shards, skips, args)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    return summary


def _located(records: Iterable) -> Iterator[tuple[str, object]]:
    for i, item in enumerate(records):
        yield item if isinstance(item, tuple) else (f"record[{i}]", item)


def _encoder(image_root: Path | None, caption_prompt: str) -> Callable:
    """where, obj -> (where, (Record, [(bytes, ext)])) or (where, SkipSample); thread-safe."""
    def encode(item):
        where, obj = item
        try:
            rec = obj if isinstance(obj, Record) else normalize_record(
                obj, default_id=where, caption_prompt=caption_prompt)
            return where, (rec, [check_image(resolve_image(p, image_root)) for p in rec.images])
        except SkipSample as e:
            return where, e
    return encode


def _ordered_map(fn: Callable, items: Iterable, workers: int) -> Iterator:
    """map(fn, items) on a thread pool, in order, at most 4*workers in flight."""
    if workers <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(workers) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 4 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


class _Stats:
    """Running counts of what was written."""

    def __init__(self):
        self.samples, self.images, self.image_bytes = 0, 0, 0
        self.kinds = dict.fromkeys(KINDS, 0)
        self.seen_ids: set[str] = set()
        self.duplicates: list[str] = []

    def count(self, rec: Record, files: list[tuple[bytes, str]]) -> None:
        self.samples += 1
        self.kinds[rec.kind] += 1
        self.images += len(files)
        self.image_bytes += sum(len(data) for data, _ in files)
        if rec.id in self.seen_ids:
            self.duplicates.append(rec.id)
        self.seen_ids.add(rec.id)

    def summary(self, out: Path, shards: list[dict], skips: SkipCounter, args: dict) -> dict:
        return {
            "samples": self.samples, "kinds": self.kinds, "images": self.images,
            "image_bytes": self.image_bytes, "bytes": sum((out / s["name"]).stat().st_size for s in shards),
            "skipped": dict(sorted(skips.items())), "skipped_examples": dict(sorted(skips.examples.items())),
            "duplicate_ids": len(self.duplicates), "duplicate_id_examples": self.duplicates[:3],
            "shards": shards, "args": args,
        }


def format_summary(s: dict, out: Path) -> str:
    kinds = ", ".join(f"{k} {n}" for k, n in s["kinds"].items())
    lines = [f"wrote {s['samples']} samples ({kinds}), {s['images']} images, {s['bytes'] / 1e6:.1f} MB "
             f"in {len(s['shards'])} shard(s) to {out}"]
    skipped = sum(s["skipped"].values())
    lines.append(f"skipped {skipped} record(s)" + (":" if skipped else ""))
    for reason, n in s["skipped"].items():
        lines.append(f"  {reason}: {n}   e.g. " + " | ".join(s["skipped_examples"].get(reason, [])))
    if s["duplicate_ids"]:
        lines.append(f"duplicate ids (kept): {s['duplicate_ids']}, e.g. {s['duplicate_id_examples']}")
    return "\n".join(lines)


# ---- the sample set ------------------------------------------------------

def build_sample(out: Path, samples_per_shard: int | None = None, overwrite: bool = False,
                 workers: int = DEFAULT_WORKERS, progress: bool | None = None) -> dict:
    """Shards of moevlm.data.sample's records (>= 8 shards) plus OUT/tokenizer.json."""
    from moevlm.data.sample import sample_records, sample_tokenizer

    records, tokenizer = interleave(list(sample_records())), sample_tokenizer()
    if samples_per_shard is None:
        samples_per_shard = max(1, min(16, len(records) // SAMPLE_SHARDS_MIN))
    summary = build_shards(records, None, Path(out), samples_per_shard, overwrite=overwrite,
                           build_args={"sample": True}, workers=workers, progress=progress)
    tokenizer.save(str(Path(out) / "tokenizer.json"))
    return summary


def interleave(records: list[dict]) -> list[dict]:
    """Records with images spread evenly among those without (each group keeps
    its order), so every shard of the sample set mixes the two and no rank or
    worker gets all the images."""
    groups = [[r for r in records if r.get("images")], [r for r in records if not r.get("images")]]
    slots = [((j + 0.5) / len(g), k, j) for k, g in enumerate(groups) for j in range(len(g))]
    return [groups[k][j] for _, k, j in sorted(slots)]


# ---- command line --------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moevlm.data.build_shards", description=__doc__.split("\n")[0])
    p.add_argument("--images", type=Path, help="folder that relative image paths are resolved against")
    p.add_argument("--annotations", type=Path, nargs="+", metavar="FILE", help=".json (LLaVA list) or .jsonl files")
    p.add_argument("--out", type=Path, help="output folder for shard-NNNNNN.tar and summary.json")
    p.add_argument("--sample", type=Path, metavar="OUT", help="build the bundled sample set (and tokenizer.json)")
    p.add_argument("--samples-per-shard", type=int, default=None, help="default 1000 (--sample: 16 or fewer, "
                   f"to give >= {SAMPLE_SHARDS_MIN} shards)")
    p.add_argument("--caption-prompt", default="", help="bake this user prompt into caption samples (as chats)")
    p.add_argument("--overwrite", action="store_true", help="replace shards already in the output folder")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="threads reading and checking images")
    args = p.parse_args(argv)
    if args.sample is not None and (args.images or args.annotations or args.out or args.caption_prompt):
        p.error("--sample OUT takes no --images/--annotations/--out/--caption-prompt")
    if args.sample is None and not (args.images and args.annotations and args.out):
        p.error("give --images DIR --annotations FILE [FILE ...] --out DIR (or --sample OUT)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    try:
        if args.sample is not None:
            out, summary = args.sample, build_sample(args.sample, args.samples_per_shard, args.overwrite, args.workers)
        else:
            out, summary = args.out, _build_from_files(args)
    except (ValueError, OSError) as e:
        print(f"build_shards: error: {e}", file=sys.stderr)
        return 2
    print(format_summary(summary, out))
    if args.sample is not None:
        print(f"sample set: {summary['images']} images, {summary['kinds']['text']} text samples, "
              f"{len(summary['shards'])} shards, {summary['bytes'] / 1e6:.1f} MB, tokenizer.json")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0 if summary["samples"] else 1


def _build_from_files(args: argparse.Namespace) -> dict:
    check_annotation_files(args.annotations)
    if not args.images.is_dir():
        raise FileNotFoundError(f"--images {args.images} is not a folder")
    skips = SkipCounter()
    build_args = {"annotations": [str(a) for a in args.annotations]}
    return build_shards(read_annotations(args.annotations, skips), args.images, args.out,
                        args.samples_per_shard or 1000, caption_prompt=args.caption_prompt,
                        overwrite=args.overwrite, skips=skips, build_args=build_args, workers=args.workers)


if __name__ == "__main__":
    sys.exit(main())
