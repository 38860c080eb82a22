"""The untrusted inputs of a shard build: annotation files and the image and video files they name.

    for where, obj in read_annotations(paths, skips, max_text_bytes): ...
    n = count_records(paths)              # an upper bound, for the automatic shard size
    data, fmt = load_image(path_as_written, images_root, max_image_bytes)   # or SkipSample
    data, ext = load_video(path_as_written, videos_root, max_video_bytes)   # or SkipSample

Image paths stay inside --images, byte caps are checked before anything is read, images are
identified among image.allowed_formats and verified; bad input is skipped and counted by reason
(errors.py), only setup errors abort.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from PIL import Image, UnidentifiedImageError

from moevlm.data.errors import SkipCounter, SkipSample
from moevlm.data.image import allowed_formats, check_image_shape
from moevlm.data.records import Record, parse_json_bytes

if TYPE_CHECKING:
    from moevlm.data.video_decode import VideoDecodeConfig

DEFAULT_MAX_IMAGE_BYTES = 32 << 20  # the loader's data.max_image_bytes default
DEFAULT_MAX_VIDEO_BYTES = 256 << 20
VIDEO_EXTS = ("mp4", "m4v", "mov", "mkv", "webm")
DEFAULT_MAX_TEXT_BYTES = 1 << 20
# JSONL line cap = 6 x max_text_bytes (JSON escapes) + this, for keys, id, paths
LINE_SLACK = 64 << 10


# ---- images -------------------------------------------------------------


def resolve_image(p: str, root: Path) -> Path:
    """The real path of image `p`, as a record writes it, inside `root` (a real
    path); SkipSample when it is not a path or leads outside `root`."""
    if not isinstance(p, str):
        raise SkipSample("bad_record", f"is a {type(p).__name__}, not a string")
    if "\0" in p:
        raise SkipSample("bad_record", "holds a NUL character")
    if p.startswith("~"):
        raise SkipSample("outside_images", "starts with '~'; image paths are relative to --images")
    if os.path.isabs(p):
        raise SkipSample("outside_images", "is absolute; image paths are relative to --images")
    real = Path(os.path.realpath(root / p))  # every symlink on the way, and '..', resolved
    if not real.is_relative_to(root):
        raise SkipSample("outside_images", "leaves --images (through '..' or a symlink)")
    return real


def load_image(p: str, root: Path, max_bytes: int, label: str = "image path") -> tuple[bytes, str]:
    """The bytes and member extension of image `p` (resolve_image); SkipSample when unusable.
    Details start with `label`; a path is shown (as written) only once it is known to be inside `root`."""
    try:
        path = resolve_image(p, root)
    except SkipSample as e:
        raise SkipSample(e.reason, f"{label} {e.detail}") from None
    shown = f"{label} ({display_path(p)})"
    data = read_capped(path, max_bytes, shown)
    if not data:
        raise SkipSample("empty_image", f"{shown} has zero bytes")
    return data, image_ext(path, verify_image(data, shown))


def check_image_bytes(data: bytes, max_bytes: int, shown: str) -> tuple[bytes, str]:
    """In-memory image bytes (a Parquet cell, an Energon member) checked as load_image checks a file."""
    if not data:
        raise SkipSample("empty_image", f"{shown} has zero bytes")
    if len(data) > max_bytes:
        raise SkipSample(
            "file_too_large", f"{shown} has {len(data)} bytes, above --max-image-bytes {max_bytes}"
        )
    return data, image_ext(Path(""), verify_image(data, shown))


def read_capped(path: Path, max_bytes: int, shown: str, kind: str = "image") -> bytes:
    """A regular file's bytes, refused (file_too_large) from its size before any is read; `kind`
    ("image" or "video") names the missing_<kind> reason and the --max-<kind>-bytes option."""
    try:
        # before opening: no FIFO or device is ever opened
        _check_size(os.stat(path), max_bytes, shown, kind)
        fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    except FileNotFoundError:
        raise SkipSample(f"missing_{kind}", f"{shown} does not exist") from None
    except OSError as e:
        raise SkipSample(
            f"missing_{kind}", f"{shown} cannot be read: {e.strerror or type(e).__name__}"
        ) from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        _check_size(os.fstat(fd), max_bytes, shown, kind)  # the file opened is the file checked
        data = _read_at_most(f, max_bytes + 1)
    if len(data) > max_bytes:  # it grew after the check
        raise SkipSample("file_too_large", f"{shown} is larger than --max-{kind}-bytes {max_bytes}")
    return data


_OPEN_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def _check_size(st: os.stat_result, max_bytes: int, shown: str, kind: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise SkipSample(f"missing_{kind}", f"{shown} is not a file")
    if st.st_size > max_bytes:
        raise SkipSample(
            "file_too_large",
            f"{shown} has {st.st_size} bytes, above --max-{kind}-bytes {max_bytes}",
        )


def load_video(
    p: str,
    root: Path,
    max_bytes: int,
    label: str = "video path",
    cfg: VideoDecodeConfig | None = None,
) -> tuple[bytes, str]:
    """The bytes and member extension of video `p` inside `root` (as load_image), checked as the
    loader would use it: its header's guards (video_decode.probe_video), not cut short, and its
    first frame decoding; SkipSample with the video reasons otherwise."""
    try:
        path = resolve_image(p, root)
    except SkipSample as e:
        raise SkipSample(e.reason, f"{label} {e.detail.replace('--images', '--videos')}") from None
    from moevlm.data.video_decode import VideoDecodeConfig, cut_short, decode_frames  # PyAV: ~0.1 s

    shown = f"{label} ({display_path(p)})"
    data = read_capped(path, max_bytes, shown, "video")
    try:
        if cut_short(data):
            raise SkipSample("video_truncated", "the file ends before its container says")
        _, info = decode_frames(data, [0], cfg or VideoDecodeConfig())
    except SkipSample as e:
        raise SkipSample(e.reason, f"{shown}: {e.detail}") from None
    ext = path.suffix.lower().lstrip(".")
    return data, ext if ext in VIDEO_EXTS else {"matroska": "mkv"}.get(info.container, "mp4")


def _read_at_most(f, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def display_path(p: str, limit: int = 80) -> str:
    """A path as the record writes it, cut for the logs (only paths inside the root are shown)."""
    return p if len(p) <= limit else p[:limit] + "..."


def verify_image(data: bytes, shown: str) -> str:
    """Header + structure check (see module docstring), and the loader's shape rule (an image it would
    always skip: bad_image_size); returns PIL's format name."""
    try:
        with Image.open(io.BytesIO(data), formats=allowed_formats()) as im:
            fmt, size = im.format, im.size
            im.verify()
        if fmt == "JPEG":
            _decode_small(data)
    except Image.DecompressionBombError as e:
        raise SkipSample("image_too_large", f"{shown}: {e}") from None
    except UnidentifiedImageError:
        raise SkipSample(
            "not_an_image", f"{shown}: not a {'/'.join(allowed_formats())} image"
        ) from None
    except Exception as e:  # PIL reports damage with many exception types
        raise SkipSample("bad_image", f"{shown}: {type(e).__name__}: {e}") from None
    check_image_shape(*size, shown)
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


