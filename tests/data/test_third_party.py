"""Third-party data: image-text WebDatasets in img2dataset's, DataComp's and the plain image + txt
layouts read directly (data.format), Parquet and Energon folders brought in by the shard builder,
and the builder's progress.  Every layout must give the same images, hence the same image tokens,
as our own builder's shards of the same photos from a caption JSONL, and train with the real
Trainer; images that no record uses are counted, and none usable at all stops the run."""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from data_helpers import small_data_config, write_tar
from PIL import Image

from moevlm.config import compose_job
from moevlm.data import build_shards as bs
from moevlm.data.checks import check_fields
from moevlm.data.errors import DataError, SkipSample
from moevlm.data.layouts import read_record
from moevlm.data.loader import build_loader
from moevlm.data.sample import sample_photo_paths
from moevlm.data.text import ChatEncoder, load_tokenizer
from moevlm.model import VLMConfig
from moevlm.train.report import describe_data
from moevlm.train.trainer import Trainer

TINY = VLMConfig.preset("tiny")
LAYOUTS = ("img2dataset", "datacomp", "image_txt", "parquet", "energon")


def _photos() -> list[tuple[str, bytes]]:
    """(file name, bytes) of four real photos in the formats webdataset users write: the packaged
    JPEG and PNG as they are, one made PNG with alpha, one WebP."""
    by_name = {p.name: p for p in sample_photo_paths()}
    out = [(n, by_name[n].read_bytes()) for n in ("rocket.jpg", "chelsea.png")]
    for name, src, fmt, mode in (
        ("coffee.png", "coffee.png", "PNG", "RGBA"),
        ("astronaut.webp", "astronaut.png", "WEBP", "RGB"),
    ):
        im = Image.open(by_name[src]).convert(mode)
        if mode == "RGBA":
            im.putalpha(Image.linear_gradient("L").resize(im.size))
        buf = io.BytesIO()
        im.save(buf, fmt)
        out.append((name, buf.getvalue()))
    return out


def _third_party_tars(root, photos, tokenizer) -> dict:
    """One folder of shards per layout (two shards each), with the tokenizer beside them."""
    caption = "photo {}"  # as the reference's captions: the same tokens
    layouts = {
        # img2dataset / LAION / CC3M: txt + a metadata json whose caption matches the txt
        "img2dataset": lambda i, ext, data: {
            ext: data,
            "txt": caption.format(i).encode(),
            "json": json.dumps(
                {
                    "caption": caption.format(i),
                    "url": f"http://x/{i}",
                    "width": 1,
                    "key": f"{i:09d}",
                }
            ).encode(),
        },
        # DataComp: the caption is the metadata json's `text`, no txt
        "datacomp": lambda i, ext, data: {
            ext: data,
            "json": json.dumps({"text": caption.format(i), "uid": f"{i:032x}"}).encode(),
        },
        # plain image + txt, the jpg written as .jpeg
        "image_txt": lambda i, ext, data: {
            ("jpeg" if ext == "jpg" else ext): data,
            "txt": caption.format(i).encode(),
        },
    }
    out = {}
    for name, members in layouts.items():
        folder = root / name
        folder.mkdir()
        samples = [
            {"__key__": f"{i:09d}", **members(i, n.rsplit(".", 1)[1], data)}
            for i, (n, data) in enumerate(photos)
        ]
        write_tar(folder / "part-000000.tar", samples[:2])
        write_tar(folder / "part-000001.tar", samples[2:])
        shutil.copy(tokenizer, folder / "tokenizer.json")
        out[name] = folder
    return out


def _parquet(root, photos) -> list:
    """A Hugging Face style Parquet file: an Image struct column {bytes, path} and chat messages
    whose user content is a list of parts."""
    rows = [
        {
            "id": f"pq{i}",
            "image": {"bytes": data, "path": n},
            "messages": [
                {"role": "user", "content": [{"type": "image"}]},
                {"role": "assistant", "content": [{"type": "text", "text": f"photo {i}"}]},
            ],
        }
        for i, (n, data) in enumerate(photos)
    ]
    path = root / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return [path]


