"""Build WebDataset tar shards from images (and videos) and annotation files, Parquet files or Energon folders.

    python -m moevlm.data.build_shards --images DIR --annotations a.json b.jsonl --out SHARDS
        [--videos DIR] [--tokenizer tokenizer.json|HF_DIR] [--samples-per-shard auto|N]
    python -m moevlm.data.build_shards --parquet train-*.parquet --out SHARDS [--images DIR]
    python -m moevlm.data.build_shards --energon ENERGON_DIR [--split train] --out SHARDS
    python -m moevlm.data.build_shards --sample SHARDS      # the bundled sample set + tokenizer.json

Layout: OUT/shard-000000.tar, ... and OUT/summary.json (counts, samples per shard, the arguments).
Sample i (a running count) is the members 000000042.json (the canonical record: records.py, with
`images` naming its image members in tag order) and 000000042.img0.jpg, ... (the original bytes);
videos likewise (`videos`, 000000042.vid0.mp4, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

from tqdm import tqdm
from webdataset import TarWriter

from moevlm.data.build_inputs import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_TEXT_BYTES,
    DEFAULT_MAX_VIDEO_BYTES,
    check_annotation_files,
    check_image_bytes,
    check_regular_files,
    count_records,
    display_path,
    load_image,
    load_video,
    read_annotations,
    text_bytes,
)
from moevlm.data.build_sources import EnergonSource, Inline
from moevlm.data.build_summary import BuildStats, format_summary
from moevlm.data.errors import SkipCounter, SkipSample
from moevlm.data.hf_datasets import add_builder_arguments, builder_records
from moevlm.data.records import Record, normalize_record

SHARD_NAME = "shard-{:06d}.tar"
SHARD_GLOB = "shard-*.tar"
MTIME = 0  # fixed member mtime: the same input gives the same bytes
SAMPLE_SHARDS_MIN = 8  # --sample: enough shards to split across ranks x workers
AUTO_SHARDS = (
    64  # --samples-per-shard auto: up to this many shards (the largest recipes' data.streams)
)
MAX_SAMPLES_PER_SHARD = 1000  # ... and never more samples than this in one
DEFAULT_WORKERS = min(8, os.cpu_count() or 1)


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

    def discard(self) -> None:
        """Drops the shard being written (the build is stopping); finished shards stay."""
        if self._file is not None:
            # flushes the tar stream, so nothing writes to it later
            with contextlib.suppress(Exception):
                self._tar.close()
            self._file.close()
            (self.out / (self.shards.pop()["name"] + ".tmp")).unlink(missing_ok=True)
        self._file = self._tar = None


def prepare_out(out: Path, overwrite: bool) -> None:
    """Creates OUT; refuses (or with overwrite clears) earlier shards there."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(SHARD_GLOB + ".tmp"):
        stale.unlink()
    old = sorted(out.glob(SHARD_GLOB))
    if old and not overwrite:
        raise FileExistsError(
            f"{out} already holds {len(old)} shard(s) ({old[0].name} ...); pass --overwrite "
            "(overwrite=True) to replace them, or choose another --out"
        )
    for path in old + [out / "summary.json"]:
        path.unlink(missing_ok=True)


def tar_sample(
    index: int, rec: Record, files: list[tuple[bytes, str]], bake_prompt: bool, videos=()
) -> dict:
    """The tar members of sample `index`: canonical json + original image and video bytes."""
    names = [f"img{k}.{ext}" for k, (_, ext) in enumerate(files)]
    vnames = [f"vid{k}.{ext}" for k, (_, ext) in enumerate(videos)]
    if bake_prompt and rec.caption is not None:
        rec = replace(rec, caption=None)  # written as the chat that carries the prompt
    doc = json.dumps(
        rec.canonical(names, vnames), sort_keys=True, ensure_ascii=False, separators=(",", ":")
    )
    sample = {"__key__": f"{index:09d}", "json": doc.encode("utf-8")}
    sample.update((name, data) for name, (data, _) in zip(names + vnames, [*files, *videos]))
    return sample


# ---- the build ----------------------------------------------------------


