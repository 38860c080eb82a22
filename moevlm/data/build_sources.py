"""Other distribution formats as builder input: Parquet files (Hugging Face datasets style) and
Megatron-Energon WebDataset folders.  Each yields (where, Inline) records for build_shards.

    total = check_parquet(paths)                      # setup errors before anything is written
    for where, item in parquet_records(paths, skips): ...
    src = EnergonSource(Path("energon_dir"), split="train")   # reads .nv-meta/*.yaml
    for where, item in src.records(skips): ...

Parquet: one row per sample, the image from the first of IMAGE_COLUMNS, the text from the first of
TEXT_COLUMNS.  Energon: .nv-meta/dataset.yaml (sample type, field_map), split.yaml (shards per
split), .info.json (counts); sample types ENERGON_TYPES.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from moevlm.data.errors import SkipCounter, SkipSample
from moevlm.data.reader import Oversize, ShardPlan

IMAGE_COLUMNS = ("image", "images", "img", "jpg", "png", "webp")
TEXT_COLUMNS = ("messages", "conversations", "caption", "text")
ENERGON_TYPES = ("CaptioningSample", "VQASample", "OCRSample", "TextSample")


@dataclass
class Inline:
    """An annotation object whose `images` may name in-memory images: `blobs` maps such a name to
    its bytes (the others are paths inside --images)."""

    obj: dict
    blobs: dict[str, bytes] = field(default_factory=dict)


# ---- Parquet --------------------------------------------------------------


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            "reading Parquet needs pyarrow: pip install 'moevlm[parquet]' (or pip install pyarrow)"
        ) from None
    return pq


def check_parquet(paths: list[Path]) -> int:
    """The total rows of the Parquet files; ValueError / FileNotFoundError for a setup problem."""
    pq, total = _pyarrow_parquet(), 0
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"Parquet file {path} does not exist")
        try:
            f = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises ArrowInvalid and others
            raise ValueError(f"{path} is not a readable Parquet file ({str(e)[:120]})") from None
        _columns(f.schema_arrow.names, path)
        total += f.metadata.num_rows
    return total


def _columns(names: list[str], path: Path) -> tuple[str | None, str]:
    image = next((c for c in IMAGE_COLUMNS if c in names), None)
    text = next((c for c in TEXT_COLUMNS if c in names), None)
    if text is None:
        raise ValueError(
            f"{path} has no text column: looked for {list(TEXT_COLUMNS)} among {names[:12]}"
        )
    return image, text


def parquet_records(paths: list[Path], skips: SkipCounter) -> Iterator[tuple[str, Inline]]:
    """(where, Inline) for every row; bad rows and broken row groups are counted in `skips`."""
    pq = _pyarrow_parquet()
    for path in paths:
        try:
            f = pq.ParquetFile(path)
            image, text = _columns(f.schema_arrow.names, path)
        except Exception as e:  # checked by check_parquet; changed or gone since
            skips.add(
                SkipSample("unreadable_input", f"{type(e).__name__}: {str(e)[:120]}"), path.name
            )
            continue
        wanted = [c for c in (image, text, "id") if c in f.schema_arrow.names]
        first = 0
        for group in range(f.num_row_groups):
            yield from _row_group(f, group, first, wanted, (image, text), path.name, skips)
            first += f.metadata.row_group(group).num_rows


def _row_group(f, group: int, first: int, wanted, columns, name: str, skips: SkipCounter):
    """The rows of one row group (numbered from `first` in the file); a group that breaks while
    being read is `unreadable_input`, the rows read before it kept and the next group read."""
    i = first
    try:
        for batch in f.iter_batches(batch_size=16, row_groups=[group], columns=wanted):
            for row in batch.to_pylist():
                where, i = f"{name}:{i}", i + 1
                try:
                    yield where, _parquet_row(row, *columns, where)
                except SkipSample as e:
                    skips.add(e, where)
    except Exception as e:  # pyarrow's errors for damaged pages vary (OSError, ArrowInvalid)
        detail = (
            f"row group {group}: {type(e).__name__}: {str(e)[:120]}; {i - first} of its rows read"
        )
        skips.add(SkipSample("unreadable_input", detail), name)


def _parquet_row(row: dict, image: str | None, text: str, where: str) -> Inline:
    item = Inline({"id": row["id"] if isinstance(row.get("id"), (str, int)) else where})
    values = row.get(image) if image else None
    values = [] if values is None else values if isinstance(values, list) else [values]
    names = [_image_value(v, k, item) for k, v in enumerate(values)]
    if names:
        item.obj["images"] = names
    value = row.get(text)
    if text in ("messages", "conversations") and isinstance(value, list):
        value = [_flatten_turn(t) for t in value]
    item.obj[text] = value
    return item


def _image_value(v, k: int, item: Inline) -> str:
    """A name for image value `v`: its bytes are kept in `item.blobs`, a path is returned as is."""
    if isinstance(v, dict):
        v = v.get("bytes") if v.get("bytes") is not None else v.get("path")
    if isinstance(v, (bytes, bytearray, memoryview)):
        name = f"<row image {k}>"
        item.blobs[name] = bytes(v)
        return name
    if isinstance(v, str) and v:
        return v
    raise SkipSample("missing_image", f"image {k} is neither bytes nor a path ({type(v).__name__})")


def _flatten_turn(turn):
    """A turn whose content is a list of HF chat parts -> the same turn with one string."""
    if not isinstance(turn, dict) or not isinstance(turn.get("content"), list):
        return turn
    parts = []
    for p in turn["content"]:
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "image":
            parts.append("<image>")
        elif kind == "text" and isinstance(p.get("text"), str):
            parts.append(p["text"])
        else:
            raise SkipSample("bad_record", f"a content part {str(p)[:60]} is not image or text")
    return {**turn, "content": "\n".join(parts)}


# ---- Energon --------------------------------------------------------------

_FIELD = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]+\])*)$")


class EnergonSource:
    """An Energon-prepared WebDataset folder, read without megatron-energon."""

    def __init__(self, root: Path, split: str = "train"):
        import yaml

        self.root, self.split = Path(root), split
        meta = self.root / ".nv-meta"
        self.type, self.fields = _sample_type(_load(meta, "dataset.yaml", None, yaml), meta)
        splits = _load(meta, "split.yaml", "split.json", yaml)
        self.shards, self.excluded = _split_shards(splits, split, meta)
        missing = [n for n in self.shards if not (self.root / n).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{self.root}: split {split!r} names missing shards {missing[:3]}"
            )
        info = _load(meta, ".info.json", ".info.yaml", yaml, required=False)
        counts = info.get("shard_counts") or {}
        self.total = sum(int(counts.get(n, 0)) for n in self.shards) or None

    def records(self, skips: SkipCounter) -> Iterator[tuple[str, Inline]]:
        for name in self.shards:
            url = str(self.root / name)
            plan = ShardPlan([url], shuffle=False, max_file_bytes=1 << 40)
            for k, raw in enumerate(plan.read_shard(url, skips)):
                where = f"{name}:{raw.get('__key__', k)}"
                if f"{name}/{raw.get('__key__')}" in self.excluded:
                    continue
                try:
                    yield where, self._sample(raw, where)
                except SkipSample as e:
                    skips.add(e, where)
                except (KeyError, IndexError, ValueError, TypeError) as e:
                    detail = f"{type(e).__name__} reading its fields: {str(e)[:100]}"
                    skips.add(SkipSample("bad_record", detail), where)

    def _sample(self, raw: dict, where: str) -> Inline:
        get = {name: self._field(raw, name, spec) for name, spec in self.fields.items()}
        item = Inline({"id": raw.get("__key__", where)})
        if self.type == "TextSample":
            item.obj["text"] = get.get("text")
            return item
        image = get.get("image")
        if not isinstance(image, bytes):
            raise SkipSample(
                "missing_image", f"field 'image' ({self.fields.get('image')}) holds no file"
            )
        item.blobs["<image>"], item.obj["images"] = image, ["<image>"]
        if self.type == "VQASample":
            item.obj["messages"] = [
                {"role": "user", "content": _tagged(_str(get.get("context"), "context"))},
                {
                    "role": "assistant",
                    "content": _answer(get.get("answers"), get.get("answer_weights")),
                },
            ]
        else:
            key = "caption" if self.type == "CaptioningSample" else "text"
            item.obj["caption"] = _str(get.get(key), key)
        return item

    @staticmethod
    def _field(raw: dict, name: str, spec: str):
        for option in str(spec).split(","):
            m = _FIELD.match(option.strip())
            if not m or m.group(1) not in raw:
                continue
            value = raw[m.group(1)]
            if isinstance(value, Oversize):
                raise SkipSample(value.reason, f"member {value.name} has {value.size} bytes")
            keys = re.findall(r"\[([^\[\]]+)\]", m.group(2))
            if keys:
                value = json.loads(bytes(value).decode("utf-8"))
                for key in keys:
                    value = value[int(key)] if isinstance(value, list) else value[key]
            elif m.group(1) in ("txt", "text", "caption"):
                value = bytes(value).decode("utf-8")
            elif m.group(1) == "json":
                value = json.loads(bytes(value).decode("utf-8"))
            return value
        if name in ("answers", "answer_weights"):
            return None
        raise SkipSample("bad_record", f"field {name!r} ({spec}) is not in the sample")


def _sample_type(ds: dict, meta: Path) -> tuple[str, dict]:
    """(sample type, field_map) of dataset.yaml: `sample_type.__class__`, or the older top-level
    `__class__: XWebdataset` read as XSample."""
    where = meta / "dataset.yaml"
    if "sample_loader" in ds:
        raise ValueError(
            f"{where} uses a custom sample_loader (Python code); only a field_map can be read "
            "without running it: give the dataset a field_map"
        )
    cls = (ds.get("sample_type") or {}).get("__class__") or ds.get("__class__", "")
    kind = re.sub(r"Webdataset$", "Sample", str(cls))
    if kind not in ENERGON_TYPES:
        raise ValueError(
            f"{where}: sample type {cls!r} is not read; supported: {list(ENERGON_TYPES)}"
        )
    fields = ds.get("field_map")
    if not isinstance(fields, dict) or not fields:
        raise ValueError(f"{where} has no field_map")
    return kind, fields


def _split_shards(splits: dict, split: str, meta: Path) -> tuple[list[str], set[str]]:
    """The split's shard names (brace patterns expanded, excluded shards left out) and the
    excluded samples (`shard/key`)."""
    import braceexpand

    parts = (splits.get("split_parts") or {}).get(split)
    if not parts:
        have = sorted(splits.get("split_parts") or {})
        raise ValueError(f"{meta}/split.yaml has no split {split!r}; it has {have}")
    excluded = {e for x in splits.get("exclude") or [] for e in braceexpand.braceexpand(x)}
    shards = [n for p in parts for n in braceexpand.braceexpand(p) if n not in excluded]
    return shards, {e for e in excluded if "/" in e}


def _load(meta: Path, name: str, alt: str | None, yaml, required: bool = True) -> dict:
    for n in (name, alt):
        if n and (meta / n).is_file():
            try:
                obj = yaml.safe_load((meta / n).read_text())
            except yaml.YAMLError as e:
                raise ValueError(f"{meta / n} is not valid YAML/JSON ({str(e)[:120]})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{meta / n} does not hold a mapping")
            return obj
    if required:
        raise FileNotFoundError(
            f"{meta / name} does not exist: --energon takes a folder prepared by `energon prepare`"
        )
    return {}


def _str(value, what: str) -> str:
    if not isinstance(value, str):
        raise SkipSample("bad_record", f"{what} is {type(value).__name__}, not a string")
    return value


def _tagged(context: str) -> str:
    """The VQA question with the image tag in front, unless it places the tag itself."""
    return context if "<image>" in context else "<image>\n" + context


def _answer(answers, weights) -> str:
    if isinstance(answers, str):
        return answers
    if not isinstance(answers, list) or not answers:
        raise SkipSample("bad_record", "a VQA sample without answers")
    if isinstance(weights, list) and len(weights) == len(answers):
        return _str(answers[max(range(len(answers)), key=lambda i: weights[i])], "answer")
    return _str(answers[0], "answer")
