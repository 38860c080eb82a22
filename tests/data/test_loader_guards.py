"""The loader refuses what would train on wrong data, hang or blow up memory:
nonsense config values, budgets no sample fits, oversized tar members, and
shards rewritten under the same names between a checkpoint and its resume."""

import contextlib
import json
import logging
import shutil
import signal
import tarfile
import tracemalloc

import pytest
from data_helpers import encoded, good, small_data_config, text, write_tar
from PIL import Image

from moevlm.data.checks import check_config
from moevlm.data.config import DataConfig
from moevlm.data.errors import DataError
from moevlm.data.loader import build_loader
from moevlm.data.reader import Oversize, members, shard_identity
from moevlm.data.sample import sample_photo_paths
from moevlm.data.state import merge_states
from moevlm.model import VLMConfig

TINY = VLMConfig.preset("tiny")

BAD_VALUES = [  # (field path, value, what the message must say)
    ("pack.max_samples", 0, "data.pack.max_samples=0 is invalid: set it to at least 1"),
    ("pack.seq_len", 1, "data.pack.seq_len=1 is invalid: set it to at least 2"),
    (
        "pack.max_patches",
        -4,
        "data.pack.max_patches=-4 is invalid: set it to 0 \\(text only\\) or more",
    ),
    ("pack.max_images", -1, "data.pack.max_images=-1 is invalid"),
    ("pack.lookahead", -1, "data.pack.lookahead=-1 is invalid"),
    (
        "pack.oversize",
        "drop",
        "data.pack.oversize='drop' is invalid: set it to 'skip' or 'truncate'",
    ),
    ("image.patch_size", 0, "data.image.patch_size=0 is invalid: set it to a positive integer"),
    ("image.merge_size", -2, "data.image.merge_size=-2 is invalid"),
    (
        "image.min_pixels",
        8192,
        "data.image.max_pixels=4096 is invalid: set it to at least data.image.min_pixels=8192",
    ),
    (
        "image.std",
        (0.5, 0.0, 0.5),
        "data.image.std=\\[0.5, 0.0, 0.5\\] is invalid: set it to three positive",
    ),
    ("image.max_image_pixels", 0, "data.image.max_image_pixels=0 is invalid"),
    ("image.max_decode_bytes", 0, "data.image.max_decode_bytes=0 is invalid"),
    ("max_text_bytes", 0, "data.max_text_bytes=0 is invalid: set it to a positive byte cap"),
    ("max_image_bytes", -1, "data.max_image_bytes=-1 is invalid"),
    ("num_workers", -1, "data.num_workers=-1 is invalid"),
    ("prefetch_factor", 0, "data.prefetch_factor=0 is invalid: set it to at least 1"),
    ("shuffle_buffer", -8, "data.shuffle_buffer=-8 is invalid"),
    ("epochs", 0, "data.epochs=0 is invalid: set it to null \\(loop forever\\) or at least 1"),
]


