"""Why a sample was skipped, and the errors that stop the data.

    raise SkipSample("bad_image", detail)    # any stage; the driver counts REASONS[reason] and goes on
    SkipCounter().add(err, where)            # counts by reason, with the first examples

REASONS: the stable skip keys (the builder's summary.json, the loader's stats); FALLBACKS: samples that
train without some of their images (counted, not skipped).  DataError (a RuntimeError): the data can
feed nothing.  DataSetupError (a ConfigError and FileNotFoundError): an input missing before any read.
"""

from __future__ import annotations

from collections import Counter

from moevlm.errors import ConfigError

REASONS = {
    # records / annotations
    "bad_record": "the annotation record is not a dict of the expected form",
    "bad_json": "the json field is missing, not valid JSON, or not an object",
    "bad_text_encoding": "text bytes are not valid UTF-8",
    "image_tag_mismatch": "the text has a different number of <image> tags than the sample has images",
    "missing_image": "the record names an image the sample does not carry (or the file is missing)",
    "outside_images": "an image path is absolute, starts with ~, or leads outside the images folder ('..', symlinks)",
    "file_too_large": "a file (image or text) is larger than its configured byte cap",
    "text_too_large": "the sample's text is larger than its configured byte cap",
    # images
    "empty_image": "the image file has zero bytes",
    "not_an_image": "the bytes are not an image format PIL can identify",
    "bad_image": "the image is corrupt or truncated (decoding failed)",
    "image_too_large": "width*height is above the decompression-bomb limit",
    "decode_too_large": "decoding would hold more bytes than data.image.max_decode_bytes (size x bytes per pixel of its mode)",
    "bad_image_size": "the image is degenerate (a zero side or an aspect ratio above 200)",
    # videos (moevlm.data.video_decode; header guards are checked before any frame is decoded)
    "empty_video": "the video file has zero bytes",
    "not_a_video": "the bytes are not an mp4/mov or mkv/webm container, or it holds no video stream",
    "unsupported_video_codec": "the video stream's codec is not one the decoder accepts "
    "(moevlm.data.video_decode.CODECS)",
    "bad_video": "the video is corrupt (its container or a frame failed to decode, or no frame rate)",
    "video_truncated": "the video ends before the frames its header promises (a file cut short)",
    "no_video_frames": "the video stream holds no decodable frame",
    "video_too_large": "a frame's width*height, or the wanted frames' decoded bytes, above the decode guard",
    "bad_video_size": "the video is degenerate (a zero side or an aspect ratio above 200)",
    "video_too_long": "the header's duration or frame count is above its cap (absurd or hostile)",
    "video_decode_budget": "reaching the wanted frames would decode more frames (or take longer) than the "
    "per-sample budget",
    "video_tag_mismatch": "the text has a different number of <video> tags than the sample has videos",
    "missing_video": "the record names a video file that is missing or not a regular file",
    "video_too_short": "the video has fewer frames than a temporal patch (2): train a single frame as an image",
    "videos_off": "the sample has videos but data.pack.max_videos=0 (its rows carry no video)",
    # shards
    "truncated_shard": "a tar shard ended early or is corrupt; samples before the damage were kept",
    "unreadable_shard": "a shard could not be opened",
    "unreadable_input": "a builder input (a Parquet file or row group) could not be opened or read to its "
    "end; the rows before the damage were kept",
    "gone_on_resume": "a sample held (shuffle buffer or packer) at the checkpoint is no longer in its shard "
    "at the resume (the shard was rewritten shorter; data.allow_changed_shards=true skips it)",
    # packing
    "too_long": "the sample exceeds the token, patch or image budget of a micro-batch",
    "empty_sample": "the sample has no tokens to train on",
}

# Counted like a skip reason, but the sample still trains: what it trained without.
FALLBACKS = {
    "images_unused": "the sample carries image members its record does not use (e.g. data.format=moevlm on a "
    "third-party shard whose json names no image); it trained without them",
    "video_fewer_frames": "a video over a row's budget trained on fewer frames (data.video.fit)",
    "video_lower_resolution": "a video over a row's budget trained at a lower resolution (data.video.fit)",
}


class DataError(RuntimeError):
    """The data cannot feed training (no shard readable, or every sample skipped):
    the run must stop with this one-line message rather than wait forever."""


class DataSetupError(ConfigError, FileNotFoundError):
    """The shards or the tokenizer the config names are not there (one line: which, and what to set)."""


class SkipSample(Exception):
    """A sample that cannot be used.  `reason` is a key of REASONS (or of FALLBACKS: counted, not
    skipped)."""

    def __init__(self, reason: str, detail: str = ""):
        if reason not in REASONS and reason not in FALLBACKS:
            raise ValueError(
                f"unknown skip reason {reason!r}; add it to moevlm.data.errors.REASONS"
            )
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


class SkipCounter(Counter):
    """reason -> count, plus the first few details of each reason for the logs."""

    def __init__(self, *args, keep: int = 3, **kw):
        super().__init__(*args, **kw)
        self.examples: dict[str, list[str]] = {}
        self.keep = keep

    def add(self, err: SkipSample, where: str = "") -> None:
        self[err.reason] += 1
        ex = self.examples.setdefault(err.reason, [])
        if len(ex) < self.keep:
            ex.append(f"{where}: {err.detail}" if where else err.detail)