def build_shards(
    records: Iterable,
    image_root: Path,
    out: Path,
    samples_per_shard: int = 1000,
    *,
    caption_prompt: str = "",
    overwrite: bool = False,
    skips: SkipCounter | None = None,
    build_args: dict | None = None,
    workers: int = DEFAULT_WORKERS,
    progress: bool | None = None,
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES,
    total: int | None = None,
    video_root: Path | None = None,
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES,
) -> dict:
    """Writes shards from `records` and returns the summary (also OUT/summary.json).

    `records` yields annotation dicts, Records (images as paths), or (where,
    dict | Record) pairs; `where` labels skip examples and is the fallback id.
    Image paths are relative to `image_root` and must stay inside it
    (`outside_images` otherwise); video paths likewise relative to `video_root`
    (default `image_root`).  `skips` may already be shared with the
    annotation reader, which counts its bad lines there."""
    if samples_per_shard < 1 or max_image_bytes < 1 or max_text_bytes < 1:
        raise ValueError(
            f"samples_per_shard={samples_per_shard}, max_image_bytes={max_image_bytes}, "
            f"max_text_bytes={max_text_bytes}; each must be at least 1"
        )
    root = None if image_root is None else _real_root(image_root)
    vroot = root if video_root is None else _real_root(video_root)
    out, skips = Path(out), skips if skips is not None else SkipCounter()
    prepare_out(out, overwrite)
    encode = _encoder(root, caption_prompt, max_image_bytes, max_text_bytes)
    encode_videos = _video_encoder(encode, vroot, max_video_bytes)
    stats = BuildStats()
    sink = ShardSink(out, samples_per_shard)
    try:
        results = _ordered_map(encode_videos, _located(records), workers)
        for where, result in show_progress(results, total, progress):
            if isinstance(result, SkipSample):
                skips.add(result, where)
                continue
            rec, files, videos = result
            sink.write(tar_sample(stats.samples, rec, files, bool(caption_prompt), videos))
            stats.count(rec, files, videos)
        sink.close()
    except BaseException:
        sink.discard()  # no .tmp is left behind, whatever stopped the build
        raise
    args = {
        "image_root": str(image_root),
        "samples_per_shard": samples_per_shard,
        "caption_prompt": caption_prompt,
        "max_image_bytes": max_image_bytes,
        "max_text_bytes": max_text_bytes,
        **({"video_root": str(vroot), "max_video_bytes": max_video_bytes} if stats.videos else {}),
        **(build_args or {}),
    }
    summary = stats.summary(out, sink.shards, skips, args)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    return summary


PROGRESS_EVERY_S = 30.0  # a progress line this often when stderr is not a terminal


def show_progress(items: Iterable, total: int | None, progress: bool | None) -> Iterator:
    """`items`, reporting on stderr: a tqdm bar (with ETA when `total` is known) on a terminal or when
    `progress` is True; without a terminal (a log file, a batch job) a plain line every
    PROGRESS_EVERY_S seconds; nothing when `progress` is False."""
    if progress is False:
        yield from items
        return
    if progress or sys.stderr.isatty():
        yield from tqdm(items, total=total, desc="build_shards", unit=" rec", file=sys.stderr)
        return
    t0 = last = time.monotonic()
    n = 0
    for n, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S:
            last = now
            print(
                f"build_shards: {_progress_line(n, total, now - t0)}", file=sys.stderr, flush=True
            )


def _progress_line(n: int, total: int | None, elapsed: float) -> str:
    rate = n / max(elapsed, 1e-9)
    if not total:
        return f"{n} records in {elapsed:.0f} s ({rate:.1f}/s)"
    left = max(total - n, 0) / max(rate, 1e-9)
    return (
        f"{n}/{total} records ({100 * n / total:.0f}%) in {elapsed:.0f} s, {rate:.1f}/s, "
        f"ETA {left:.0f} s"
    )


def _located(records: Iterable) -> Iterator[tuple[str, object]]:
    for i, item in enumerate(records):
        yield item if isinstance(item, tuple) else (f"record[{i}]", item)


def _real_root(image_root: Path) -> Path:
    root = Path(os.path.realpath(image_root))
    if not root.is_dir():
        raise FileNotFoundError(f"--images {image_root} is not a folder")
    return root


