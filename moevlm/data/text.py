"""Tokenizer, Qwen3-VL chat template and loss mask.

Legend: L tokens of one sample; `input_ids_L` and `labels_L` are plain lists of ints (the packer
turns them into tensors).

    enc = ChatEncoder(load_tokenizer("shards/tokenizer.json"))
    enc.check_model(cfg)                          # before any weight exists
    input_ids_L, labels_L = enc.encode_chat(messages, image_tokens=[64, 16])
    input_ids_L, labels_L = enc.encode_chat(messages, videos=[VideoSpan((0.5, 1.5), 64)])
    input_ids_L, labels_L = enc.encode_text("a plain document")

A <video> tag becomes, per temporal patch, its `<t seconds>` text and a vision span of that many
<|video_pad|> tokens (Qwen3VLProcessor's text).  Labels are the token where trained (the assistant's content and its <|im_end|>), IGNORE_INDEX (-100)
elsewhere; the model shifts.  `train_bpe` makes the tiny preset's byte-level BPE.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from moevlm.data.errors import SkipSample

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen3-VL's tokenizer.json (Qwen/Qwen3-VL-* on the hub).
QWEN_SPECIAL_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}
# The tiny preset (vocab 1024): regular tokens 0..1013, specials 1014..1021.
TINY_SPECIAL_IDS = {
    "<|endoftext|>": 1014,
    "<|im_start|>": 1015,
    "<|im_end|>": 1016,
    "<|vision_pad|>": 1017,
    "<|vision_start|>": 1018,
    "<|vision_end|>": 1019,
    "<|image_pad|>": 1020,
    "<|video_pad|>": 1021,
}

IGNORE_INDEX = -100
IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
ROLES = ("system", "user", "assistant")
_TAGS = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")
# model config field -> the token whose id it must equal
_MODEL_TOKEN_FIELDS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
_BYTE_ALPHABET = 256


def model_mismatches(special_ids: dict[str, int], vocab_size: int, cfg) -> dict[str, tuple]:
    """Model config field -> (what the tokenizer needs, what `cfg` has) for each vision token id that
    differs and for `text.vocab_size` when smaller than the tokenizer's ids; empty when they fit."""
    out = {
        name: (special_ids[token], getattr(cfg, name))
        for name, token in _MODEL_TOKEN_FIELDS.items()
        if special_ids[token] != getattr(cfg, name)
    }
    if vocab_size > cfg.text.vocab_size:
        out["text.vocab_size"] = (vocab_size, cfg.text.vocab_size)
    return out


# ------------------------------------------------------------------ tokenizer
def _first_special_id(special_ids: dict[str, int]) -> int:
    """The smallest special id, after checking the ids are one contiguous block."""
    if not special_ids:
        raise ValueError("special_ids is empty; pass e.g. moevlm.data.text.TINY_SPECIAL_IDS")
    ids = sorted(special_ids.values())
    first = ids[0]
    if ids != list(range(first, first + len(ids))):
        raise ValueError(
            f"special token ids must be one contiguous block (they go right after the learned "
            f"vocabulary), got {dict(sorted(special_ids.items(), key=lambda kv: kv[1]))}"
        )
    if first <= _BYTE_ALPHABET:
        raise ValueError(
            f"the smallest special id is {first}, but the byte-level vocabulary needs at least "
            f"{_BYTE_ALPHABET + 1} regular tokens before it; move the special ids up"
        )
    return first


def _empty_byte_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterable[str], special_ids: dict[str, int]) -> Tokenizer:
    """A byte-level BPE learned from `texts`: regular ids 0..min(special_ids)-1,
    then the special tokens at exactly their ids.  Same texts, same
    `to_str()` byte for byte."""
    first = _first_special_id(special_ids)
    tok = _empty_byte_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=first,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != first:
        raise ValueError(
            f"the texts yielded only {tok.get_vocab_size()} BPE tokens but the special tokens start "
            f"at id {first}; train on more text or move the special ids down"
        )
    in_id_order = sorted(special_ids, key=special_ids.get)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in in_id_order])
    placed = {s: tok.token_to_id(s) for s in in_id_order}
    if placed != {s: special_ids[s] for s in in_id_order}:
        raise ValueError(
            f"special tokens landed at {placed}, expected {special_ids} (a special string is "
            f"probably also a learned token)"
        )
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer.json, with a readable error when it is missing."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no tokenizer file at {path}; use the checkpoint's tokenizer.json, or write the sample one with "
            f"`python -m moevlm.data.build_shards --sample DIR` (it creates DIR/tokenizer.json)"
        )
    return Tokenizer.from_file(str(path))


