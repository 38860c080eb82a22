"""The shard builder's inputs: an annotation file that is a FIFO (or another non-regular file) is one
line saying what it is, exit 2, nothing written and nothing opened; an image the loader would always
skip (a zero side or an aspect ratio above 200: moevlm.data.image.check_image_shape, one rule for both)
is skipped at build time, counted, and listed in the builder's summary."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from PIL import Image

from moevlm.data.build_shards import main
from moevlm.data.errors import SkipSample
from moevlm.data.image import check_image_shape
from moevlm.data.sample import sample_photo_paths


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_non_regular_annotation_file_says_what_it_is(tmp_path, capsys, kind):
    ann = tmp_path / "ann.jsonl"
    os.mkfifo(ann) if kind == "fifo" else ann.mkdir()
    out = tmp_path / "out"
    argv = ["--images", str(tmp_path), "--annotations", str(ann), "--out", str(out)]
    assert main(argv) == 2  # (a FIFO opened for reading would block here)
    what = {"fifo": "a FIFO (named pipe)", "folder": "a folder"}[kind]
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"build_shards: error: annotation file {ann} is {what}, not a regular file: give a file"
    ]
    assert "does not exist" not in captured.err and "Traceback" not in captured.err
    assert not out.exists()


def test_images_the_loader_always_skips_are_skipped_and_counted_at_build_time(tmp_path, capsys):
    images = tmp_path / "images"
    images.mkdir()
    Image.new("L", (65535, 1)).save(images / "line.png")
    Image.new("L", (1, 300)).save(images / "tall.png")
    Image.new("L", (200, 1)).save(images / "edge.png")  # ratio 200: kept, as the loader keeps it
    photo = next(p for p in sample_photo_paths() if p.name == "rocket.jpg")
    shutil.copy(photo, images / "rocket.jpg")
    recs = [
        {"id": name, "image": name, "caption": "a picture"}
        for name in ("line.png", "tall.png", "edge.png", "rocket.jpg")
    ]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "out"
    argv = ["--images", str(images), "--annotations", str(tmp_path / "a.jsonl"), "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples"] == 2 and summary["skipped"] == {"bad_image_size": 2}
    assert "skipped 2 record(s):" in printed
    line = next(x for x in printed.splitlines() if x.strip().startswith("bad_image_size: 2"))
    assert "65535x1: a zero side or an aspect ratio above 200" in line
    # the loader's own rule says the same of these images
    for w, h in ((65535, 1), (1, 300)):
        with pytest.raises(SkipSample) as err:
            check_image_shape(w, h)
        assert err.value.reason == "bad_image_size"
    check_image_shape(200, 1)