def _encoder(
    root: Path | None, caption_prompt: str, max_image_bytes: int, max_text_bytes: int
) -> Callable:
    """where, obj -> (where, (Record, [(bytes, ext)])) or (where, SkipSample); thread-safe."""

    def image(p: str, k: int, rid: str, blobs: dict) -> tuple[bytes, str]:
        if p in blobs:
            return check_image_bytes(blobs[p], max_image_bytes, f"image #{k} of record {rid!r}")
        if root is None:
            raise SkipSample(
                "missing_image", f"image #{k} of record {rid!r} is a path: give --images DIR"
            )
        return load_image(p, root, max_image_bytes, f"image path #{k} of record {rid!r}")

    def encode(item):
        where, obj = item
        blobs = obj.blobs if isinstance(obj, Inline) else {}
        obj = obj.obj if isinstance(obj, Inline) else obj
        try:
            rec = (
                obj
                if isinstance(obj, Record)
                else normalize_record(obj, default_id=where, caption_prompt=caption_prompt)
            )
            if (n := text_bytes(rec)) > max_text_bytes:
                raise SkipSample(
                    "text_too_large", f"{n} bytes of text, above --max-text-bytes {max_text_bytes}"
                )
            rid = display_path(rec.id, 40)
            return where, (rec, [image(p, k, rid, blobs) for k, p in enumerate(rec.images)])
        except SkipSample as e:
            return where, e
        except Exception as e:  # one odd record never stops the build
            return where, SkipSample(
                "bad_record", f"{type(e).__name__} while checking it: {str(e)[:120]}"
            )

    return encode


def _video_encoder(encode: Callable, root: Path | None, max_bytes: int) -> Callable:
    """encode, with the record's videos loaded and checked (build_inputs.load_video) after its images."""

    def video(p: str, k: int, rid: str) -> tuple[bytes, str]:
        if root is None:
            raise SkipSample("missing_video", f"video #{k} of record {rid!r}: give --videos DIR")
        return load_video(p, root, max_bytes, f"video path #{k} of record {rid!r}")

    def encode_videos(item):
        where, result = encode(item)
        if isinstance(result, SkipSample):
            return where, result
        rec, rid = result[0], display_path(result[0].id, 40)
        try:
            return where, (*result, [video(p, k, rid) for k, p in enumerate(rec.videos)])
        except SkipSample as e:
            return where, e
        except Exception as e:  # one odd file never stops the build
            return where, SkipSample("bad_video", f"{type(e).__name__}: {str(e)[:120]}")

    return encode_videos


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


# ---- the sample set ------------------------------------------------------


