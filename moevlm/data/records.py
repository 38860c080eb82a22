"""One annotation normalizer for the shard builder (build time) and the shard reader (read time).

    rec = normalize_record(parse_json_bytes(raw), default_id=key, caption_prompt="")
    rec.messages  # [{"role": "user", "content": "<image>\\nWhat is this?"}, ...]

Canonical forms (build_shards' json member; `images` names the sample's image members in <image> tag
order, `videos` (only when it has some) its video members in <video> tag order):
    chat:    {"id": str, "images": ["img0.jpg", ...], "videos": ["vid0.mp4"], "messages": [...]}
    caption: {"id": str, "images": ["img0.jpg"], "caption": str}
    text:    {"id": str, "text": str}
Accepted inputs, the first key found deciding: `messages`, `conversations` (LLaVA / ShareGPT),
`caption`, `text`; images from `images` or `image`, videos from `videos` or `video`, never both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from moevlm.data.errors import SkipSample

IMAGE_TAG = "<image>"
VIDEO_TAG = "<video>"
ROLES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "system": "system",
}
KINDS = ("chat", "caption", "text")


@dataclass
class Record:
    """A normalized sample.  `images` and `videos` are paths (builder input) or tar field
    names (reader), in the order of the `<image>` and `<video>` tags."""

    id: str
    images: list[str]
    messages: list[dict] | None  # chat and caption records
    text: str | None  # text records
    caption: str | None = None  # caption records (also rendered into `messages`)
    videos: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        if self.text is not None:
            return "text"
        return "caption" if self.caption is not None else "chat"

    def canonical(self, images: list[str] | None = None, videos: list[str] | None = None) -> dict:
        """The canonical JSON object, naming `images` and `videos` (default: self's)."""
        images = list(self.images if images is None else images)
        videos = list(self.videos if videos is None else videos)
        if self.kind == "text":
            return {"id": self.id, "text": self.text}
        media = {"images": images, **({"videos": videos} if videos else {})}
        if self.kind == "caption":
            return {"id": self.id, **media, "caption": self.caption}
        return {"id": self.id, **media, "messages": self.messages}


def parse_json_bytes(b: bytes) -> dict:
    """UTF-8 JSON object bytes -> dict (a leading BOM is allowed)."""
    try:
        s = bytes(b).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SkipSample("bad_text_encoding", f"not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        obj = json.loads(s)
    except (ValueError, RecursionError) as e:
        raise SkipSample("bad_json", f"invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise SkipSample("bad_json", f"expected a JSON object, got {type(obj).__name__}")
    return obj


def normalize_record(obj, *, default_id: str | None = None, caption_prompt: str = "") -> Record:
    """Any accepted annotation form -> Record; raises SkipSample when unusable."""
    if not isinstance(obj, dict):
        raise SkipSample("bad_record", f"expected a JSON object, got {type(obj).__name__}")
    rid, images, videos = _record_id(obj, default_id), _paths(obj, "image"), _paths(obj, "video")
    if "messages" in obj or "conversations" in obj:
        key = "messages" if "messages" in obj else "conversations"
        rec = Record(rid, images, _messages(obj[key], key), None, videos=videos)
    elif "caption" in obj or ("text" in obj and (images or videos)):
        key = "caption" if "caption" in obj else "text"
        rec = _caption_record(rid, images, videos, _text(obj[key], key), caption_prompt)
    elif "text" in obj:
        rec = Record(rid, [], None, _text(obj["text"], "text"))
    else:
        raise SkipSample(
            "bad_record",
            f"none of messages/conversations/caption/text among keys {sorted(obj)[:8]}",
        )
    _match_tags(rec)
    return rec


def _record_id(obj: dict, default_id: str | None) -> str:
    rid = obj.get("id")
    if rid is None:
        if default_id is None:
            raise SkipSample("bad_record", "record has no id and the caller gave no default_id")
        return default_id
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise SkipSample("bad_record", f"id must be a string or an int, got {type(rid).__name__}")
    return _text(str(rid), "id")


def _paths(obj: dict, kind: str) -> list[str]:
    """The record's `kind` ("image" or "video") paths, from `<kind>s` or `<kind>`."""
    if kind in obj and kind + "s" in obj:
        raise SkipSample("bad_record", f"record has both {kind!r} and {kind + 's'!r}; keep one")
    key = kind + "s" if kind + "s" in obj else kind
    value = obj.get(key)
    if value is None:
        return []
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise SkipSample(
            "bad_record", f"{key!r} must be a non-empty string or a list of them, got {value!r:.80}"
        )
    return [_text(p, key) for p in paths]


def _text(value, what: str) -> str:
    if not isinstance(value, str):
        raise SkipSample("bad_record", f"{what} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise SkipSample(
            "bad_text_encoding", f"{what} holds a lone surrogate (not encodable as UTF-8)"
        ) from None
    return value


def _messages(turns, key: str) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise SkipSample("bad_record", f"{key!r} must be a non-empty list, got {turns!r:.80}")
    return [_message(turn, f"{key}[{i}]") for i, turn in enumerate(turns)]


def _message(turn, where: str) -> dict:
    if not isinstance(turn, dict):
        raise SkipSample("bad_record", f"{where} must be an object, got {type(turn).__name__}")
    role = turn.get("role", turn.get("from"))
    if not isinstance(role, str) or role not in ROLES:
        raise SkipSample(
            "bad_record", f"{where} has role {role!r}; expected one of {sorted(ROLES)}"
        )
    content = turn.get("content", turn.get("value"))
    return {"role": ROLES[role], "content": _text(content, f"{where} content")}


def _caption_record(
    rid: str, images: list[str], videos: list[str], caption: str, caption_prompt: str
) -> Record:
    if not images and not videos:
        raise SkipSample("bad_record", "a caption record needs an image or a video")
    user = IMAGE_TAG * len(images) + VIDEO_TAG * len(videos)
    user += "\n" + caption_prompt if caption_prompt else ""
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": caption}]
    return Record(rid, images, messages, None, caption, videos)


def _match_tags(rec: Record) -> None:
    """Checks <image> tags against images and <video> tags against videos, applying LLaVA's
    prepend-when-untagged rule to each, and LLaVA-Video's: a record with videos, no images and no
    <video> tag writes its videos' places as <image> (turned into <video> here)."""
    texts = [rec.text] if rec.text is not None else [m["content"] for m in rec.messages]
    if rec.videos and not rec.images and rec.messages is not None:
        if not any(VIDEO_TAG in t for t in texts) and any(IMAGE_TAG in t for t in texts):
            for m in rec.messages:
                m["content"] = m["content"].replace(IMAGE_TAG, VIDEO_TAG)
    _match(rec, IMAGE_TAG, len(rec.images), "image_tag_mismatch", "image")
    _match(rec, VIDEO_TAG, len(rec.videos), "video_tag_mismatch", "video")


def _match(rec: Record, tag: str, n: int, reason: str, what: str) -> None:
    texts = [rec.text] if rec.text is not None else [m["content"] for m in rec.messages]
    n_tags = sum(t.count(tag) for t in texts)
    if n_tags == n:
        return
    if n_tags == 0 and rec.messages is not None:
        first_user = next((m for m in rec.messages if m["role"] == "user"), None)
        if first_user is None:
            raise SkipSample(
                "bad_record", f"{n} {what}(s) but no user turn to put the {tag} tags in"
            )
        first_user["content"] = (tag + "\n") * n + first_user["content"]
        return
    raise SkipSample(reason, f"{n_tags} {tag} tag(s) in the text, {n} {what}(s)")
