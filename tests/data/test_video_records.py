"""Records with videos (`videos` beside `images`, <video> tags matched as <image> tags are) and the
shard builder on LLaVA-Video-style JSON: video members written, bad videos skipped and counted."""

from __future__ import annotations

import json
import tarfile

import pytest

from moevlm.data.build_shards import main
from moevlm.data.errors import SkipSample
from moevlm.data.layouts import read_record
from moevlm.data.records import normalize_record
from moevlm.data.sample import sample_photo_paths
from moevlm.data.sample_video import SAMPLE_CLIPS, make_sample_clips


def chat(user: str, **media) -> dict:
    return {
        "id": "r",
        **media,
        "conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": "A pan."}],
    }


def test_video_and_image_tags_are_matched_separately():
    rec = normalize_record(
        chat(
            "<image>\n<video>\nCompare <image> with <video>.",
            images=["a.jpg", "b.png"],
            videos=["v.mp4", "w.webm"],
        )
    )
    assert (rec.images, rec.videos) == (["a.jpg", "b.png"], ["v.mp4", "w.webm"])
    assert rec.canonical(["img0.jpg", "img1.png"], ["vid0.mp4", "vid1.webm"])["videos"] == [
        "vid0.mp4",
        "vid1.webm",
    ]


def test_llava_video_records():
    """LLaVA-Video writes `"video": "x.mp4"` and marks the video's place with <image>: that tag is the
    video's when the record has no image and no <video> tag."""
    rec = normalize_record(chat("<image>\nWhat happens?", video="clips/x.mp4"))
    assert rec.videos == ["clips/x.mp4"] and rec.images == []
    assert rec.messages[0]["content"] == "<video>\nWhat happens?"
    untagged = normalize_record(chat("What happens?", video=["x.mp4", "y.mp4"]))
    assert untagged.messages[0]["content"] == "<video>\n<video>\nWhat happens?"
    caption = normalize_record({"id": "c", "video": "x.mp4", "caption": "A cat."})
    assert caption.kind == "caption" and caption.messages[0]["content"] == "<video>"
    assert caption.canonical(videos=["vid0.mp4"]) == {
        "id": "c",
        "images": [],
        "videos": ["vid0.mp4"],
        "caption": "A cat.",
    }


def test_an_image_record_is_written_as_before():
    rec = normalize_record(chat("<image>\nWhat is it?", image="a.jpg"))
    assert rec.videos == [] and "videos" not in rec.canonical(["img0.jpg"])


@pytest.mark.parametrize(
    "obj,reason",
    [
        (chat("<video><video> twice", video="x.mp4"), "video_tag_mismatch"),
        (
            chat("<image> and <video>", image="a.jpg", video=["x.mp4", "y.mp4"]),
            "video_tag_mismatch",
        ),
        (chat("<video>", video="x.mp4", videos=["y.mp4"]), "bad_record"),
        (chat("<video>", video=[3]), "bad_record"),
    ],
)
def test_video_mismatches_are_skipped(obj, reason):
    with pytest.raises(SkipSample) as e:
        normalize_record(obj)
    assert e.value.reason == reason


@pytest.fixture(scope="module")
def video_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    clips = make_sample_clips(sample_photo_paths(), root / "clips", SAMPLE_CLIPS[:3:2])  # mp4, webm
    (root / "photo.jpg").write_bytes(sample_photo_paths()[3].read_bytes())
    good = clips[0].read_bytes()
    (root / "clips" / "cut.mp4").write_bytes(good[: len(good) // 2])
    (root / "clips" / "notes.mp4").write_bytes(b"not a video at all\n" * 10)
    return root, [p.relative_to(root).as_posix() for p in clips]


def _members(out) -> dict[str, dict]:
    samples: dict[str, dict] = {}
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, _, field = m.name.partition(".")
                samples.setdefault(key, {"__key__": key})[field] = tar.extractfile(m).read()
    return samples


def test_builder_writes_video_members_and_counts_bad_videos(video_folder, tmp_path):
    root, (mp4, webm) = video_folder
    records = [
        {"id": "v1", "video": mp4, "conversations": chat("<image>\nDescribe.")["conversations"]},
        chat(
            "<image>\nThen <video>, then <video>.", id="mix", image="photo.jpg", videos=[webm, mp4]
        ),
        {"id": "cut", "video": "clips/cut.mp4", "caption": "Cut short."},
        {"id": "txt", "video": "clips/notes.mp4", "caption": "Text."},
        {"id": "gone", "video": "clips/none.mp4", "caption": "Missing."},
        {"id": "out", "video": "../x.mp4", "caption": "Outside."},
    ]
    ann = tmp_path / "llava_video.json"
    ann.write_text(json.dumps(records))
    out = tmp_path / "out"
    assert main(["--images", str(root), "--annotations", str(ann), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["samples"], summary["images"], summary["videos"]) == (2, 1, 3)
    assert summary["skipped"] == {
        "missing_video": 1,
        "not_a_video": 1,
        "outside_images": 1,
        "video_truncated": 1,
    }
    samples = list(_members(out).values())
    by_id = {json.loads(s["json"])["id"]: s for s in samples}
    v1, mix = by_id["v1"], by_id["mix"]
    assert sorted(k for k in mix if k != "__key__") == ["img0.jpg", "json", "vid0.webm", "vid1.mp4"]
    assert (
        v1["vid0.mp4"] == (root / mp4).read_bytes()
        and mix["vid0.webm"] == (root / webm).read_bytes()
    )
    rec, unused = read_record(mix)  # the loader's reading: video members are no unused images
    assert (rec.images, rec.videos, unused) == (["img0.jpg"], ["vid0.webm", "vid1.mp4"], [])
    assert json.loads(v1["json"])["messages"][0]["content"] == "<video>\nDescribe."


def test_builder_videos_folder_apart_from_images(video_folder, tmp_path):
    root, (mp4, _) = video_folder
    ann = tmp_path / "a.jsonl"
    ann.write_text(
        json.dumps({"id": "v", "video": mp4.split("/", 1)[1], "caption": "A pan."}) + "\n"
    )
    out = tmp_path / "out"
    argv = ["--videos", str(root / "clips"), "--annotations", str(ann), "--out", str(out)]
    assert main(argv) == 0
    assert json.loads((out / "summary.json").read_text())["videos"] == 1