def build_sample(
    out: Path,
    samples_per_shard: int | None = None,
    overwrite: bool = False,
    workers: int = DEFAULT_WORKERS,
    progress: bool | None = None,
    images_only: bool = False,
) -> dict:
    """Shards of moevlm.data.sample's records (>= 8 shards) plus OUT/tokenizer.json.  `images_only`:
    only the records that carry photos (captions, chats and pairs; no text-only documents), one per
    shard by default so the set still feeds every data stream: image-text data, where the vision
    tower's work per row depends on the photos' resolutions alone (bench/vision_balance.py)."""
    sample_set = importlib.import_module("moevlm.data.sample")  # (a stand-in in tests)

    records = list(sample_set.sample_records())
    if images_only:
        records = [r for r in records if r.get("images") and not r.get("videos")]
    root, records = relative_to_common_root(interleave(records))
    tokenizer = sample_set.sample_tokenizer()
    if samples_per_shard is None:
        samples_per_shard = 1 if images_only else max(1, min(16, len(records) // SAMPLE_SHARDS_MIN))
    with tempfile.TemporaryDirectory() as clips:  # the clips' files, written from the photographs
        if any(r.get("videos") for r in records):
            sample_set.write_sample_clips(Path(clips))
        summary = build_shards(
            records,
            root,
            Path(out),
            samples_per_shard,
            overwrite=overwrite,
            build_args={"sample": True, "images_only": images_only},
            workers=workers,
            progress=progress,
            video_root=Path(clips),
        )
    tokenizer.save(str(Path(out) / "tokenizer.json"))
    return summary


def relative_to_common_root(records: list[dict]) -> tuple[Path, list[dict]]:
    """(root, records with `images` relative to it): the sample set's records name
    absolute files inside installed packages; their deepest common folder is the
    image root the builder confines them to."""
    real = {p: os.path.realpath(p) for r in records for p in r.get("images") or []}
    if not real:
        return Path.cwd(), records
    root = os.path.commonpath(list(real.values()))
    root = root if os.path.isdir(root) else os.path.dirname(root)
    return Path(root), [
        {**r, "images": [os.path.relpath(real[p], root) for p in r["images"]]}
        if r.get("images")
        else r
        for r in records
    ]


def interleave(records: list[dict]) -> list[dict]:
    """Records with images spread evenly among those without (each group keeps
    its order), so every shard of the sample set mixes the two and no rank or
    worker gets all the images."""
    groups = [[r for r in records if r.get("images")], [r for r in records if not r.get("images")]]
    slots = [((j + 0.5) / len(g), k, j) for k, g in enumerate(groups) for j in range(len(g))]
    return [groups[k][j] for _, k, j in sorted(slots)]


# ---- command line --------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m moevlm.data.build_shards", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--images", type=Path, help="folder that relative image paths are resolved against"
    )
    p.add_argument(
        "--videos",
        type=Path,
        help="folder that relative video paths are resolved against (default --images)",
    )
    p.add_argument(
        "--annotations",
        type=Path,
        nargs="+",
        metavar="FILE",
        help=".json (LLaVA list) or .jsonl files",
    )
    p.add_argument(
        "--parquet",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="Parquet files or folders of them (Hugging Face datasets style: an image column of bytes or "
        "paths, and messages/conversations/caption/text); needs pyarrow (the parquet extra)",
    )
    add_builder_arguments(p)
    p.add_argument(
        "--energon",
        type=Path,
        metavar="DIR",
        help="a Megatron-Energon WebDataset folder (.nv-meta/dataset.yaml with a field_map, split.yaml)",
    )
    p.add_argument("--split", help="--energon, --dataset, --parquet DIR: the split (default train)")
    p.add_argument("--out", type=Path, help="output folder for shard-NNNNNN.tar and summary.json")
    p.add_argument(
        "--sample",
        type=Path,
        metavar="OUT",
        help="build the bundled sample set (and tokenizer.json)",
    )
    p.add_argument(
        "--images-only",
        action="store_true",
        help="--sample: only its records with photos (image-text data, one sample per shard)",
    )
    p.add_argument(
        "--samples-per-shard",
        type=_per_shard,
        default=None,
        metavar="auto|N",
        help=f"default auto: min({MAX_SAMPLES_PER_SHARD}, records / {AUTO_SHARDS}), so small sets still "
        f"give several shards (--sample: 16 or fewer, to give >= {SAMPLE_SHARDS_MIN} shards)",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        metavar="FILE|DIR",
        help="copy this tokenizer.json (or DIR/tokenizer.json, "
        "e.g. the HF checkpoint's) beside the shards, where training finds it",
    )
    p.add_argument(
        "--caption-prompt", default="", help="bake this user prompt into caption samples (as chats)"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace shards already in the output folder"
    )
    p.add_argument(
        "--workers", type=int, default=DEFAULT_WORKERS, help="threads reading and checking images"
    )
    p.add_argument(
        "--max-image-bytes",
        type=int,
        default=DEFAULT_MAX_IMAGE_BYTES,
        metavar="N",
        help="skip image files larger than this (file_too_large), checked before reading; "
        "default 32 MiB, as the loader's data.max_image_bytes",
    )
    p.add_argument(
        "--max-text-bytes",
        type=int,
        default=DEFAULT_MAX_TEXT_BYTES,
        metavar="N",
        help="skip records with more UTF-8 text than this (text_too_large); default 1 MiB",
    )
    p.add_argument(
        "--max-video-bytes",
        type=int,
        default=DEFAULT_MAX_VIDEO_BYTES,
        metavar="N",
        help="skip video files larger than this (file_too_large), checked before reading; default 256 MiB",
    )
    args = p.parse_args(argv)
    inputs = [a for a in ("annotations", "parquet", "energon", "dataset") if getattr(args, a)]
    if args.sample is not None and (
        args.images or inputs or args.out or args.caption_prompt or args.tokenizer
    ):
        p.error(
            "--sample OUT takes no --images/--annotations/--parquet/--energon/--out/--caption-prompt/"
            "--tokenizer (it trains its own)"
        )
    if args.images_only and args.sample is None:
        p.error("--images-only goes with --sample OUT")
    if args.sample is None and (len(inputs) != 1 or not args.out):
        p.error(
            "give one input and --out DIR: --images DIR --annotations FILE [FILE ...], --parquet FILE "
            "[FILE ...] or --energon DIR (or --sample OUT)"
        )
    if args.images_root_only and not args.images:
        p.error("--images-root-only needs --images DIR (the folder absolute paths must lie in)")
    if args.annotations and not (args.images or args.videos):
        p.error(
            "--annotations needs --images DIR (the folder image paths are resolved in) or --videos DIR"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    try:
        if args.sample is not None:
            per_shard = None if args.samples_per_shard == "auto" else args.samples_per_shard
            out, summary = (
                args.sample,
                build_sample(
                    args.sample,
                    per_shard,
                    args.overwrite,
                    args.workers,
                    images_only=args.images_only,
                ),
            )
        else:
            tokenizer = _checked_tokenizer(args.tokenizer)
            out, summary = args.out, _build_from_files(args)
            _place_tokenizer(tokenizer, out)
    except (ValueError, OSError) as e:
        print(f"build_shards: error: {e}", file=sys.stderr)
        return 2
    print(format_summary(summary, out))
    if args.sample is not None:
        print(
            f"sample set: {summary['images']} images, {summary['kinds']['text']} text samples, "
            f"{len(summary['shards'])} shards, {summary['bytes'] / 1e6:.1f} MB, tokenizer.json"
        )
    elif not (out / "tokenizer.json").is_file():
        print(
            f"no tokenizer.json in {out}: train with data.tokenizer=FILE or model.hf_checkpoint=DIR, or rebuild "
            "with --tokenizer FILE"
        )
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0 if summary["samples"] else 1


def _build_from_files(args: argparse.Namespace) -> dict:
    for name, folder in (("--images", args.images), ("--videos", args.videos)):
        if folder is not None and not folder.is_dir():
            raise FileNotFoundError(f"{name} {folder} is not a folder")
    skips = SkipCounter()
    check_regular_files(args.parquet or [], "--parquet input", folders=True)
    if args.annotations:
        check_annotation_files(args.annotations)
        build_args = {"annotations": [str(a) for a in args.annotations]}
        total = count_records(args.annotations)
        records = read_annotations(args.annotations, skips, args.max_text_bytes)
    elif args.parquet or args.dataset:
        build_args, total, records = builder_records(args, skips)
    else:
        source = EnergonSource(args.energon, args.split or "train")
        build_args = {"energon": str(args.energon), "split": args.split or "train"}
        total = source.total
        records = source.records(skips)
    per_shard = args.samples_per_shard or "auto"
    if per_shard == "auto":
        per_shard = auto_samples_per_shard(total) if total else MAX_SAMPLES_PER_SHARD
    return build_shards(
        records,
        args.images,
        args.out,
        per_shard,
        caption_prompt=args.caption_prompt,
        overwrite=args.overwrite,
        skips=skips,
        build_args=build_args,
        workers=args.workers,
        max_image_bytes=args.max_image_bytes,
        max_text_bytes=args.max_text_bytes,
        total=total,
        video_root=args.videos,
        max_video_bytes=args.max_video_bytes,
    )


def auto_samples_per_shard(records: int) -> int:
    """Samples per shard for about `records` records: up to AUTO_SHARDS shards, at most MAX_SAMPLES_PER_SHARD each."""
    return max(1, min(MAX_SAMPLES_PER_SHARD, -(-records // AUTO_SHARDS)))


def _per_shard(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither 'auto' nor a positive number of samples"
        )
    return n


def _checked_tokenizer(path: Path | None) -> Path | None:
    """--tokenizer's file (a folder: its tokenizer.json), loaded once to check it before the build."""
    if path is None:
        return None
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"--tokenizer {path}: no such file"
            + (" (the folder has no tokenizer.json)" if path.is_dir() else "")
        )
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises its own Exception type
        raise ValueError(
            f"--tokenizer {file} is not a tokenizer.json the tokenizers library loads "
            f"({str(e)[:120]})"
        ) from None
    return file


def _place_tokenizer(file: Path | None, out: Path) -> None:
    if file is not None and os.path.realpath(file) != os.path.realpath(out / "tokenizer.json"):
        shutil.copyfile(file, out / "tokenizer.json")


if __name__ == "__main__":
    sys.exit(main())
