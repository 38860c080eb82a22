"""Which record a raw WebDataset sample holds: our own layout, or a third-party image-text one.

    rec, unused = read_record(raw, fmt="auto", caption_prompt="")
    rec.images    # member names of the images it trains on, in <image> tag order
    unused        # image members of the sample that the record does not use

Layouts (data.format):

    moevlm         KEY.json = a record naming its image members ("images": ["img0.jpg"]), as
                   build_shards writes; a record without images is a text sample
    image_caption  KEY.jpg|jpeg|png|webp (...) + KEY.txt and/or KEY.json of metadata: img2dataset's
                   layout (LAION, CC3M, CC12M, COYO: json with caption, url, width, ...), DataComp's
                   (json with text, uid, ...) and plain image + txt
    auto           per sample: moevlm when its json names images (`images` or `image`) or the sample
                   has no image member, else image_caption

Design choices:
- image_caption trains the first image member (name order) with the caption from `txt`, else the
  json's `caption`, else its `text`; a json with none of those but `messages` or `conversations`
  is a chat about that image (LLaVA's rule puts the <image> tag in front when it has none); a
  sample with neither json nor txt is `bad_json`, one with no caption `bad_record`.  The
  json is otherwise metadata: url, width, similarity scores are never read as text.  The id is
  the sample key (img2dataset's json `key` holds the same value).
- Image members are recognized by webdataset's image extensions (last dot-part, any case).  A
  sample may carry members its record does not use (a second image, or with data.format=moevlm a
  metadata json that names none): they are returned as `unused`, which the loader counts
  (`images_unused`, errors.FALLBACKS), so a shard of images never trains as text without a
  number saying so; when no image of a stream's samples can be used the loader stops
  (loader.Stream).
- auto never guesses between two readings of one sample: a json naming images is ours (the
  builder writes no unnamed image), a sample without images can only be text, and a json that
  names no image beside an image member cannot be our record (we never write one).
"""

from __future__ import annotations

from moevlm.data.errors import SkipSample
from moevlm.data.records import Record, normalize_record, parse_json_bytes

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm")
CAPTION_KEYS = ("caption", "text")  # json keys a third-party caption may use, in this order
CHAT_KEYS = ("messages", "conversations")


def image_members(raw: dict) -> list[str]:
    """The sample's image member names (by extension), sorted."""
    return sorted(
        k for k in raw if not k.startswith("__") and k.rsplit(".", 1)[-1].lower() in IMAGE_EXTS
    )


def read_record(raw: dict, fmt: str = "auto", caption_prompt: str = "") -> tuple[Record, list[str]]:
    """(record, image members it does not use); SkipSample when the sample is unusable."""
    key = raw.get("__key__", "?")
    images = image_members(raw)
    meta = parse_json_bytes(raw["json"]) if "json" in raw else None
    if fmt == "auto":
        names_images = meta is not None and ("images" in meta or "image" in meta)
        fmt = "moevlm" if names_images or not images else "image_caption"
    if meta is None and "txt" not in raw:
        raise SkipSample("bad_json", f"sample {key} has no json (or txt) member: {sorted(raw)}")
    if fmt == "moevlm" and meta is not None:
        rec = normalize_record(meta, default_id=key, caption_prompt=caption_prompt)
    else:
        rec = _image_caption(raw, meta, images, key, caption_prompt)
    used = set(rec.images)
    return rec, [n for n in images if n not in used]


def _image_caption(raw: dict, meta: dict | None, images: list[str], key: str, prompt: str):
    if not images:
        raise SkipSample(
            "missing_image",
            f"sample {key} has a caption but no image member ({'/'.join(IMAGE_EXTS[:4])}, ...): "
            f"{sorted(raw)}",
        )
    obj = {"id": key, "images": images[:1]}
    caption = _utf8(raw["txt"]) if "txt" in raw else None
    found = [k for k in CAPTION_KEYS + CHAT_KEYS if meta is not None and k in meta]
    if caption is not None:
        obj["caption"] = caption
    elif found:
        obj[found[0]] = meta[found[0]]
    else:
        keys = sorted(meta)[:8] if meta is not None else []
        raise SkipSample(
            "bad_record",
            f"sample {key}: no caption: no txt member and its json has none of "
            f"{list(CAPTION_KEYS + CHAT_KEYS)} (keys {keys})",
        )
    return normalize_record(obj, default_id=key, caption_prompt=prompt)


def _utf8(b: bytes) -> str:
    try:
        return bytes(b).decode("utf-8-sig")
    except UnicodeDecodeError as exn:
        raise SkipSample("bad_text_encoding", f"txt member: {exn}") from None