def text_bytes(rec: Record) -> int:
    """UTF-8 bytes of the sample's text (the text, or every message's content)."""
    texts = [rec.text] if rec.text is not None else [m["content"] for m in rec.messages]
    return sum(len(t.encode("utf-8")) for t in texts)


# ---- annotations --------------------------------------------------------


def read_annotations(
    paths: list[Path], skips: SkipCounter, max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES
) -> Iterator[tuple[str, dict]]:
    """(where, object) for every record of every file; bad JSONL lines go to `skips`.
    A JSONL line is read up to 6 x max_text_bytes + LINE_SLACK bytes, never whole."""
    for path in paths:
        if path.suffix == ".jsonl":
            yield from _read_jsonl(path, skips, 6 * max_text_bytes + LINE_SLACK)
        else:
            yield from _read_json_list(path)


def count_records(paths: list[Path]) -> int:
    """At least the number of records in the annotation files (blank and bad JSONL lines count too): the
    newlines of a .jsonl (a byte scan in 1 MiB pieces, nothing parsed), the length of a .json list (parsed
    once more here; one that does not parse counts 0, the build then reports it)."""
    n = 0
    for path in paths:
        if path.suffix == ".jsonl":
            with open(path, "rb") as f:
                last = b"\n"
                while piece := f.read(1 << 20):
                    n, last = n + piece.count(b"\n"), piece
                n += not last.endswith(b"\n")
        else:
            try:
                items = json.loads(path.read_bytes().decode("utf-8-sig"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                continue
            n += len(items) if isinstance(items, list) else 0
    return n


_KINDS = {
    stat.S_ISFIFO: "a FIFO (named pipe)",
    stat.S_ISSOCK: "a socket",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISDIR: "a folder",
}


def check_regular_files(paths: list[Path], what: str, folders: bool = False) -> None:
    """A ValueError naming what an input that exists but is not a regular file is (a FIFO would block
    the build, a folder would read as nothing unless `folders`: a folder of Parquet files); checked
    without opening it."""
    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue  # missing: the readers' own message
        if not stat.S_ISREG(mode) and not (folders and stat.S_ISDIR(mode)):
            kind = next((k for test, k in _KINDS.items() if test(mode)), "not a regular file")
            raise ValueError(f"{what} {path} is {kind}, not a regular file: give a file")


def check_annotation_files(paths: list[Path]) -> None:
    check_regular_files(paths, "annotation file")
    for path in paths:
        if path.suffix not in (".json", ".jsonl"):
            raise ValueError(
                f"annotation file {path} must end in .json (a JSON list) or .jsonl (one object a line)"
            )
        if not path.is_file():
            raise FileNotFoundError(f"annotation file {path} does not exist")
        if path.suffix == ".json" and _first_char(path) != "[":
            raise ValueError(
                f"{path} does not start with '['; a .json annotation file must hold one JSON list "
                "of records (use .jsonl for one object per line)"
            )


def _first_char(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4096).decode("utf-8-sig", errors="replace").lstrip()
    return head[:1]


def _read_jsonl(path: Path, skips: SkipCounter, max_line: int) -> Iterator[tuple[str, dict]]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(_bounded_lines(f, max_line), 1):
            where = f"{path.name}:{lineno}"
            if line is None:
                skips.add(
                    SkipSample(
                        "text_too_large",
                        f"the line is longer than {max_line} bytes "
                        "(6 x --max-text-bytes + 64 KiB); not parsed",
                    ),
                    where,
                )
            elif line.strip():
                try:
                    yield where, parse_json_bytes(line)
                except SkipSample as e:
                    skips.add(e, where)


def _bounded_lines(f, max_line: int) -> Iterator[bytes | None]:
    """The lines of binary file `f`; None for a line over `max_line` bytes, which
    is skipped through in 1 MiB pieces and never held."""
    while line := f.readline(max_line + 1):
        if len(line) <= max_line or line.endswith(b"\n"):
            yield line
            continue
        while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
            pass
        yield None


def _read_json_list(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        items = json.loads(path.read_bytes().decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(
            f"{path} is not valid UTF-8 JSON ({e}); a .json annotation file must hold one JSON list "
            "(use .jsonl for one object per line)"
        ) from None
    except RecursionError:
        raise ValueError(
            f"{path} nests JSON arrays/objects deeper than the parser allows; a .json file is one "
            "document, so the build stops: remove that record, or convert the file to .jsonl "
            "(one object per line), where such a line is skipped as bad_json"
        ) from None
    if not isinstance(items, list):
        raise ValueError(
            f"{path} holds a JSON {type(items).__name__}; a .json annotation file must hold a list "
            "of records (use .jsonl for one object per line)"
        )
    for i, obj in enumerate(items):
        yield f"{path.name}[{i}]", obj
