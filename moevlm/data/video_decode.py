"""Video bytes -> RGB frames at wanted indices, with PyAV (its wheels carry FFmpeg): the header probe,
seeking to the key frame before each wanted frame, and the guards that turn bad video into a skip.

    info = probe_video(mp4_bytes, VideoDecodeConfig())              # header only: no frame decoded
    frames_THWC, info = decode_frames(mp4_bytes, [0, 15, 29], cfg)   # uint8 RGB, in the order asked
    frames_THWC, info = decode_frames(mp4_bytes, sampler, cfg)       # sampler(info) -> the indices

Legend: T frames returned, H, W frame height/width, C channels (3).  Containers: mp4/mov and mkv/webm
(sniffed from their magic bytes, nothing else is probed); codecs: CODECS.  Frame i is the one shown
at start + i / fps (constant-rate indexing, as torchcodec's approximate mode).  Anything unusable
raises SkipSample with a video reason (errors.REASONS); FFmpeg's log stays silent.
"""

from __future__ import annotations

import io
import struct
import time
from dataclasses import dataclass
from typing import Callable

import av
import numpy as np

from moevlm.data.config import VideoDecodeConfig  # the guards: data.video.decode
from moevlm.data.errors import SkipSample
from moevlm.data.image import check_image_shape  # the images' shape rule, for every frame

# decoder names (as PyAV reports the stream's codec) accepted from untrusted files
CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "libdav1d", "mpeg4")
_EBML = b"\x1a\x45\xdf\xa3"
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip", b"pnot")

av.logging.set_level(
    None
)  # FFmpeg's messages dropped: a bad file is one counted skip, not log lines


@dataclass(frozen=True)
class VideoInfo:
    frames: int  # the header's count, else duration * fps, else the packets counted
    fps: float
    width: int
    height: int
    duration: float  # seconds
    codec: str  # the decoder's name, e.g. "h264", "vp9"
    container: str  # "mp4" or "matroska"


@dataclass
class DecodeStats:
    """What one decode_frames call did (the returned info's companion, for benchmarks and tests)."""

    wanted: int = 0  # distinct frames asked for
    decoded: int = 0  # frames the decoder produced
    seeks: int = 0
    mode: str = "seek"  # "seek" (the container has an index of key frames) or "linear"
    past_end: int = 0  # wanted frames past the stream's real end given its last (end_slack_s)


def probe_video(data: bytes, cfg: VideoDecodeConfig) -> VideoInfo:
    """The header's facts, checked against cfg's guards; SkipSample if unusable.  Decodes no frame."""
    with _open(data) as container:
        return _probe(container, data, cfg)


def decode_frames(
    data: bytes,
    indices: list[int] | Callable[[VideoInfo], list[int]],
    cfg: VideoDecodeConfig,
    stats: DecodeStats | None = None,
) -> tuple[np.ndarray, VideoInfo]:
    """(frames (T, H, W, 3) uint8 RGB in the order of `indices`, info).  Seeks to the key frame at or
    before each wanted frame (mp4's sample table, mkv/webm's cues) and decodes forward only to it,
    staying in the current run when no key frame lies between; with no index of key frames (a webm
    without cues) it makes one linear pass from the start.  At most cfg.max_decoded_frames decoded.
    `indices` may be a function of the probed VideoInfo (the sampler: one open, one probe).
    An index outside [0, info.frames) is a ValueError (the caller's bug, not the data's)."""
    stats = stats if stats is not None else DecodeStats()
    with _open(data) as container:
        info = _probe(container, data, cfg)
        indices = list(indices(info) if callable(indices) else indices)
        wanted = sorted(set(indices))
        if not wanted or wanted[0] < 0 or wanted[-1] >= info.frames:
            raise ValueError(
                f"frame indices {indices[:8]} not within [0, {info.frames}) (or empty)"
            )
        if (need := len(wanted) * info.width * info.height * 3) > cfg.max_decode_bytes:
            raise SkipSample(
                "video_too_large",
                f"{len(wanted)} frames of {info.width}x{info.height} hold {need:,} bytes, above "
                f"max_decode_bytes={cfg.max_decode_bytes:,}",
            )
        got = _Decoder(data, container, info, cfg, stats).run(wanted)
    return np.stack([got[i] for i in indices]), info


# ---------------------------------------------------------------- opening and the header


class _open:
    """The container of `data` (mp4/mov or mkv/webm by magic bytes), closed on exit; SkipSample if not."""

    def __init__(self, data: bytes):
        self.data, self.container = data, None

    def __enter__(self):
        fmt = sniff_container(self.data)
        try:
            self.container = av.open(io.BytesIO(self.data), format=fmt, metadata_errors="ignore")
        except Exception as e:  # noqa: BLE001 - FFmpeg reports damage as several error types
            if cut_short(self.data):
                raise SkipSample("video_truncated", f"the {fmt} file is cut short") from None
            if isinstance(e, EOFError):  # a whole file whose stream has no packet
                raise SkipSample("no_video_frames", f"the {fmt} file holds no frame") from None
            raise SkipSample("bad_video", f"{fmt} container unreadable: {_short(e)}") from None
        return self.container

    def __exit__(self, *exc):
        self.container.close()