# --------------------------------------------------------------- chat encoder
@dataclass(frozen=True)
class VideoSpan:
    """What one <video> tag expands to: each temporal patch's time in seconds
    (moevlm.data.video.frame_timestamps) and its tokens (grid h * w / merge**2)."""

    seconds: tuple[float, ...]
    frame_tokens: int

    def __post_init__(self):
        if not self.seconds or self.frame_tokens < 1:
            raise ValueError(
                f"a video needs at least one temporal patch and one token per patch, got "
                f"{len(self.seconds)} timestamps and frame_tokens={self.frame_tokens}"
            )

    @property
    def tokens(self) -> int:
        """<|video_pad|> tokens of the whole video (its merged patches)."""
        return len(self.seconds) * self.frame_tokens


def timestamp_text(seconds: float) -> str:
    """A temporal patch's time as Qwen3VLProcessor writes it before the patch's vision span."""
    return f"<{seconds:.1f} seconds>"


def _check_messages(messages) -> None:
    """Raise SkipSample("bad_record") unless `messages` is a list of
    {"role": one of ROLES, "content": str}, a system message only first."""
    if not isinstance(messages, list):
        raise SkipSample("bad_record", f"messages is a {type(messages).__name__}, expected a list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise SkipSample(
                "bad_record", f"message {i} is a {type(msg).__name__}, expected a dict"
            )
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise SkipSample(
                "bad_record", f"message {i} has role {role!r}; expected one of {ROLES}"
            )
        if not isinstance(content, str):
            raise SkipSample(
                "bad_record",
                f"message {i} ({role}) has content of type {type(content).__name__}, expected str",
            )
        if role == "system" and i > 0:
            raise SkipSample(
                "bad_record",
                f"message {i} is a system message; Qwen3-VL's template renders "
                f"one only as the first message",
            )


