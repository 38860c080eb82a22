"""Bad data is never fatal while usable data remains: a shard none of whose samples is usable is
passed over, counted by name, and every good sample still arrives (also across a resume); only a
data set without any usable sample stops the loader, with the counts.  And an image whose decoding
would hold more bytes than data.image.max_decode_bytes is skipped with its reason."""

import io
import json
import os
import shutil
from collections import Counter

import numpy as np
import pytest
from data_helpers import encoded, good, small_data_config, text, write_tar
from PIL import Image

from moevlm.data.errors import DataError
from moevlm.data.loader import build_loader
from moevlm.data.sample import sample_photo_paths
from moevlm.model import VLMConfig

TINY = VLMConfig.preset("tiny")


def bad(key):
    return {"__key__": key, "json": b'{"id": "' + key.encode() + b'", "text": '}  # bad_json


def shards_with(tmp_path, sample_shards, n_good=15, bad_shards=1, per_shard=4):
    """n_good shards of per_shard text samples (one with a photo each) and `bad_shards` shards of
    per_shard unusable ones; returns (shard paths, good sample ids)."""
    photo = encoded(Image.open(sample_photo_paths()[0]).convert("RGB").resize((48, 40)), "PNG")
    paths, ids = [], []
    for i in range(n_good):
        samples = [good(f"p{i}", photo)] + [
            text(f"t{i}-{j}", f"plain text {i} {j}. " * 5) for j in range(per_shard - 1)
        ]
        write_tar(tmp_path / f"good-{i:02d}.tar", samples)
        paths.append(tmp_path / f"good-{i:02d}.tar")
        ids += [s["__key__"] for s in samples]
    for i in range(bad_shards):
        write_tar(tmp_path / f"bad-{i:02d}.tar", [bad(f"b{i}-{j}") for j in range(per_shard)])
        paths.append(tmp_path / f"bad-{i:02d}.tar")
    shutil.copy(sample_shards / "tokenizer.json", tmp_path / "tokenizer.json")
    return [str(p) for p in sorted(paths)], ids


def is_bad(path):
    return os.path.basename(path).startswith("bad")


def config(tmp_path, paths, **kw):
    return small_data_config(",".join(paths), tokenizer=str(tmp_path / "tokenizer.json"), **kw)


def test_an_all_bad_shard_among_sixteen_is_passed_over_and_named(tmp_path, sample_shards):
    """16 shards, 16 streams, one stream's only shard of the epoch unusable: that stream used to stop
    the run (every relaunch at the same step); now it is named and counted and nothing is lost."""
    paths, ids = shards_with(tmp_path, sample_shards)
    loader = build_loader(config(tmp_path, paths, epochs=1), TINY)
    assert loader.streams == 16
    seen = Counter(sid for batch in loader for sid in batch["sample_ids"])
    stats = loader.stats()

    without = build_loader(config(tmp_path, [p for p in paths if not is_bad(p)], epochs=1), TINY)
    reference = Counter(sid for batch in without for sid in batch["sample_ids"])
    assert seen == reference == Counter(ids)  # every good sample, once
    assert stats["shards_all_skipped"] == {"bad-00.tar": 1}
    assert stats["skipped"] == {"bad_json": 4}
    assert stats["samples_read"] == len(ids) + 4 and stats["samples_packed"] == len(ids)
    assert without.stats()["shards_all_skipped"] == {}


def test_a_long_run_of_skips_does_not_stop_a_stream_that_good_shards_follow(
    tmp_path, sample_shards, monkeypatch
):
    """One stream reads a bad shard longer than NO_PROGRESS_SAMPLES (lowered to 5) and then good
    ones: the run of skips only makes it check the data set, which holds usable samples."""
    monkeypatch.setattr("moevlm.data.streams.NO_PROGRESS_SAMPLES", 5)
    paths, ids = shards_with(tmp_path, sample_shards, n_good=2, per_shard=12)
    paths = [p for p in paths if is_bad(p)] + [p for p in paths if not is_bad(p)]
    cfg = config(tmp_path, paths, epochs=1, num_workers=0, streams=1, shuffle_shards=False)
    loader = build_loader(cfg, TINY)
    seen = Counter(sid for batch in loader for sid in batch["sample_ids"])
    assert seen == Counter(ids)
    assert loader.stats()["shards_all_skipped"] == {"bad-00.tar": 1}
    assert loader.stats()["skipped"] == {"bad_json": 12}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_data_set_without_a_usable_sample_stops_with_the_counts(tmp_path, sample_shards, workers):
    paths, _ = shards_with(tmp_path, sample_shards, n_good=0, bad_shards=16, per_shard=3)
    with pytest.raises(DataError) as err:
        next(build_loader(config(tmp_path, paths, num_workers=workers), TINY))
    msg = str(err.value)
    assert msg.startswith("data stream ") and "\n" not in msg, msg
    assert "read 3 samples but could pack none in all of epoch 0: every one was skipped " in msg
    assert (
        "no sample of the whole data set is usable either: 16 shards, 48 samples read, "
        "16 of the 16 shards without a usable sample, skipped: bad_json=48; first: " in msg
    ), msg
    assert msg.endswith("fix the shards (skip reasons: moevlm.data.errors.REASONS)")


