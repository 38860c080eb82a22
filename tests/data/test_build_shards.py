"""build_shards on real photos: round trip through the tars, per-shard counts,
byte determinism, every skip reason counted, summary.json, the CLI and --sample;
image paths confined to --images, byte caps checked before reading, hostile
records skipped without stopping the build or leaving a .tmp shard."""

import json
import os
import shutil
import sys
import tarfile
import types
from pathlib import Path

import pytest
from webdataset.tariterators import group_by_keys, tar_file_expander

from moevlm.data.build_shards import build_shards, load_image, main, read_annotations
from moevlm.data.errors import SkipCounter
from moevlm.data.records import normalize_record
from moevlm.data.sample import sample_photo_paths

PHOTOS = {p.name: p for p in sample_photo_paths()}


@pytest.fixture
def dataset(tmp_path):
    """An images folder (good and broken files) and annotation files naming them."""
    images = tmp_path / "images"
    (images / "sub").mkdir(parents=True)
    shutil.copy(PHOTOS["rocket.jpg"], images / "rocket.JPEG")
    shutil.copy(PHOTOS["chelsea.png"], images / "sub" / "cat.png")
    shutil.copy(PHOTOS["coffee.png"], images / "coffee.png")
    shutil.copy(PHOTOS["camera.png"], images / "camera.png")
    (images / "empty.jpg").write_bytes(b"")
    (images / "text.jpg").write_bytes(b"this is not an image\n")
    (images / "cut.jpg").write_bytes(PHOTOS["rocket.jpg"].read_bytes()[:40_000])
    (images / "cut.png").write_bytes(PHOTOS["coffee.png"].read_bytes()[:100_000])

    def conv(*turns):
        return [{"from": r, "value": v} for r, v in zip(("human", "gpt") * 4, turns)]

    llava = [
        {
            "id": "a.1",
            "image": ["rocket.JPEG", "sub/cat.png"],
            "conversations": conv(
                "<image>\n<image>\nCompare.", "A rocket, a cat.", "Which is older?", "The cat."
            ),
        },
        {"id": "b", "image": "coffee.png", "conversations": conv("What is this?", "Coffee.")},
        {
            "id": "c",
            "conversations": [{"from": "system", "value": "Be brief."}] + conv("2+2?", "4"),
        },
        {"id": "tags", "image": "coffee.png", "conversations": conv("<image><image>", "x")},
        {"id": "role", "conversations": [{"from": "robot", "value": "beep"}]},
        {"id": "miss", "image": "missing.jpg", "conversations": conv("<image>", "x")},
        {"id": "empty", "image": "empty.jpg", "conversations": conv("<image>", "x")},
        {"id": "text", "image": "text.jpg", "conversations": conv("<image>", "x")},
        {"id": "cutjpg", "image": "cut.jpg", "conversations": conv("<image>", "x")},
        {"id": "cutpng", "image": "cut.png", "conversations": conv("<image>", "x")},
        {
            "id": "up",
            "image": "sub/../camera.png",
            "conversations": conv("<image>Who?", "A man."),
        },  # stays inside
    ]
    (tmp_path / "llava.json").write_text(json.dumps(llava))
    lines = [
        json.dumps({"image": "sub/cat.png", "caption": "A cat."}).encode(),
        b"{not json",
        b"",
        json.dumps({"id": "dup", "image": "rocket.JPEG", "text": "A rocket."}).encode(),
        json.dumps({"id": "dup", "text": "Plain text ü."}, ensure_ascii=False).encode(),
        b'{"text": "\xff"}',
    ]
    (tmp_path / "caps.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return tmp_path, images, [tmp_path / "llava.json", tmp_path / "caps.jsonl"]


def build(dataset, out, per_shard=3, **kw):
    root, images, anns = dataset
    skips = SkipCounter()
    return build_shards(read_annotations(anns, skips), images, out, per_shard, skips=skips, **kw)


def read_tar(path: Path) -> dict[str, dict[str, bytes]]:
    with tarfile.open(path) as tar:
        samples: dict[str, dict[str, bytes]] = {}
        for m in tar.getmembers():
            key, field = m.name.split(".", 1)
            samples.setdefault(key, {})[field] = tar.extractfile(m).read()
    return samples


def read_all(out: Path) -> dict[str, dict[str, bytes]]:
    samples = {}
    for shard in sorted(out.glob("shard-*.tar")):
        samples.update(read_tar(shard))
    return samples


EXPECTED_IDS = ["a.1", "b", "c", "up", "caps.jsonl:1", "dup", "dup"]


def test_round_trip(dataset, tmp_path):
    root, images, _ = dataset
    build(dataset, tmp_path / "out")
    samples = read_all(tmp_path / "out")
    assert list(samples) == [f"{i:09d}" for i in range(7)]
    docs = [json.loads(s["json"]) for s in samples.values()]
    assert [d["id"] for d in docs] == EXPECTED_IDS
    for s, d in zip(samples.values(), docs):
        assert (
            s["json"]
            == json.dumps(d, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
        )
        # canonical: the reader's normaliser is a no-op on it
        assert normalize_record(d).canonical() == d
        assert sorted(s) == sorted(["json"] + d.get("images", []))
    a1, b, c, up, cap, cap2, text = samples.values()
    assert docs[0]["images"] == ["img0.jpg", "img1.png"]  # .JPEG -> jpg
    assert (
        a1["img0.jpg"] == PHOTOS["rocket.jpg"].read_bytes()
        and a1["img1.png"] == PHOTOS["chelsea.png"].read_bytes()
    )
    assert len(docs[0]["messages"]) == 4
    assert docs[1]["messages"][0] == {
        "role": "user",
        "content": "<image>\nWhat is this?",
    }  # tag prepended
    assert b["img0.png"] == PHOTOS["coffee.png"].read_bytes()
    assert (
        docs[2]["images"] == []
        and sorted(c) == ["json"]
        and docs[2]["messages"][0]["role"] == "system"
    )
    assert up["img0.png"] == PHOTOS["camera.png"].read_bytes()
    assert docs[4] == {"id": "caps.jsonl:1", "images": ["img0.png"], "caption": "A cat."}
    assert docs[5] == {"id": "dup", "images": ["img0.jpg"], "caption": "A rocket."}
    assert docs[6] == {"id": "dup", "text": "Plain text ü."} and sorted(text) == ["json"]


def test_webdataset_reads_the_shards(dataset, tmp_path):
    build(dataset, tmp_path / "out")
    samples = []
    for url in sorted((tmp_path / "out").glob("*.tar")):
        with open(url, "rb") as f:
            samples += group_by_keys(tar_file_expander([{"url": str(url), "stream": f}]))
    assert [json.loads(s["json"])["id"] for s in samples] == EXPECTED_IDS
    assert samples[0]["img1.png"] == PHOTOS["chelsea.png"].read_bytes()


def test_skip_reasons_and_summary(dataset, tmp_path):
    summary = build(dataset, tmp_path / "out", build_args={"note": "t"})
    assert summary["skipped"] == {
        "bad_image": 2,
        "bad_json": 1,
        "bad_record": 1,
        "bad_text_encoding": 1,
        "empty_image": 1,
        "image_tag_mismatch": 1,
        "missing_image": 1,
        "not_an_image": 1,
    }
    ex = summary["skipped_examples"]
    assert ex["bad_json"][0].startswith("caps.jsonl:2: ") and ex["bad_text_encoding"][0].startswith(
        "caps.jsonl:6"
    )
    assert ex["missing_image"] == [
        "llava.json[5]: image path #0 of record 'miss' (missing.jpg) does not exist"
    ]
    assert {e.split(":")[0] for e in ex["bad_image"]} == {"llava.json[8]", "llava.json[9]"}
    assert summary["samples"] == 7 and summary["kinds"] == {"chat": 4, "caption": 2, "text": 1}
    assert (
        summary["images"] == 6
        and summary["duplicate_ids"] == 1
        and summary["duplicate_id_examples"] == ["dup"]
    )
    assert summary["shards"] == [
        {"name": "shard-000000.tar", "samples": 3},
        {"name": "shard-000001.tar", "samples": 3},
        {"name": "shard-000002.tar", "samples": 1},
    ]
    for entry in summary["shards"]:
        assert len(read_tar(tmp_path / "out" / entry["name"])) == entry["samples"]
    assert summary["bytes"] == sum(p.stat().st_size for p in (tmp_path / "out").glob("*.tar"))
    assert summary["args"]["samples_per_shard"] == 3 and summary["args"]["note"] == "t"
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == [e["name"] for e in summary["shards"]] + ["summary.json"]


def test_byte_deterministic_across_runs_and_thread_counts(dataset, tmp_path):
    build(dataset, tmp_path / "one", workers=1)
    build(dataset, tmp_path / "two", workers=4)
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), (
            name
        )


def test_refuses_existing_shards_unless_overwrite(dataset, tmp_path):
    out = tmp_path / "out"
    assert len(build(dataset, out, per_shard=1)["shards"]) == 7
    with pytest.raises(FileExistsError, match="--overwrite"):
        build(dataset, out)
    build(dataset, out, per_shard=4, overwrite=True)
    assert sorted(p.name for p in out.glob("*.tar")) == [
        "shard-000000.tar",
        "shard-000001.tar",
    ]  # no stale ones


def test_caption_prompt_is_baked_into_a_chat(dataset, tmp_path):
    build(dataset, tmp_path / "out", caption_prompt="Describe the image.")
    doc = json.loads(read_all(tmp_path / "out")["000000004"]["json"])
    assert doc == {
        "id": "caps.jsonl:1",
        "images": ["img0.png"],
        "messages": [
            {"role": "user", "content": "<image>\nDescribe the image."},
            {"role": "assistant", "content": "A cat."},
        ],
    }


def test_cli(dataset, tmp_path, capsys):
    root, images, anns = dataset
    argv = [
        "--images",
        str(images),
        "--annotations",
        *map(str, anns),
        "--out",
        str(tmp_path / "out"),
        "--samples-per-shard",
        "2",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert (
        "wrote 7 samples (chat 4, caption 2, text 1), 6 images" in printed
        and "4 shard(s)" in printed
    )
    assert "bad_json: 1   e.g. caps.jsonl:2" in printed and "duplicate ids (kept): 1" in printed
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["args"]["annotations"] == [str(a) for a in anns]
    assert main(argv) == 2 and "--overwrite" in capsys.readouterr().err
    assert main(argv[:-2] + ["--annotations", str(root / "nope.jsonl"), "--overwrite"]) == 2
    assert "nope.jsonl does not exist" in capsys.readouterr().err


def test_bad_json_list_file_is_a_readable_setup_error(tmp_path, capsys):
    (tmp_path / "a.json").write_text('{"id": "x"}')
    with pytest.raises(ValueError, match="must hold a list"):
        list(read_annotations([tmp_path / "a.json"], SkipCounter()))
    argv = [
        "--images",
        str(tmp_path),
        "--annotations",
        str(tmp_path / "a.json"),
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(argv) == 2 and "does not start with '['" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # checked before anything is written


def test_nothing_usable_writes_no_shards(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text("nope\n")
    argv = [
        "--images",
        str(tmp_path),
        "--annotations",
        str(tmp_path / "a.jsonl"),
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(argv) == 1
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["shards"] == []


def test_sample_mode(tmp_path, monkeypatch, capsys):
    """--sample with a stand-in moevlm.data.sample: >= 8 shards and tokenizer.json."""
    photos = list(PHOTOS.values())
    records = [
        {"id": f"s{i}", "images": [str(photos[i % len(photos)])], "caption": f"photo {i}"}
        for i in range(40)
    ]
    records += [{"id": f"t{i}", "text": f"text {i}"} for i in range(30)]

    class Tok:
        def save(self, path):
            Path(path).write_text("{}")

    fake = types.ModuleType("moevlm.data.sample")
    fake.sample_records, fake.sample_tokenizer = lambda: records, Tok
    monkeypatch.setitem(sys.modules, "moevlm.data.sample", fake)
    assert main(["--sample", str(tmp_path / "s")]) == 0
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert summary["args"]["samples_per_shard"] == 8 and len(summary["shards"]) == 9
    assert summary["images"] == 40 and summary["kinds"]["text"] == 30 and summary["skipped"] == {}
    assert (tmp_path / "s" / "tokenizer.json").exists()
    # image records are spread over all shards, not packed into the first
    for entry in summary["shards"]:
        assert any(
            "images" in json.loads(s["json"])
            for s in read_tar(tmp_path / "s" / entry["name"]).values()
        )
    assert "sample set: 40 images, 30 text samples, 9 shards" in capsys.readouterr().out
    # --images-only: the 40 records with photos, one per shard; and only together with --sample
    assert main(["--sample", str(tmp_path / "i"), "--images-only"]) == 0
    summary = json.loads((tmp_path / "i" / "summary.json").read_text())
    assert (
        summary["kinds"]["text"] == 0 and summary["images"] == 40 and len(summary["shards"]) == 40
    )
    assert summary["args"]["images_only"] is True
    with pytest.raises(SystemExit):
        main(["--images-only", "--out", str(tmp_path / "x")])
    assert "--images-only goes with --sample OUT" in capsys.readouterr().err


def test_real_sample_set(tmp_path):
    """The bundled sample set builds cleanly into >= 8 shards with a loadable tokenizer."""
    pytest.importorskip("moevlm.data.sample")
    from tokenizers import Tokenizer

    assert main(["--sample", str(tmp_path / "s")]) == 0
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert summary["skipped"] == {} and len(summary["shards"]) >= 8 and summary["images"] > 0
    assert Tokenizer.from_file(str(tmp_path / "s" / "tokenizer.json")).get_vocab_size() > 0


def test_formats_the_reader_refuses_are_not_written(tmp_path):
    """A real photo saved as ICO is an image PIL opens, but not one the reader
    accepts (image.allowed_formats): the builder counts it instead of writing it."""
    from PIL import Image

    Image.open(PHOTOS["chelsea.png"]).resize((64, 64)).save(tmp_path / "cat.ico")
    shutil.copy(PHOTOS["coffee.png"], tmp_path / "coffee.png")
    summary = build_shards(
        [
            {"id": "ico", "image": "cat.ico", "caption": "a cat"},
            {"id": "ok", "image": "coffee.png", "caption": "coffee"},
        ],
        tmp_path,
        tmp_path / "out",
        progress=False,
    )
    assert summary["skipped"] == {"not_an_image": 1} and summary["samples"] == 1


def no_tmp(out: Path) -> bool:
    return not list(out.glob("*.tmp"))


SECRET = b"API_KEY=sk-live-0123456789abcdef"


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    """An images folder with good files and symlinks, a private folder beside it
    holding a valid PPM image whose pixels are an API key, and ~ pointing there."""
    images, private = tmp_path / "images", tmp_path / "private"
    (images / "sub").mkdir(parents=True)
    private.mkdir()
    shutil.copy(PHOTOS["coffee.png"], images / "good.png")
    shutil.copy(PHOTOS["chelsea.png"], images / "sub" / "cat.png")
    (private / "secret.ppm").write_bytes(b"P5\n%d 1\n255\n" % len(SECRET) + SECRET)
    (images / "link.ppm").symlink_to(private / "secret.ppm")
    (images / "linkdir").symlink_to(private, target_is_directory=True)
    (images / "inside_link.png").symlink_to("good.png")
    (images / "insidedir").symlink_to("sub", target_is_directory=True)
    os.mkfifo(images / "fifo.png")
    monkeypatch.setenv("HOME", str(private))
    return tmp_path, images, private


def test_image_paths_stay_inside_images_and_secrets_stay_out(hostile, capsys):
    """Absolute, ~, '..' and symlinked paths out of --images are skipped as
    outside_images; the secret's bytes and its path appear in no shard, in
    summary.json or in the output; odd records around them cost only themselves."""
    tmp_path, images, private = hostile
    # a valid image
    assert SECRET in load_image("secret.ppm", Path(os.path.realpath(private)), 1 << 20)[0]
    cap = {"caption": "x"}
    escapes = [
        str(private / "secret.ppm"),
        "../private/secret.ppm",
        "~/secret.ppm",
        "link.ppm",
        "linkdir/secret.ppm",
        "sub/../../private/secret.ppm",
    ]
    lines = [json.dumps({"id": "good", "image": "good.png", **cap})]
    lines += [json.dumps({"id": f"esc{i}", "image": p, **cap}) for i, p in enumerate(escapes)]
    lines += [
        json.dumps({"id": "in1", "image": "inside_link.png", **cap}),
        json.dumps({"id": "in2", "image": "insidedir/cat.png", **cap}),
        json.dumps({"id": "long", "image": "a" * 300 + ".png", **cap}),  # ENAMETOOLONG
        "[" * 200_000,  # RecursionError in json.loads
        json.dumps({"id": "int", "image": [1], **cap}),
        json.dumps({"id": "nul", "image": "x\u0000.png", **cap}),
        json.dumps({"id": "fifo", "image": "fifo.png", **cap}),  # not a file: skipped, never opened
        json.dumps({"id": "text", "text": "plain"}),
    ]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    argv = [
        "--images",
        str(images),
        "--annotations",
        str(tmp_path / "a.jsonl"),
        "--out",
        str(out),
        "--workers",
        "2",
    ]
    assert main(argv) == 0
    printed = "".join(capsys.readouterr())
    summary_text = (out / "summary.json").read_text()
    summary = json.loads(summary_text)
    assert summary["skipped"] == {
        "outside_images": 6,
        "missing_image": 2,
        "bad_json": 1,
        "bad_record": 2,
    }
    assert summary["samples"] == 4 and summary["images"] == 3
    assert [json.loads(s["json"])["id"] for s in read_all(out).values()] == [
        "good",
        "in1",
        "in2",
        "text",
    ]
    ex = summary["skipped_examples"]["outside_images"]
    relative = "image paths are relative to --images"
    assert ex[:3] == [
        f"a.jsonl:2: image path #0 of record 'esc0' is absolute; {relative}",
        "a.jsonl:3: image path #0 of record 'esc1' leaves --images (through '..' or a symlink)",
        f"a.jsonl:4: image path #0 of record 'esc2' starts with '~'; {relative}",
    ]
    assert "File name too long" in summary["skipped_examples"]["missing_image"][0]
    shard_bytes = b"".join(p.read_bytes() for p in out.glob("*.tar"))
    for text in (summary_text, printed):
        assert "API_KEY" not in text and "secret" not in text and str(private) not in text
    assert SECRET not in shard_bytes and b"API_KEY" not in shard_bytes
    assert no_tmp(out)


def test_deep_json_list_file_stops_the_build_cleanly(tmp_path, capsys):
    """A .json list is one document: a record nested too deep for the parser is a
    setup error with a clear message (no traceback), and no .tmp shard is left."""
    shutil.copy(PHOTOS["coffee.png"], tmp_path / "good.png")
    (tmp_path / "a.jsonl").write_text(json.dumps({"image": "good.png", "caption": "c"}) + "\n")
    (tmp_path / "b.json").write_text('[{"text": "t"}, ' + "[" * 200_000 + "]" * 200_000 + "]")
    out = tmp_path / "out"
    argv = [
        "--images",
        str(tmp_path),
        "--annotations",
        str(tmp_path / "a.jsonl"),
        str(tmp_path / "b.json"),
        "--out",
        str(out),
        "--workers",
        "1",
    ]  # one thread: the first sample is written before b.json fails
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "b.json nests JSON arrays/objects deeper than the parser allows" in err
        and "Traceback" not in err
    )
    assert no_tmp(out) and not (out / "summary.json").exists()

    def records():  # any exception out of the records also leaves no .tmp
        yield {"image": "good.png", "caption": "c"}
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        build_shards(records(), tmp_path, out, overwrite=True, workers=1, progress=False)
    assert no_tmp(out)


def _rchar() -> int:
    """Bytes this process (all threads) has read through read() system calls."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(
    not Path("/proc/self/io").exists(), reason="counts bytes read with Linux /proc/self/io"
)
def test_image_over_the_byte_cap_is_skipped_unread(tmp_path):
    """A sparse 4 GiB 'PNG' is refused from its size: the process reads far less
    than the file (any whole read, in one go or in pieces, would add 4 GiB).
    The cap is exact: a file of exactly max_image_bytes is kept."""
    shutil.copy(PHOTOS["coffee.png"], tmp_path / "good.png")
    with open(tmp_path / "huge.png", "wb") as f:
        f.write(PHOTOS["coffee.png"].read_bytes()[:4096])
        f.truncate(4 << 30)
    records = [
        {"id": "huge", "image": "huge.png", "caption": "c"},
        {"id": "good", "image": "good.png", "caption": "c"},
    ]
    before = _rchar()
    summary = build_shards(records, tmp_path, tmp_path / "out", workers=2, progress=False)
    assert _rchar() - before < 32 << 20
    assert summary["skipped"] == {"file_too_large": 1} and summary["samples"] == 1
    assert summary["skipped_examples"]["file_too_large"] == [
        f"record[0]: image path #0 of record 'huge' (huge.png) has {4 << 30} bytes, above --max-image-bytes 33554432"
    ]
    size = (tmp_path / "good.png").stat().st_size
    for cap, kept in ((size, 1), (size - 1, 0)):
        s = build_shards(
            records[1:],
            tmp_path,
            tmp_path / "out",
            max_image_bytes=cap,
            overwrite=True,
            progress=False,
        )
        assert (
            s["samples"] == kept
            and s["args"]["max_image_bytes"] == cap
            and no_tmp(tmp_path / "out")
        )


def test_text_over_the_byte_cap_is_skipped(tmp_path, capsys):
    """--max-text-bytes counts UTF-8 bytes of the text or of all messages; a
    JSONL line far over it is skipped without being parsed or held, and the
    lines after it keep their numbers."""
    lines = [
        {"id": "at_cap", "text": "ü" * 50},  # 100 bytes
        {"id": "over", "text": "ü" * 50 + "x"},
        {
            "id": "chat",
            "messages": [
                {"role": "user", "content": "q" * 60},
                {"role": "assistant", "content": "a" * 41},
            ],
        },
        {"id": "huge", "text": "y" * (6 * 100 + 70_000)},
        {"id": "last", "text": "fine"},
    ]
    (tmp_path / "t.jsonl").write_text(
        "\n".join(json.dumps(r, ensure_ascii=False) for r in lines) + "\n"
    )
    argv = [
        "--images",
        str(tmp_path),
        "--annotations",
        str(tmp_path / "t.jsonl"),
        "--out",
        str(tmp_path / "out"),
        "--max-text-bytes",
        "100",
    ]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["skipped"] == {"text_too_large": 3} and summary["samples"] == 2
    assert [json.loads(s["json"])["id"] for s in read_all(tmp_path / "out").values()] == [
        "at_cap",
        "last",
    ]
    # the reader counts its lines ahead of the encoder
    ex = sorted(summary["skipped_examples"]["text_too_large"])
    assert ex[0] == "t.jsonl:2: 101 bytes of text, above --max-text-bytes 100" and ex[1].startswith(
        "t.jsonl:3: 101"
    )
    assert ex[2].startswith("t.jsonl:4: the line is longer than 66136 bytes")
    assert summary["args"]["max_text_bytes"] == 100 and no_tmp(tmp_path / "out")