def _plain_text_copy(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of `tokenizer` that reads special-token strings in text as plain bytes."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.encode_special_tokens = True
    return copy


class ChatEncoder:
    """Turns chats and plain documents into (input_ids, labels) lists."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        ids = {s: tokenizer.token_to_id(s) for s in SPECIAL_TOKENS}
        missing = [s for s, i in ids.items() if i is None]
        if missing:
            raise ValueError(
                f"the tokenizer has no {', '.join(missing)} token(s); use a Qwen3-VL tokenizer.json "
                f"or one made by moevlm.data.text.train_bpe(texts, TINY_SPECIAL_IDS)"
            )
        self.special_ids: dict[str, int] = ids
        self.eot_id, self.im_start_id, self.im_end_id = (
            ids["<|endoftext|>"],
            ids["<|im_start|>"],
            ids["<|im_end|>"],
        )
        self.vision_start_id, self.vision_end_id = ids["<|vision_start|>"], ids["<|vision_end|>"]
        self.image_pad_id, self.video_pad_id = ids["<|image_pad|>"], ids["<|video_pad|>"]
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self._text_tok = _plain_text_copy(tokenizer)
        self._newline = self._text("\n")
        self._headers = {role: [self.im_start_id] + self._text(f"{role}\n") for role in ROLES}

    def __getstate__(self) -> dict:
        # `encode_special_tokens` is not part of a tokenizer's serialized form, so
        # the copy is rebuilt after pickling (DataLoader workers) rather than sent.
        return {k: v for k, v in self.__dict__.items() if k != "_text_tok"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._text_tok = _plain_text_copy(self.tokenizer)

    def check_model(self, cfg) -> None:
        """Raise ValueError unless this tokenizer's vision ids and size fit `cfg` (a VLMConfig)."""
        problems = []
        for name, (tok_id, cfg_id) in model_mismatches(
            self.special_ids, self.vocab_size, cfg
        ).items():
            if name == "text.vocab_size":
                problems.append(
                    f"the tokenizer has {tok_id} ids but the model config has text.vocab_size = "
                    f"{cfg_id}; raise text.vocab_size to at least {tok_id} (or use a smaller tokenizer)"
                )
            else:
                problems.append(
                    f"the tokenizer has {_MODEL_TOKEN_FIELDS[name]} = {tok_id} but the model config has "
                    f"{name} = {cfg_id}; set {name}={tok_id} in the model config (or use the model's own "
                    "tokenizer)"
                )
        if problems:
            raise ValueError("tokenizer and model do not match:\n  " + "\n  ".join(problems))

    def _text(self, text: str) -> list[int]:
        return self._text_tok.encode(text, add_special_tokens=False).ids if text else []

    def _content(
        self, content: str, images: Iterator[int], videos: Iterator[VideoSpan], trained: bool
    ) -> tuple[list[int], list[int]]:
        """Ids and labels of one message's content, each <image> and <video> expanded to its spans.
        A video's first timestamp is tokenized with the text before it (one piece, as the reference's
        tokenizer sees it between special tokens)."""
        ids: list[int] = []
        labels: list[int] = []
        text = ""
        for piece in _TAGS.split(content):
            if piece == IMAGE_PLACEHOLDER:
                self._add_text(ids, labels, text, "", trained)
                self._add_span(ids, labels, self.image_pad_id, next(images))
            elif piece == VIDEO_PLACEHOLDER:
                video = next(videos)
                for seconds in video.seconds:
                    self._add_text(ids, labels, text, timestamp_text(seconds), trained)
                    self._add_span(ids, labels, self.video_pad_id, video.frame_tokens)
                    text = ""
            else:
                text += piece
                continue
            text = ""
        self._add_text(ids, labels, text, "", trained)
        return ids, labels

    def _add_text(self, ids: list, labels: list, text: str, stamp: str, trained: bool) -> None:
        """`text` + a video timestamp `stamp` as one piece; trained (if `trained`) as far as its ids
        are those of `text` alone: a timestamp is never a target."""
        piece_ids = self._text(text + stamp)
        n = 0
        if trained:
            own = self._text(text) if stamp else piece_ids
            while n < min(len(own), len(piece_ids)) and own[n] == piece_ids[n]:
                n += 1
        ids += piece_ids
        labels += piece_ids[:n] + [IGNORE_INDEX] * (len(piece_ids) - n)

    def _add_span(self, ids: list, labels: list, pad_id: int, n: int) -> None:
        span = [self.vision_start_id] + [pad_id] * n + [self.vision_end_id]
        ids += span
        labels += [IGNORE_INDEX] * len(span)

    def encode_chat(
        self,
        messages: list[dict],
        image_tokens: Sequence[int] = (),
        videos: Sequence[VideoSpan] = (),
    ) -> tuple[list[int], list[int]]:
        """(input_ids, labels) of a conversation; the i-th <image> placeholder
        becomes image_tokens[i] <|image_pad|> tokens inside a vision span, the i-th
        <video> placeholder videos[i]'s timestamped spans of <|video_pad|> tokens."""
        _check_messages(messages)
        for tag, media, name in (
            (IMAGE_PLACEHOLDER, image_tokens, "images"),
            (VIDEO_PLACEHOLDER, videos, "videos"),
        ):
            n_tags = sum(m["content"].count(tag) for m in messages)
            if n_tags != len(media):
                raise SkipSample(
                    "image_tag_mismatch", f"{n_tags} {tag} tags in the text, {len(media)} {name}"
                )
        counts = [int(n) for n in image_tokens]
        if any(n < 1 for n in counts):
            raise ValueError(f"image_tokens must be positive, got {counts}")
        images, video_iter = iter(counts), iter(videos)
        ids: list[int] = []
        labels: list[int] = []
        n_trained = 0
        for msg in messages:
            trained = msg["role"] == "assistant"
            body_ids, body_labels = self._content(msg["content"], images, video_iter, trained)
            n_trained += sum(label != IGNORE_INDEX for label in body_labels)
            head = self._headers[msg["role"]]
            ids += head + body_ids + [self.im_end_id] + self._newline
            labels += (
                [IGNORE_INDEX] * len(head)
                + body_labels
                + [self.im_end_id if trained else IGNORE_INDEX]
                + [IGNORE_INDEX] * len(self._newline)
            )
        if n_trained == 0:
            raise SkipSample("empty_sample", "no assistant message with text to train on")
        return ids, labels

    def encode_text(self, text: str) -> tuple[list[int], list[int]]:
        """(input_ids, labels) of a plain document: every token trained, then <|endoftext|>."""
        if not isinstance(text, str):
            raise SkipSample("bad_record", f"text is a {type(text).__name__}, expected str")
        if not text.strip():
            raise SkipSample("empty_sample", "the text is empty")
        ids = self._text(text) + [self.eot_id]
        return ids, list(ids)