def sniff_container(data: bytes) -> str:
    """ "mov" or "matroska" from the first bytes; SkipSample(empty_video / not_a_video) otherwise."""
    if len(data) == 0:
        raise SkipSample("empty_video", "0 bytes")
    if data[:4] == _EBML:
        return "matroska"
    if data[4:8] in _MP4_BOXES:
        return "mov"
    raise SkipSample(
        "not_a_video",
        f"{len(data):,} bytes starting {bytes(data[:8])!r} are not an mp4/mov or mkv/webm container",
    )


def cut_short(data: bytes) -> bool:
    """Whether the file ends before its own structure says it does (a download cut short): an mp4's
    top-level boxes, or a matroska segment of known size, running past the end of `data`."""
    if data[:4] == _EBML:
        return _ebml_cut_short(data)
    if data[4:8] not in _MP4_BOXES:
        return False  # neither container
    off = 0
    while off + 8 <= len(data):
        size = struct.unpack(">I", data[off : off + 4])[0]
        if size == 1 and off + 16 <= len(data):
            size = struct.unpack(">Q", data[off + 8 : off + 16])[0]
        if size == 0 or size < 8:
            return False  # to the end of the file, or not boxes (damage of another kind)
        off += size
    return off > len(data)


def _ebml_cut_short(data: bytes) -> bool:
    off = 0
    for _ in range(2):  # the EBML header, then the Segment
        id_len, _ = _vint(data, off)
        size_len, size = _vint(data, off + id_len)
        if not id_len or not size_len:
            return False
        if size == (1 << (7 * size_len)) - 1:
            return False  # unknown size (a live stream)
        start = off + id_len + size_len
        off = start + size
    return off > len(data)


def _vint(data: bytes, off: int) -> tuple[int, int]:
    """(length, value without its length marker) of the EBML variable-size integer at `off`."""
    if off >= len(data) or data[off] == 0:
        return 0, 0
    n = 8 - data[off].bit_length() + 1
    if off + n > len(data):
        return 0, 0
    value = data[off] & (0xFF >> n)
    for b in data[off + 1 : off + n]:
        value = (value << 8) | b
    return n, value


def _probe(container, data: bytes, cfg: VideoDecodeConfig) -> VideoInfo:
    if not container.streams.video:
        raise SkipSample(
            "not_a_video", f"the {container.format.name} container has no video stream"
        )
    stream = container.streams.video[0]
    codec = stream.codec_context.name
    if codec not in CODECS:
        raise SkipSample(
            "unsupported_video_codec", f"codec {codec!r}; decoded are {', '.join(CODECS)}"
        )
    width, height = stream.codec_context.width, stream.codec_context.height
    _check_size(width, height, cfg)
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    if not fps > 0:
        raise SkipSample("bad_video", "the header gives no frame rate")
    duration = _duration(container, stream)
    frames = stream.frames or (round(duration * fps) if duration > 0 else 0)
    if duration > cfg.max_duration_s or frames > cfg.max_frames:
        raise SkipSample(
            "video_too_long",
            f"{duration:,.0f} s, {frames:,} frames; the caps are max_duration_s={cfg.max_duration_s:,.0f} "
            f"and max_frames={cfg.max_frames:,}",
        )
    if frames == 0 and duration <= 0:
        frames = _count_packets(data, stream.index, cfg)  # no duration in the header (a live webm)
        duration = frames / fps
    if frames == 0:
        raise SkipSample("no_video_frames", "the video stream holds no frame")
    fmt = "matroska" if container.format.name.startswith("matroska") else "mp4"
    return VideoInfo(frames, fps, width, height, duration, codec, fmt)


def _check_size(width: int, height: int, cfg: VideoDecodeConfig) -> None:
    check_image_shape(width, height, reason="bad_video_size")
    if width * height > cfg.max_frame_pixels:
        raise SkipSample(
            "video_too_large",
            f"{width}x{height} = {width * height:,} pixels a frame, above "
            f"max_frame_pixels={cfg.max_frame_pixels:,}",
        )