def test_shuffle_off_stream_whose_shards_are_all_bad_stops_naming_them(tmp_path, sample_shards):
    """With data.shuffle_shards=false a stream reads the same shards every epoch: one that holds only
    bad shards would read them forever, so it stops naming them (the other streams' data is fine)."""
    paths, _ = shards_with(tmp_path, sample_shards, n_good=3, bad_shards=1)
    cfg = config(tmp_path, paths, num_workers=0, streams=4, shuffle_shards=False)
    loader = build_loader(cfg, TINY)
    with pytest.raises(DataError, match=r"could use no sample of its shards \(bad-00.tar; skipped"):
        for _ in range(100):
            next(loader)


def take(loader, n):
    return [next(loader) for _ in range(n)]


def test_resume_after_the_bad_shard_continues_exactly(tmp_path, sample_shards):
    paths, _ = shards_with(tmp_path, sample_shards)
    cfg = config(tmp_path, paths)  # endless epochs, 2 workers
    first = build_loader(cfg, TINY)
    rows = 0
    while not first.stats()["shards_all_skipped"]:  # the bad shard's stream delivered a row since
        next(first)
        rows += 1
        assert rows < 200
    state = json.loads(json.dumps(first.state_dict()))
    assert first.stats()["shards_all_skipped"] == {"bad-00.tar": 1}
    expected = take(first, 40)
    assert first.stats()["epoch"] >= 1

    resumed = build_loader(cfg, TINY)
    resumed.load_state_dict(state)
    got = take(resumed, 40)
    assert [b["sample_ids"] for b in got] == [b["sample_ids"] for b in expected]
    for a, b in zip(got, expected):
        assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a if hasattr(a[k], "numpy"))
    assert resumed.stats()["shards_all_skipped"] == first.stats()["shards_all_skipped"]
    assert resumed.stats()["skipped"] == first.stats()["skipped"]
    assert resumed.stats()["samples_read"] == first.stats()["samples_read"]


def test_an_image_over_the_decode_byte_budget_is_skipped_and_the_next_arrives(
    tmp_path, sample_shards
):
    """A real 16-bit grey PNG (PIL mode I;16) far under the pixel guard but over a small
    max_decode_bytes: skipped as decode_too_large; an 8-bit RGB image of the same size passes."""
    wide = Image.fromarray((np.arange(48 * 40, dtype=np.uint16) * 31).reshape(40, 48))
    png16 = encoded(wide, "PNG")
    assert Image.open(io.BytesIO(png16)).mode.startswith("I")
    rgb = encoded(Image.open(sample_photo_paths()[0]).convert("RGB").resize((48, 40)), "PNG")
    write_tar(
        tmp_path / "a.tar",
        [good("wide", png16), good("rgb", rgb), text("t", "plain text. " * 5)],
    )
    shutil.copy(sample_shards / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = config(tmp_path, [str(tmp_path / "a.tar")], epochs=1, num_workers=0)
    cfg.image.max_decode_bytes = 48 * 40 * 4 * 2  # twice an 8-bit RGB image of this size
    loader = build_loader(cfg, TINY)
    seen = Counter(sid for batch in loader for sid in batch["sample_ids"])
    assert seen == Counter(["rgb", "t"])
    assert loader.stats()["skipped"] == {"decode_too_large": 1}
    assert loader.stats()["shards_all_skipped"] == {}


def test_empty_shards_are_named_as_empty_not_as_skipped(tmp_path, sample_shards, caplog):
    """Shards with no sample in them (img2dataset writes such tars when every download of a shard
    failed): the data set is refused as empty, and among good shards an empty one is passed over with
    a warning that says it is empty, not "skipped (nothing)"."""
    shards_with(tmp_path, sample_shards, n_good=0, bad_shards=0)  # the tokenizer beside them
    empty = [tmp_path / f"empty-{i}.tar" for i in range(3)]
    for p in empty:
        write_tar(p, [])
    with pytest.raises(DataError) as err:
        next(build_loader(config(tmp_path, [str(p) for p in empty], num_workers=0), TINY))
    msg = str(err.value)
    assert msg.startswith("no shard of the data set holds a sample (3 shards, 0 samples read): ")
    assert "img2dataset" in msg and "nothing" not in msg and "\n" not in msg
    paths, ids = shards_with(tmp_path, sample_shards, n_good=2, bad_shards=0)
    order = [str(empty[0]), *paths]
    cfg = config(tmp_path, order, epochs=1, num_workers=0, streams=1, shuffle_shards=False)
    seen = Counter(sid for batch in build_loader(cfg, TINY) for sid in batch["sample_ids"])
    assert seen == Counter(ids)  # nothing lost
    warned = [r.getMessage() for r in caplog.records if "empty-0.tar" in r.getMessage()]
    assert warned and "it holds no sample" in warned[0] and "(skipped so far: none)" in warned[0]
