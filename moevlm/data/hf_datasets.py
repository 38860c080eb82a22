"""What Hugging Face `datasets` saves, read as it is: Parquet files and folders of them (`to_parquet`, a
hub download), `save_to_disk` folders (Arrow) and `DatasetDict` folders (one split read), with
`Image` / `Sequence(Image)` columns of bytes or of paths, relative or absolute.  Read with pyarrow
alone (no `datasets` import).  Each yields (where, Inline) records for build_shards.

    src = open_dataset(Path("ds"), split=None)        # DatasetSource, or ValueError / FileNotFoundError
    for where, item in src.records(skips, PathPolicy(base, root_only, max_bytes)): ...

Paths: relative ones resolve in `base` (--images, else the dataset's folder) and stay inside it;
absolute ones are read where they point, or only inside `base` with `root_only`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from moevlm.data.build_inputs import (
    DEFAULT_MAX_IMAGE_BYTES,
    display_path,
    read_capped,
    resolve_image,
)
from moevlm.data.build_sources import (
    Inline,
    _columns,
    _parquet_row,
    _pyarrow_parquet,
    check_parquet,
    parquet_records,
)
from moevlm.data.errors import SkipCounter, SkipSample

DEFAULT_SPLIT = "train"
ROWS_PER_BATCH = 16


@dataclass(frozen=True)
class PathPolicy:
    """Where image paths in the rows are read: relative ones inside `base`; absolute ones anywhere
    they resolve to a file, or only inside `base` when `root_only`."""

    base: Path
    root_only: bool = False
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES

    def read(self, p: str, label: str) -> bytes:
        root = Path(os.path.realpath(self.base))
        if os.path.isabs(p) and not self.root_only:
            path = Path(os.path.realpath(p))
        else:
            if os.path.isabs(p):
                rel = os.path.relpath(os.path.realpath(p), root)
                if rel.startswith(".."):
                    raise SkipSample("outside_images", f"{label} lies outside {root} (root only)")
                p = rel
            try:
                path = resolve_image(p, root)
            except SkipSample as e:
                raise SkipSample(e.reason, f"{label} {e.detail}") from None
        return read_capped(path, self.max_bytes, f"{label} ({display_path(p)})")


@dataclass
class DatasetSource:
    """One `datasets` output: `kind` parquet or arrow, the files read (in order), the split read."""

    path: Path
    kind: str
    files: list[Path]
    split: str | None
    total: int

    @property
    def folder(self) -> Path:
        """The folder relative image paths resolve in when no --images is given."""
        return self.path if self.path.is_dir() else self.path.parent

    def describe(self) -> str:
        what = "Parquet" if self.kind == "parquet" else "save_to_disk (Arrow)"
        split = f", split {self.split!r}" if self.split else ""
        return f"{self.path} ({what}{split}, {len(self.files)} file(s), {self.total} rows)"

    def records(self, skips: SkipCounter, paths: PathPolicy | None = None) -> Iterator:
        """(where, Inline) for every row, every image as bytes; bad rows are counted in `skips`."""
        paths = paths or PathPolicy(self.folder)
        rows = parquet_records(self.files, skips) if self.kind == "parquet" else self._arrow(skips)
        for where, item in rows:
            try:
                yield where, _with_bytes(item, paths)
            except SkipSample as e:
                skips.add(e, where)

    def _arrow(self, skips: SkipCounter) -> Iterator[tuple[str, Inline]]:
        for file in self.files:
            name = file.name
            try:
                batches, names = _batches(file, self.kind)
                columns = _columns(names, file)
            except Exception as e:  # checked by open_dataset; changed or gone since
                detail = f"{type(e).__name__}: {str(e)[:120]}"
                skips.add(SkipSample("unreadable_input", detail), name)
                continue
            wanted = [c for c in (*columns, "id") if c is not None and c in names]
            yield from _arrow_rows(batches, wanted, columns, name, skips)


def _arrow_rows(batches, wanted, columns, name: str, skips: SkipCounter):
    i = 0
    try:
        for batch in batches:
            batch = batch.select(wanted)
            for start in range(0, batch.num_rows, ROWS_PER_BATCH):
                for row in batch.slice(start, ROWS_PER_BATCH).to_pylist():
                    where, i = f"{name}:{i}", i + 1
                    try:
                        yield where, _parquet_row(row, *columns, where)
                    except SkipSample as e:
                        skips.add(e, where)
    except Exception as e:  # a damaged file: the rows read before it are kept
        detail = f"{type(e).__name__}: {str(e)[:120]}; {i} rows read"
        skips.add(SkipSample("unreadable_input", detail), name)


def _with_bytes(item: Inline, paths: PathPolicy) -> Inline:
    """`item` with every image path read into `item.blobs` (the builder then needs no --images)."""
    names = item.obj.get("images") or []
    for k, p in enumerate(names):
        if p not in item.blobs:
            name = f"<row image {k}>"
            item.blobs[name] = paths.read(p, f"image path #{k}")
            names[k] = name
    return item


def _batches(file: Path, kind: str):
    """(record batches, column names) of one Parquet or Arrow file."""
    if kind == "parquet":
        f = _pyarrow_parquet().ParquetFile(file)
        return f.iter_batches(batch_size=256), f.schema_arrow.names
    import pyarrow as pa

    source = pa.memory_map(str(file))
    try:
        reader = pa.ipc.open_stream(source)  # what save_to_disk writes
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
        return (reader.get_batch(k) for k in range(reader.num_record_batches)), reader.schema.names
    return reader, reader.schema.names


# ---- finding what a path holds ---------------------------------------------


def is_dataset(path) -> bool:
    """True when `path` is a `datasets` output (not a folder of .tar shards)."""
    try:
        return _kind(Path(path)) is not None
    except (OSError, TypeError, ValueError):
        return False


def _kind(p: Path) -> str | None:
    if p.is_file():
        return {".parquet": "parquet", ".arrow": "arrow"}.get(p.suffix)
    if not p.is_dir():
        return None
    if (p / "dataset_dict.json").is_file():
        return "dict"
    if (p / "state.json").is_file() and any(p.glob("*.arrow")):
        return "arrow"
    if any(p.glob("*.tar")):
        return None
    return "parquet" if next(p.rglob("*.parquet"), None) is not None else None


def open_dataset(path: Path, split: str | None = None) -> DatasetSource:
    """The `datasets` output at `path`, checked (every file readable, a text column); `split` picks
    a DatasetDict's split or a Parquet folder's (files named or foldered by split), default train."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_file() and path.suffix not in (".parquet", ".arrow"):
        return _opened(path, "parquet", [path], None)  # a Parquet file by another name
    kind = _kind(path)
    if kind is None:
        raise ValueError(
            f"{path} is not a datasets output: expected a .parquet or .arrow file, a folder of .parquet "
            "files, a save_to_disk folder (state.json) or a DatasetDict folder (dataset_dict.json)"
        )
    if kind == "dict":
        chosen = _dict_split(path, split)
        return _opened(path, "arrow", _arrow_files(path / chosen), chosen)
    if kind == "arrow":
        files = _arrow_files(path) if path.is_dir() else [path]
        return _opened(path, "arrow", files, None)
    if path.is_file():
        return _opened(path, "parquet", [path], None)
    files, chosen = _parquet_split(path, split)
    return _opened(path, "parquet", files, chosen)