def _duration(container, stream) -> float:
    """The video stream's duration: its own, else its matroska DURATION tag, else the container's."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    tag = stream.metadata.get("DURATION", "")
    if len(parts := tag.split(":")) == 3:
        try:
            return int(parts[0]) * 3600 + int(parts[1]) * 60 + float(parts[2])
        except ValueError:
            pass
    return container.duration / av.time_base if container.duration else 0.0


def _count_packets(data: bytes, index: int, cfg: VideoDecodeConfig) -> int:
    """Video packets in the file, demuxed without decoding (at most cfg.max_frames + 1 counted)."""
    n = 0
    with _open(data) as container:
        try:
            for packet in container.demux(container.streams[index]):
                n += packet.size > 0
                if n > cfg.max_frames:
                    raise SkipSample(
                        "video_too_long", f"over max_frames={cfg.max_frames:,} packets"
                    )
        except av.FFmpegError:
            pass  # damage ends the count; the frames before it stay usable
    return n


def _short(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:160]}"


# ---------------------------------------------------------------- decoding


class _Decoder:
    """Walks the wanted frames in order: a seek when a key frame lies between the decoder and the
    next wanted frame, else decoding on; every decoded frame counted against the budget."""

    def __init__(self, data: bytes, container, info: VideoInfo, cfg: VideoDecodeConfig, stats):
        self.data, self.container, self.info = data, container, info
        self.cfg, self.stats = cfg, stats
        self.stream = container.streams.video[0]
        self.stream.codec_context.thread_count = cfg.threads
        self.tb = float(self.stream.time_base)
        self.start = self.stream.start_time or 0
        self.keys = self._key_frames()  # [(frame index, seek timestamp)], ascending
        stats.mode = "seek" if len(self.keys) > 1 else "linear"
        self.frames = None  # the current run's frame iterator
        self.at = -1  # index of the last frame decoded in the current run
        self.fresh = False  # no frame decoded since the last seek yet
        self.started = False  # the demuxer has read (a seek to the start is needed to restart)
        self.last = None  # the last frame decoded in the current run
        self.t0 = time.perf_counter()

    def _key_frames(self) -> list[tuple[int, int]]:
        if self.info.container == "matroska" and len(self.stream.index_entries) <= 1:
            # mkv/webm read their cues (at the end) on the first seek: one to the start loads them
            self.container.seek(self.start, stream=self.stream, backward=True, any_frame=False)
        entries = list(self.stream.index_entries)
        if len(entries) == self.info.frames:  # one entry per frame (mp4): index = decode position
            return [(k, e.timestamp) for k, e in enumerate(entries) if e.is_keyframe]
        return sorted(
            {(self._index_of(e.timestamp), e.timestamp) for e in entries if e.is_keyframe}
        )

    def _index_of(self, pts: int) -> int:
        return round((pts - self.start) * self.tb * self.info.fps)

    def run(self, wanted: list[int]) -> dict[int, np.ndarray]:
        self.stats.wanted = len(wanted)
        return {target: self._frame(target) for target in wanted}

    def _frame(self, target: int) -> np.ndarray:
        key = self._key_before(target)
        if self.frames is None or not (self.at < target and (key is None or key[0] <= self.at)):
            self._seek(key)
        for frame in self.frames:
            self._count()
            index = self._index_of(frame.pts) if frame.pts is not None else self.at + 1
            landed, self.fresh, self.at, self.last = self.fresh, False, index, frame
            if index < target:
                continue
            if index > target and landed and key is not None:  # an open GOP: an earlier key frame
                self.keys.remove(key)
                self.frames = None
                return self._frame(target)
            return frame.to_ndarray(format="rgb24")
        slack = self.cfg.end_slack_s * self.info.fps
        if self.last is not None and target - self.at <= slack and not cut_short(self.data):
            self.stats.past_end += 1
            return self.last.to_ndarray(format="rgb24")  # the header's count overshot the stream
        if cut_short(self.data):
            reason = "video_truncated"
        elif self.stats.decoded == 0 and self.stats.seeks == 0:
            reason = "no_video_frames"  # nothing decodes from the start
        else:
            reason = "bad_video"
        raise SkipSample(
            reason,
            f"frame {target} of the {self.info.frames} the header gives not reached "
            f"({self.stats.decoded} decoded)",
        )

    def _key_before(self, target: int) -> tuple[int, int] | None:
        """The last key frame at or before `target`; None: from the start of the file."""
        before = [k for k in self.keys if k[0] <= target] if self.stats.mode == "seek" else []
        return before[-1] if before else None

    def _seek(self, key: tuple[int, int] | None) -> None:
        if key is not None and key[0] > 0:
            self.container.seek(key[1], stream=self.stream, backward=True, any_frame=False)
            self.stats.seeks += 1
        elif self.started:
            self.container.seek(self.start, stream=self.stream, backward=True, any_frame=False)
            self.stats.seeks += 1
        self.frames, self.at, self.fresh, self.started = self._decoded(), -1, True, True

    def _decoded(self):
        try:
            for packet in self.container.demux(self.stream):
                yield from packet.decode()
        except av.FFmpegError as e:
            if not self.stats.decoded:
                raise SkipSample("bad_video", f"decoding failed: {_short(e)}") from None
            raise SkipSample(
                "bad_video", f"decoding failed after {self.stats.decoded} frames: {_short(e)}"
            ) from None

    def _count(self) -> None:
        self.stats.decoded += 1
        if self.stats.decoded > self.cfg.max_decoded_frames:
            raise SkipSample(
                "video_decode_budget",
                f"over max_decoded_frames={self.cfg.max_decoded_frames} decoded for "
                f"{self.stats.wanted} wanted frames",
            )
        if (
            self.cfg.max_decode_s is not None
            and time.perf_counter() - self.t0 > self.cfg.max_decode_s
        ):
            raise SkipSample(
                "video_decode_budget", f"over max_decode_s={self.cfg.max_decode_s} s decoding"
            )


__all__ = [
    "CODECS",
    "DecodeStats",
    "VideoDecodeConfig",
    "VideoInfo",
    "decode_frames",
    "probe_video",
    "cut_short",
    "sniff_container",
]