def _energon(root, photos, sample_type="CaptioningSample"):
    """An Energon-prepared folder as `energon prepare` leaves it: tars plus .nv-meta yaml files."""
    folder = root / "energon"
    (folder / ".nv-meta").mkdir(parents=True)
    (folder / "parts").mkdir()
    samples = [
        {
            "__key__": f"s{i}",
            n.rsplit(".", 1)[1]: data,
            "json": json.dumps({"caption": f"photo {i}", "source": "x"}).encode(),
        }
        for i, (n, data) in enumerate(photos)
    ]
    write_tar(folder / "parts/data-0.tar", samples[:2])
    write_tar(folder / "parts/data-1.tar", samples[2:])
    exts = sorted({n.rsplit(".", 1)[1] for n, _ in photos})
    (folder / ".nv-meta/dataset.yaml").write_text(
        "sample_type:\n  __module__: megatron.energon\n"
        f"  __class__: {sample_type}\n"
        f"field_map:\n  image: {','.join(exts)}\n  caption: json[caption]\n"
    )
    (folder / ".nv-meta/split.yaml").write_text(
        "split_parts:\n  train:\n    - parts/data-{0..1}.tar\n  val: []\nexclude: []\n"
    )
    (folder / ".nv-meta/.info.yaml").write_text(
        "shard_counts:\n  parts/data-0.tar: 2\n  parts/data-1.tar: 2\n"
    )
    return folder


@pytest.fixture(scope="module")
def data_sets(tmp_path_factory, sample_shards):
    """Every layout's shards, and the reference: our builder on a caption JSONL of the same photos."""
    root = tmp_path_factory.mktemp("third_party")
    tokenizer = sample_shards / "tokenizer.json"
    photos = _photos()
    images = root / "images"
    images.mkdir()
    for n, data in photos:
        (images / n).write_bytes(data)
    caps = root / "caps.jsonl"
    caps.write_text(
        "\n".join(
            json.dumps({"image": n, "caption": f"photo {i}"}) for i, (n, _) in enumerate(photos)
        )
    )
    sets = _third_party_tars(root, photos, tokenizer)
    common = ["--samples-per-shard", "2", "--tokenizer", str(tokenizer)]
    argv = {
        "reference": ["--images", str(images), "--annotations", str(caps)],
        "parquet": ["--parquet", *map(str, _parquet(root, photos))],
        "energon": ["--energon", str(_energon(root, photos))],
    }
    for name, args in argv.items():
        assert bs.main([*args, "--out", str(root / name), *common]) == 0, name
        sets[name] = root / name
    return sets, photos


def _read_all(folder, **kw) -> dict:
    """One epoch through the loader in the training process: samples read, images packed, tokens
    packed, image tokens in the packed rows, and the stats."""
    cfg = small_data_config(folder, num_workers=0, epochs=1, shuffle_buffer=0, **kw)
    loader = build_loader(cfg, TINY)
    pad = ChatEncoder(load_tokenizer(loader.tokenizer_path)).image_pad_id
    image_tokens = tokens = 0
    for row in loader:
        image_tokens += int((row["input_ids"] == pad).sum())
        tokens += int(row["cu_seqlens"][row["num_samples"]])
    st = loader.stats()
    loader.close()
    return {
        "samples_read": st["samples_read"],
        "images_packed": st["images_packed"],
        "tokens_packed": tokens,
        "image_tokens": image_tokens,
        "stats": st,
    }