def _opened(path: Path, kind: str, files: list[Path], split: str | None) -> DatasetSource:
    if kind == "parquet":
        return DatasetSource(path, kind, files, split, check_parquet(files))
    total = 0
    for file in files:
        try:
            batches, names = _batches(file, kind)
            total += sum(b.num_rows for b in batches)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError and others
            raise ValueError(f"{file} is not a readable Arrow file ({str(e)[:120]})") from None
        _columns(names, file)  # no text column: ValueError
    return DatasetSource(path, kind, files, split, total)


def _dict_split(path: Path, split: str | None) -> str:
    try:
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}/dataset_dict.json cannot be read ({e})") from None
    if split is None:
        split = (
            DEFAULT_SPLIT if DEFAULT_SPLIT in splits else (splits[0] if len(splits) == 1 else None)
        )
    if split not in splits:
        raise ValueError(
            f"{path} is a DatasetDict with splits {splits}: choose one (build_shards --split NAME, "
            "data.split=NAME)"
        )
    return split


def _arrow_files(folder: Path) -> list[Path]:
    try:
        state = json.loads((folder / "state.json").read_text())
        files = [folder / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        files = sorted(folder.glob("*.arrow"))
    missing = [f.name for f in files if not f.is_file()]
    if missing or not files:
        raise FileNotFoundError(f"{folder}: the Arrow files {missing or '*.arrow'} are missing")
    return files


def _parquet_split(folder: Path, split: str | None) -> tuple[list[Path], str | None]:
    """A folder's .parquet files (recursive, sorted); where some are named or foldered by split
    (`train-00000-of-00002.parquet`, `train/0000.parquet`), only `split`'s (default train)."""
    files = sorted(folder.rglob("*.parquet"))
    chosen = split or DEFAULT_SPLIT

    def of(f: Path) -> bool:
        rel = f.relative_to(folder)
        return chosen in rel.parts[:-1] or f.name.startswith((f"{chosen}-", f"{chosen}."))

    mine = [f for f in files if of(f)]
    if mine:
        return mine, chosen
    if split is not None:
        raise ValueError(
            f"{folder} has no Parquet file of split {split!r} (named {split}-*.parquet or in {split}/)"
        )
    return files, None


# ---- the shard builder's --dataset / --parquet ---------------------------------


def add_builder_arguments(p) -> None:
    """build_shards' options for `datasets` outputs (beside its --parquet, --images and --split)."""
    p.add_argument(
        "--dataset",
        type=Path,
        metavar="PATH",
        help="what Hugging Face datasets saves: a save_to_disk or DatasetDict folder, Parquet file(s)",
    )
    p.add_argument(
        "--images-root-only",
        action="store_true",
        help="--parquet/--dataset: absolute image paths must lie inside --images (default: read "
        "where they point)",
    )


def builder_records(args, skips: SkipCounter) -> tuple[dict, int, Iterator]:
    """(build args, rows, records) of build_shards' --dataset or --parquet (files or folders)."""
    sources = [open_dataset(p, args.split) for p in args.parquet or [args.dataset]]
    build_args = {"parquet" if args.parquet else "dataset": [str(s.path) for s in sources]}
    records = (
        r
        for s in sources
        for r in s.records(
            skips, PathPolicy(args.images or s.folder, args.images_root_only, args.max_image_bytes)
        )
    )
    return build_args, sum(s.total for s in sources), records
