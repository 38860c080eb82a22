"""Video decoding (moevlm.data.video_decode): the header probe, seeking to wanted frames in mp4/H.264,
webm/VP9 and mkv/H.264, the linear pass without an index, and every kind of bad video as one counted
skip after which the next video decodes (tiny clips encoded here with PyAV, once per session)."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from moevlm.data import video_decode
from moevlm.data.errors import REASONS, SkipCounter, SkipSample
from moevlm.data.sample import sample_photo_paths
from moevlm.data.sample_video import encode_clip
from moevlm.data.video_decode import (
    DecodeStats,
    VideoDecodeConfig,
    cut_short,
    decode_frames,
    probe_video,
)

T, W, H, GOP = 30, 64, 48, 10
CFG = VideoDecodeConfig()


def pattern(n: int = T, width: int = W, height: int = H) -> np.ndarray:
    """Frames that differ from each other everywhere (a moving ramp, a per-frame blue level)."""
    y, x = np.mgrid[0:height, 0:width]
    out = np.zeros((n, height, width, 3), np.uint8)
    for t in range(n):
        out[t, ..., 0] = (x * 4 + t * 8) % 256
        out[t, ..., 1] = (y * 5) % 256
        out[t, ..., 2] = (t * 37) % 256
    return out


def encode(frames, fmt="matroska", codec="libx264", pts=None, out=None, **options) -> bytes:
    """Frames muxed with PyAV into `out` (a path: mp4 +faststart needs a file; default in memory)."""
    target = io.BytesIO() if out is None else out
    with av.open(target, "w", format=fmt, options=options) as container:
        stream = container.add_stream(codec, rate=30)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        if len(frames):
            stream.height, stream.width = frames.shape[1:3]
        container.start_encoding()
        for t in range(len(frames)):
            frame = av.VideoFrame.from_ndarray(frames[t], format="rgb24")
            frame.pts = t if pts is None else pts[t]
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return target.getvalue() if out is None else out.read_bytes()


class _Pipe:
    """A write-only file: the muxer cannot seek back, so a webm gets no cues and no duration."""

    def __init__(self):
        self.buf = io.BytesIO()

    def write(self, b):
        return self.buf.write(b)


@pytest.fixture(scope="session")
def clips():
    frames = pattern()
    pipe = _Pipe()
    with av.open(pipe, "w", format="webm") as out:
        stream = out.add_stream("libvpx-vp9", rate=30)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        stream.options = {"deadline": "realtime", "cpu-used": "8", "g": str(GOP)}
        for t in range(T):
            frame = av.VideoFrame.from_ndarray(frames[t], format="rgb24")
            frame.pts = t
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return {
        **{c: encode_clip(frames, c, fps=30, gop=GOP) for c in ("mp4", "webm", "mkv")},
        "webm_no_cues": pipe.buf.getvalue(),
    }


def linear(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


@pytest.mark.parametrize(
    "container,codec", [("mp4", "h264"), ("webm", "vp9"), ("mkv", "h264")], ids=str
)
def test_probe_reads_the_header(clips, container, codec):
    info = probe_video(clips[container], CFG)
    assert (info.frames, info.fps, info.width, info.height, info.codec) == (T, 30.0, W, H, codec)
    assert info.duration == pytest.approx(1.0)


@pytest.mark.parametrize("container", ["mp4", "webm", "mkv"])
def test_decode_seeks_to_the_wanted_frames(clips, container):
    """The frames equal a full linear decode's at the asked indices, in the asked order (repeats
    kept); reaching 5 and 25 decodes from their key frames (0 and 20) only: 6 + 6 frames, not 26."""
    data, ref = clips[container], linear(clips[container])
    asked = [29, 5, 17, 5, 0]
    frames, info = decode_frames(data, asked, CFG)
    assert frames.shape == (5, H, W, 3) and frames.dtype == np.uint8
    assert all((frames[k] == ref[i]).all() for k, i in enumerate(asked))
    stats = DecodeStats()
    decode_frames(data, [5, 25], CFG, stats)
    assert (stats.mode, stats.wanted, stats.decoded, stats.seeks) == ("seek", 2, 12, 1)


def test_indices_from_the_probed_header(clips):
    """The sampler can be given instead of indices: it sees the probed header (one open)."""
    frames, info = decode_frames(clips["mkv"], lambda info: [0, info.frames - 1], CFG)
    assert frames.shape[0] == 2 and (frames[1] == linear(clips["mkv"])[T - 1]).all()


def test_frame_i_is_the_source_frame_i(clips):
    """Index i is the i-th frame shown: each decoded frame is nearest to source frame i."""
    src = pattern().astype(np.float32)
    frames, _ = decode_frames(clips["mp4"], list(range(T)), CFG)
    nearest = [
        int(np.abs(src - f.astype(np.float32)).mean(axis=(1, 2, 3)).argmin()) for f in frames
    ]
    assert nearest == list(range(T))


def test_one_key_frame_is_one_linear_pass(clips):
    """A clip whose only key frame is its first (nothing to seek to) is decoded in one forward pass."""
    data = encode_clip(pattern(), "mp4", fps=30, gop=2 * T)
    stats = DecodeStats()
    frames, info = decode_frames(data, [25, 3], CFG, stats)
    ref = linear(data)
    assert (frames[0] == ref[25]).all() and (frames[1] == ref[3]).all()
    assert (stats.mode, stats.seeks, stats.decoded) == ("linear", 0, 26)


def test_a_webm_without_cues_or_duration(clips):
    """Written to a pipe, a webm has no cues and no duration: the frames are counted from the packets,
    and FFmpeg indexes the key frames it reads, so the wanted frames are still found."""
    data = clips["webm_no_cues"]
    frames, info = decode_frames(data, [25, 3], CFG)
    ref = linear(data)
    assert info.frames == T and (frames[0] == ref[25]).all() and (frames[1] == ref[3]).all()


def test_a_header_count_past_the_real_end_gives_the_last_frame(clips):
    """mkv/webm give a count of duration * fps: one frame too many (the track's DURATION tag made
    1.04 s) gets the last frame, counted; the same past end_slack_s is a skip."""
    data = clips["webm"].replace(b"00:00:01.000000000", b"00:00:01.040000000")
    assert probe_video(data, CFG).frames == T + 1
    stats = DecodeStats()
    frames, _ = decode_frames(data, [T - 1, T], CFG, stats)
    assert (frames[0] == frames[1]).all() and stats.past_end == 1
    with pytest.raises(SkipSample, match="bad_video"):
        decode_frames(data, [T], VideoDecodeConfig(end_slack_s=0))


def test_index_outside_the_video_is_a_caller_error(clips):
    with pytest.raises(ValueError, match="not within"):
        decode_frames(clips["mp4"], [T], CFG)


# ---------------------------------------------------------------- bad video


def _corrupt(data: bytes) -> bytes:
    mid = len(data) // 3
    return data[:mid] + bytes((k * 97) % 256 for k in range(600)) + data[mid + 600 :]


def _cut(clips, tmp_path) -> bytes:
    """An mp4 with its index first (+faststart), cut at 60%: the header promises 30 frames."""
    data = encode(pattern(), "mp4", out=tmp_path / "f.mp4", movflags="+faststart", g=str(GOP))
    return data[: len(data) * 6 // 10]


BAD = {
    # kind: (bytes maker, frames asked, config, reason)
    "truncated (index first)": (_cut, [T - 1], CFG, "video_truncated"),
    "truncated (index last)": (
        lambda c, p: c["mp4"][: len(c["mp4"]) // 2],
        [0],
        CFG,
        "video_truncated",
    ),
    "corrupt bytes": (lambda c, p: _corrupt(c["mp4"]), list(range(T)), CFG, "bad_video"),
    "zero frames": (lambda c, p: encode(pattern(0)), [0], CFG, "no_video_frames"),
    "degenerate size": (lambda c, p: encode(pattern(4, 2, 402)), [0], CFG, "bad_video_size"),
    "frame over the pixel cap": (
        lambda c, p: c["mp4"],
        [0],
        VideoDecodeConfig(max_frame_pixels=W * H - 1),
        "video_too_large",
    ),
    "frames over the byte cap": (
        lambda c, p: c["mp4"],
        list(range(T)),
        VideoDecodeConfig(max_decode_bytes=T * W * H * 3 - 1),
        "video_too_large",
    ),
    "absurd duration": (  # the last frame stamped 10 hours in
        lambda c, p: encode(pattern(10), pts=[*range(9), 30 * 3600 * 10]),
        [0],
        CFG,
        "video_too_long",
    ),
    "unsupported codec": (
        lambda c, p: encode(pattern(5), codec="ffv1"),
        [0],
        CFG,
        "unsupported_video_codec",
    ),
    "not a video (a JPEG)": (
        lambda c, p: sample_photo_paths()[3].read_bytes(),
        [0],
        CFG,
        "not_a_video",
    ),
    "not a video (text)": (
        lambda c, p: b"just some text, no video\n" * 20,
        [0],
        CFG,
        "not_a_video",
    ),
    "empty": (lambda c, p: b"", [0], CFG, "empty_video"),
    "over the decode budget": (
        lambda c, p: c["mp4"],
        [GOP - 1],
        VideoDecodeConfig(max_decoded_frames=GOP - 1),
        "video_decode_budget",
    ),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_video_is_one_counted_skip_and_the_next_decodes(clips, tmp_path, capfd, kind):
    make, asked, cfg, reason = BAD[kind]
    assert reason in REASONS
    skips = SkipCounter()
    for data, frames_asked, config in [
        (make(clips, tmp_path), asked, cfg),
        (clips["webm"], [0, T - 1], CFG),
    ]:
        try:
            frames, _ = decode_frames(data, frames_asked, config)
        except SkipSample as e:
            skips.add(e, kind)
    assert dict(skips) == {reason: 1}, skips.examples
    assert frames.shape == (2, H, W, 3)  # the next video decoded
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")  # FFmpeg said nothing on stdout or stderr (file descriptors 1, 2)


def test_header_guards_run_before_any_frame_is_decoded(clips, monkeypatch):
    class NoDecoding:
        def __init__(self, *a):
            raise AssertionError("decoding started")

    monkeypatch.setattr(video_decode, "_Decoder", NoDecoding)
    for data, cfg in [
        (clips["mp4"], VideoDecodeConfig(max_frame_pixels=100)),
        (clips["mp4"], VideoDecodeConfig(max_decode_bytes=100)),
        (clips["webm"], VideoDecodeConfig(max_frames=T - 1)),
        (clips["mkv"], VideoDecodeConfig(max_duration_s=0.5)),
    ]:
        with pytest.raises(SkipSample, match="video_too"):
            decode_frames(data, [0, 1], cfg)


def test_cut_short_reads_the_containers_own_sizes(clips):
    for name in ("mp4", "webm", "mkv"):
        data = clips[name]
        assert not cut_short(data) and cut_short(data[: len(data) - 10]), name
    assert not cut_short(clips["webm_no_cues"][:-10])  # a live webm's size is unknown
    assert not cut_short(b"plain text, no container\n" * 4)


# ---------------------------------------------------------------- the sample clips


def test_sample_clips_are_real_video_of_the_photos(tmp_path):
    """3-4 clips of 1-3 s, at most 160 px, mp4/H.264 and one webm/VP9, each decoding to its spec's
    frame count and size; made again they are the same bytes."""
    from moevlm.data.sample_video import SAMPLE_CLIPS, make_sample_clips

    photos = sample_photo_paths()
    paths = make_sample_clips(photos, tmp_path / "a")
    assert 3 <= len(paths) <= 4 and {p.suffix for p in paths} == {".mp4", ".webm"}
    for path, spec in zip(paths, SAMPLE_CLIPS):
        info = probe_video(path.read_bytes(), CFG)
        n = round(spec.seconds * spec.fps)
        assert 1 <= info.duration <= 3 and max(spec.size) <= 160
        assert (info.frames, info.width, info.height) == (n, *spec.size)
        frames, _ = decode_frames(path.read_bytes(), list(range(n)), CFG)
        assert frames.shape == (n, spec.size[1], spec.size[0], 3) and frames.std() > 10
    again = make_sample_clips(photos, tmp_path / "b")
    assert [p.read_bytes() for p in paths] == [p.read_bytes() for p in again]