@pytest.fixture
def one_thread():
    """The tiny model gains nothing from more threads, and on a shared 2-core machine they fight:
    the five 3-step runs took over a minute with torch's default threads beside other work, under
    10 s with one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_every_layout_gives_our_builders_image_tokens_and_trains(data_sets, tmp_path, one_thread):
    sets, photos = data_sets
    ref = _read_all(sets["reference"])
    assert ref["images_packed"] == len(photos) and ref["image_tokens"] > 0
    figures = {"reference": ref}
    for name in LAYOUTS:
        got = figures[name] = _read_all(sets[name])
        assert got["samples_read"] == len(photos), name
        assert got["images_packed"] == len(photos), name
        assert got["image_tokens"] == ref["image_tokens"], name
        assert got["tokens_packed"] == ref["tokens_packed"], name
        assert got["stats"]["skipped"] == {} and got["stats"]["fell_back"] == {}, name
    # the figures per layout (pytest -s shows them)
    for name, f in figures.items():
        print(
            f"{name}: {f['samples_read']} samples read, {f['images_packed']} images packed, "
            f"{f['tokens_packed']} tokens packed ({f['image_tokens']} image tokens)"
        )
    # 3 steps with the real trainer and the default settings (data.format=auto) on each layout;
    # no worker processes, to keep it short
    for name in LAYOUTS:
        run_dir = tmp_path / name
        job = compose_job(
            ["data.num_workers=0", "train.steps=3", f"train.run_dir={run_dir}"]
            + [f"data.shards={sets[name]}", "train.checkpoint_every=0"]
        )
        trainer = Trainer(job)
        assert trainer.run() == 0, name
        st = trainer.loader.stats()
        assert st["images_packed"] > 0 and st["fell_back"] == {}, name
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines][-1] == 3, name


def test_which_record_each_format_reads():
    meta = json.dumps({"text": "a caption", "uid": "u1", "width": 3}).encode()
    raw = {"__key__": "k", "json": meta, "jpg": b"x", "png": b"y"}
    rec, unused = read_record(raw, "auto")
    assert (rec.kind, rec.images, rec.caption, rec.id, unused) == (
        "caption",
        ["jpg"],
        "a caption",
        "k",
        ["png"],
    )
    # moevlm: the json as our record, a text sample; both images unused
    rec, unused = read_record(raw, "moevlm")
    assert (rec.kind, rec.text, unused) == ("text", "a caption", ["jpg", "png"])
    # txt wins over the json's caption; a json naming its images is ours under auto
    rec, _ = read_record({**raw, "txt": b"from txt"}, "image_caption")
    assert rec.caption == "from txt"
    ours = {"id": "o", "images": ["img0.webp"], "caption": "ours"}
    rec, unused = read_record({"__key__": "k", "json": json.dumps(ours).encode(), "img0.webp": b""})
    assert (rec.id, rec.images, unused) == ("o", ["img0.webp"], [])
    with pytest.raises(SkipSample, match="no caption: no txt member"):
        read_record({"__key__": "k", "json": b'{"url": "u"}', "webp": b""}, "image_caption")


def test_images_no_record_uses_are_counted_and_none_usable_stops(data_sets, tmp_path, caplog):
    sets, photos = data_sets
    # data.format=moevlm reads DataComp's metadata json as a text record: the sample trains as text,
    # counted as images_unused; our own shards beside them still give images, so the run goes on
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for name in ("datacomp", "reference"):
        for i, p in enumerate(sorted(sets[name].glob("*.tar"))):
            shutil.copy(p, mixed / f"{name}-{i}.tar")
    shutil.copy(sets["reference"] / "tokenizer.json", mixed)
    with caplog.at_level(logging.WARNING, logger="moevlm.data.loader"):
        got = _read_all(mixed, format="moevlm")
    assert re.search(
        r"trains without its image member\(s\) \['\w+'\], which its record", caplog.text
    )
    assert got["stats"]["fell_back"] == {"images_unused": len(photos)}
    assert got["images_packed"] == len(photos) and got["samples_read"] == 2 * len(photos)
    assert "skipped: none; trained without their images: images_unused 4" in describe_data(
        got["stats"]
    )
    # DataComp alone read that way: images everywhere, none usable -> the run stops, saying why
    with pytest.raises(DataError) as err:
        _read_all(sets["datacomp"], format="moevlm")
    msg = str(err.value)
    assert "carrying images and could use none of their images (" in msg
    assert "images_unused=" in msg and "data.format=auto or image_caption" in msg
    # images present but every one broken (skipped) while text samples train: the same stop
    broken = tmp_path / "broken"
    broken.mkdir()
    write_tar(
        broken / "b.tar",
        [{"__key__": f"{i}", "jpg": b"\xff\xd8 not a jpeg", "txt": b"a photo"} for i in range(3)]
        + [{"__key__": f"t{i}", "json": json.dumps({"text": "words"}).encode()} for i in range(2)],
    )
    shutil.copy(sets["reference"] / "tokenizer.json", broken)
    with pytest.raises(DataError, match=r"could use none of their images \(.*fix the images"):
        _read_all(broken)
    # an unknown layout name is a config error listing the values
    with pytest.raises(ValueError, match="data.format='webdataset' is invalid: set it to 'auto', "):
        check_fields(small_data_config(tmp_path, format="webdataset"))


def test_builder_counts_bad_parquet_rows_and_energon_samples(data_sets, tmp_path, capsys):
    _, photos = data_sets
    (n0, jpg), (n1, png) = photos[:2]
    rows = [
        {"image": {"bytes": jpg, "path": None}, "caption": "good"},
        {"image": {"bytes": b"garbage", "path": None}, "caption": "not an image"},
        {"image": {"bytes": None, "path": n1}, "caption": "a path, no --images"},
        {"image": {"bytes": png, "path": None}, "caption": None},
        {"image": None, "caption": "text without an image"},
    ]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    out = tmp_path / "pq"
    assert bs.main(["--parquet", str(path), "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["samples"] == 1 and s["kinds"] == {"chat": 0, "caption": 1, "text": 0}
    assert s["skipped"] == {"bad_record": 2, "missing_image": 1, "not_an_image": 1}
    # a relative path with no --images: looked for beside the Parquet file
    assert "(chelsea.png) does not exist" in s["skipped_examples"]["missing_image"][0]
    # a row group whose page header is damaged: counted, the other group's rows written
    two = tmp_path / "two.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"image": jpg, "text": f"t{i}"} for i in range(4)]),
        two,
        row_group_size=2,
    )
    col = pq.ParquetFile(two).metadata.row_group(1).column(0)
    start = col.dictionary_page_offset or col.data_page_offset
    with open(two, "r+b") as f:
        f.seek(start)
        f.write(b"\xff" * 8)
    assert bs.main(["--parquet", str(two), "--out", str(tmp_path / "two")]) == 0
    s = json.loads((tmp_path / "two/summary.json").read_text())
    assert s["samples"] == 2 and s["skipped"] == {"unreadable_input": 1}
    assert s["skipped_examples"]["unreadable_input"][0].startswith("two.parquet: row group 1: ")
    # setup errors stop before anything is written, as one line; without pyarrow it names the extra
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "pyarrow.parquet", None)
        assert bs.main(["--parquet", str(path), "--out", str(tmp_path / "x")]) == 2
    assert "pip install 'moevlm[parquet]'" in capsys.readouterr().err
    (tmp_path / "no.parquet").write_bytes(b"PAR1 not really")
    assert bs.main(["--parquet", str(tmp_path / "no.parquet"), "--out", str(tmp_path / "x")]) == 2
    assert "is not a readable Parquet file" in capsys.readouterr().err
    # Energon: a sample whose json lacks the mapped field is skipped, an excluded one left out
    folder = _energon(tmp_path, photos)
    write_tar(folder / "parts/data-1.tar", [{"__key__": "bad", "jpg": jpg, "json": b"{}"}])
    split = folder / ".nv-meta/split.yaml"
    split.write_text(split.read_text().replace("exclude: []", "exclude: [parts/data-0.tar/s0]"))
    out = tmp_path / "en"
    assert bs.main(["--energon", str(folder), "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["samples"] == 1 and s["skipped"] == {"bad_record": 1}
    assert s["args"]["energon"] == str(folder) and s["args"]["split"] == "train"
    assert bs.main(["--energon", str(folder), "--split", "test", "--out", str(out)]) == 2
    assert "has no split 'test'; it has ['train', 'val']" in capsys.readouterr().err
    # the older dataset.yaml form: a top-level __class__ naming the dataset class
    legacy = _energon(tmp_path / "legacy", photos)
    meta = legacy / ".nv-meta/dataset.yaml"
    meta.write_text(
        "__module__: megatron.energon\n__class__: CaptioningWebdataset\n"
        + meta.read_text().split("\n", 3)[3]
    )
    assert bs.main(["--energon", str(legacy), "--out", str(tmp_path / "lo")]) == 0
    assert json.loads((tmp_path / "lo/summary.json").read_text())["samples"] == len(photos)
    other = _energon(tmp_path / "o", photos, sample_type="InterleavedSample")
    assert bs.main(["--energon", str(other), "--out", str(tmp_path / "o2")]) == 2
    assert "sample type 'InterleavedSample' is not read; supported:" in capsys.readouterr().err


def test_builder_progress_is_plain_lines_without_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(bs, "PROGRESS_EVERY_S", 0.0)
    assert list(bs.show_progress(iter(range(4)), 4, None)) == [0, 1, 2, 3]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4 and lines[1].startswith("build_shards: 2/4 records (50%) in ")
    assert lines[1].endswith(" s") and "/s, ETA " in lines[1]
    assert list(bs.show_progress(iter(range(2)), None, None)) == [0, 1]
    assert capsys.readouterr().err.splitlines()[-1].startswith("build_shards: 2 records in ")
    assert list(bs.show_progress(iter(range(2)), 2, False)) == [0, 1]
    assert capsys.readouterr().err == ""
