"""Which record a raw WebDataset sample holds: our own layout, or a third-party image-text one.

rec, unused = read_record(raw, fmt="auto", caption_prompt="")
rec.images    # member names of the images it trains on, in <image> tag order
unused        # image members of the sample that the record does not use

moevlm         KEY.json, a record naming its image members, as build_shards writes
image_caption  KEY.jpg|png|... + KEY.txt and/or KEY.json of metadata (img2dataset: LAION, CC3M,
               COYO; DataComp; plain image + txt): the first image with its caption
auto           per sample: moevlm when its json names images or it has no image, else image_caption
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