@pytest.mark.parametrize("field,value,message", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_nonsense_config_values_are_refused_naming_the_field(field, value, message):
    cfg = small_data_config("unused")
    *parents, name = field.split(".")
    target = cfg
    for p in parents:
        target = getattr(target, p)
    setattr(target, name, value)
    with pytest.raises(ValueError, match=message):
        check_config(cfg, TINY)
    check_config(small_data_config("unused"), TINY)  # the defaults of the tests pass
    check_config(DataConfig(), TINY)


def test_text_only_budget_packs_text_and_counts_image_samples(sample_shards):
    """max_patches=0, max_images=0: rows without pixels; the image samples are skipped as
    too_long (their answers follow the image: nothing trainable is left before it)."""
    cfg = small_data_config(sample_shards, num_workers=0, epochs=1)
    cfg.pack.max_patches = cfg.pack.max_images = (
        0  # oversize=truncate: long texts are cut, images never fit
    )
    loader = build_loader(cfg, TINY)
    rows = list(loader)
    assert rows and all(r["pixel_values"].shape[0] == 0 and r["num_images"] == 0 for r in rows)
    with_images = 0
    for path in sample_shards.glob("shard-*.tar"):
        with tarfile.open(path) as tar:
            with_images += sum(
                bool(json.loads(tar.extractfile(m).read()).get("images"))
                for m in tar.getmembers()
                if m.name.endswith(".json")
            )
    stats = loader.stats()
    assert stats["skipped"] == {"too_long": with_images} and with_images > 30
    assert (
        stats["samples_packed"]
        == stats["samples_read"] - with_images
        == sum(r["num_samples"] for r in rows)
    )


# the one bound, wide: it only stops a hang (a busy machine starts the workers slowly)
WIDE_S = 300


class Hang(BaseException):
    """Not an Exception: the decoders turn any Exception into a skipped sample."""


@contextlib.contextmanager
def deadline(seconds):
    """Fails the test instead of hanging forever (the bug this guards against)."""

    def timeout(*_):
        raise Hang(f"the loader produced nothing and no error in {seconds} s")

    old = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("workers", [0, 2])
def test_budget_no_sample_fits_stops_with_the_skip_counts(sample_shards, workers):
    """seq_len=8 with real samples: every sample is too_long.  The stream used to read
    epoch after epoch forever; now the first full epoch without a packed sample stops it."""
    shards = ",".join(str(p) for p in sorted(sample_shards.glob("shard-*.tar"))[:2])
    cfg = small_data_config(
        shards, tokenizer=str(sample_shards / "tokenizer.json"), num_workers=workers
    )
    cfg.pack.seq_len, cfg.pack.oversize = 8, "skip"
    with deadline(WIDE_S), pytest.raises(DataError) as err:  # a RuntimeError
        next(build_loader(cfg, TINY))
    msg = str(err.value)
    assert "could pack none in all of epoch 0: every one was skipped (too_long=" in msg, msg
    assert "first: " in msg and "tokens" in msg  # the first example says why
    assert "raise data.pack.seq_len=8" in msg and "data.pack.oversize=truncate" in msg
    # one line, also from a worker process
    assert msg.startswith("data stream ") and "\n" not in msg


def test_stream_that_never_packs_stops_after_a_run_of_skips(sample_shards, monkeypatch):
    """Shards too big to read in a whole epoch before failing: NO_PROGRESS_SAMPLES skipped
    in a row by a stream that never packed anything stop it too (lowered here to 20)."""
    monkeypatch.setattr("moevlm.data.streams.NO_PROGRESS_SAMPLES", 20)
    cfg = small_data_config(sample_shards, num_workers=0)
    cfg.pack.seq_len, cfg.pack.oversize = 8, "skip"
    with (
        deadline(WIDE_S),
        pytest.raises(
            RuntimeError,
            match=r"read \d+ samples but could pack none in its first "
            r"20 samples: every one was skipped \(too_long=20",
        ),
    ):
        next(build_loader(cfg, TINY))


def test_members_over_their_cap_are_not_read(tmp_path):
    write_tar(
        tmp_path / "m.tar",
        [
            {"__key__": "a", "json": b"{}" * 600, "img0.png": b"x" * 5000},
            {"__key__": "b", "txt": b"short", "img0.png": b"y" * 10},
            {"__key__": "c", "txt": bytes(8 << 20)},
        ],
    )
    damaged = []
    tracemalloc.start()
    with open(tmp_path / "m.tar", "rb") as f:
        got = {m["fname"]: m["data"] for m in members("m.tar", f, 1000, 1000, damaged) if m}
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert not damaged
    assert got == {
        "a.json": Oversize("a.json", 1200, 1000),
        "a.img0.png": Oversize("a.img0.png", 5000, 1000),
        "b.txt": b"short",
        "b.img0.png": b"y" * 10,
        "c.txt": Oversize("c.txt", 8 << 20, 1000),
    }
    assert [got["a.json"].reason, got["a.img0.png"].reason] == ["text_too_large", "file_too_large"]
    assert peak < 1 << 20  # the 8 MiB member was passed over, never held


def test_oversized_text_and_image_are_skipped_counted_and_the_rest_arrives(tmp_path, sample_shards):
    """A 2.2 MB text sample and a 1.2 MB caption (above the 1 MiB default
    data.max_text_bytes) and an image above a lowered data.max_image_bytes sit among
    good samples in the same shards (2 workers): those three are skipped by reason
    before parsing / decoding, every other sample arrives."""
    photo = encoded(Image.open(sample_photo_paths()[0]).convert("RGB").resize((48, 40)), "PNG")
    goods = [good(f"g{i}", photo) for i in range(4)] + [
        text(f"t{i}", f"plain text {i}. " * 5) for i in range(4)
    ]
    huge_text = text("huge", "many words " * 200_000)  # 2.2 MB of json
    huge_caption = {"__key__": "cap", "txt": b"a caption " * 120_000, "img0.png": photo}
    # trailing bytes past the PNG end: a larger file
    big_image = good("bigimg", photo + bytes(40_000))
    write_tar(tmp_path / "a.tar", goods[:3] + [huge_text] + goods[3:5])
    write_tar(tmp_path / "b.tar", goods[5:6] + [big_image, huge_caption] + goods[6:])
    shutil.copy(sample_shards / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = small_data_config(
        f"{tmp_path}/a.tar,{tmp_path}/b.tar",
        tokenizer=str(tmp_path / "tokenizer.json"),
        epochs=1,
        max_image_bytes=len(photo) + 10_000,
    )
    loader = build_loader(cfg, TINY)
    seen = sorted(sid for batch in loader for sid in batch["sample_ids"])
    assert seen == sorted(s["__key__"] for s in goods)
    assert loader.stats()["skipped"] == {"text_too_large": 2, "file_too_large": 1}


def shard_copy(sample_shards, tmp_path, n=4):
    for p in sorted(sample_shards.glob("shard-*.tar"))[:n]:
        shutil.copy(p, tmp_path / p.name)
    shutil.copy(sample_shards / "tokenizer.json", tmp_path / "tokenizer.json")
    return small_data_config(tmp_path, num_workers=0)


def test_shard_identity_sees_size_and_both_ends(tmp_path):
    path = tmp_path / "s.tar"
    body = bytearray(range(256)) * 2000  # 512 KB
    path.write_bytes(bytes(body))
    first = shard_identity(str(path))
    for at in (
        10,
        len(body) - 20_000,
    ):  # inside the first and the last 64 KiB, past any tar padding
        changed = bytearray(body)
        changed[at] ^= 1
        path.write_bytes(bytes(changed))
        assert (
            shard_identity(str(path))[1:] != first[1:] and shard_identity(str(path))[1] == first[1]
        )
    path.write_bytes(bytes(body) + bytes(512))
    assert shard_identity(str(path))[1] == len(body) + 512
    assert shard_identity(str(tmp_path / "missing.tar")) == ["missing.tar", -1, "unreadable"]


def test_resume_on_rewritten_shards_is_refused_or_warned(sample_shards, tmp_path, caplog):
    cfg = shard_copy(sample_shards, tmp_path)
    first = build_loader(cfg, TINY)
    for _ in range(3):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    build_loader(cfg, TINY).load_state_dict(state)  # unchanged shards: accepted
    other = {**state, "files": [[n, size + 1, h] for n, size, h in state["files"]]}
    with pytest.raises(ValueError, match=r"differ in \['files'\]"):  # ranks that saw other shards
        merge_states([state, other])

    # other content, same name
    shutil.copy(tmp_path / "shard-000001.tar", tmp_path / "shard-000000.tar")
    tail = bytearray((tmp_path / "shard-000002.tar").read_bytes())
    tail[-12_000] ^= 1  # one byte of the last member's data: same size
    (tmp_path / "shard-000002.tar").write_bytes(bytes(tail))
    with pytest.raises(
        ValueError,
        match=r"2 of 4 shards changed since the checkpoint: shard-000000.tar \(\d+ -> "
        r"\d+ bytes\), shard-000002.tar \(same size, other bytes\).*set "
        r"data.allow_changed_shards=true",
    ):
        build_loader(cfg, TINY).load_state_dict(state)

    cfg.allow_changed_shards = True
    resumed = build_loader(cfg, TINY)
    with caplog.at_level(logging.WARNING, logger="moevlm.data.loader"):
        resumed.load_state_dict(state)
    assert "shard-000000.tar" in caplog.text and "allow_changed_shards=true" in caplog.text
    assert next(resumed)["num_samples"] > 0

    caplog.clear()
    # saved before fingerprints
    old = {k: v for k, v in state.items() if k != "files"} | {"version": 2}
    with caplog.at_level(logging.WARNING, logger="moevlm.data.loader"):
        build_loader(cfg, TINY).load_state_dict(old)
    assert "predates shard fingerprints" in caplog.text
    with pytest.raises(ValueError, match="state version 1 is not one this loader reads"):
        build_loader(cfg, TINY).load_state_dict({**old, "version": 1})
