"""moevlm.data.sample: the embedded dataset built from files installed packages ship."""

from __future__ import annotations

import subprocess
import sys

import pytest
from PIL import Image

from moevlm.data import sample
from moevlm.data.sample import packaged_photos, sample_records, sample_tokenizer, shipped_texts
from moevlm.data.text import IGNORE_INDEX, ROLES, ChatEncoder, VideoSpan
from moevlm.model.config import VLMConfig


@pytest.fixture(scope="module")
def records():
    return sample_records()


@pytest.fixture(scope="module")
def tok():
    return sample_tokenizer()


def test_photos_exist_and_open():
    photos = packaged_photos()
    assert len(photos) >= 12
    assert len({p.path for p in photos}) == len(photos)
    for photo in photos:
        assert photo.path.is_absolute() and photo.path.is_file()
        assert photo.source in {"scikit-image", "scikit-learn", "matplotlib"}
        assert 40 <= len(photo.caption) <= 400
        with Image.open(photo.path) as im:
            im.verify()
        with Image.open(photo.path) as im:
            assert min(im.size) >= 128


@pytest.mark.slow
def test_photos_found_without_importing_packages():
    code = (
        "import sys; from moevlm.data.sample import packaged_photos; packaged_photos(); "
        "print(sorted({'skimage', 'sklearn', 'matplotlib'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_shipped_texts():
    docs = shipped_texts()
    assert len(docs) >= 300
    assert all(d.strip() and len(d) <= sample.DOC_MAX_CHARS for d in docs)
    assert sum(len(d) >= sample.DOC_MIN_CHARS for d in docs) >= 0.95 * len(docs)
    assert shipped_texts(10) == [docs[i * len(docs) // 10] for i in range(10)]


def _check_record(r: dict) -> str:
    """The kind of a well-formed record; fails on anything else."""
    assert isinstance(r["id"], str) and r["id"]
    if "text" in r:
        assert set(r) == {"id", "text"} and r["text"].strip()
        return "text"
    for path in r["images"]:
        assert isinstance(path, str) and Image.open(path).size
    if "caption" in r:
        assert (
            set(r) == {"id", "images", "caption"} and len(r["images"]) == 1 and r["caption"].strip()
        )
        return "caption"
    assert set(r) - {"videos"} == {"id", "images", "messages"}
    assert sum(m["content"].count("<video>") for m in r["messages"]) == len(r.get("videos", []))
    assert all(m["role"] in ROLES and isinstance(m["content"], str) for m in r["messages"])
    assert sum(m["content"].count("<image>") for m in r["messages"]) == len(r["images"])
    assert r["messages"][-1]["role"] == "assistant"
    return "chat"


def test_records_are_well_formed(records):
    kinds = [_check_record(r) for r in records]
    ids = [r["id"] for r in records]
    assert len(set(ids)) == len(ids)
    n_photos = len(packaged_photos())
    assert kinds.count("caption") == n_photos
    assert kinds.count("chat") > n_photos and 200 <= kinds.count("text") <= 800
    chats = [r for r in records if "messages" in r]
    assert any(len(r["images"]) == 2 for r in chats)
    assert any(sum(m["role"] == "assistant" for m in r["messages"]) >= 2 for r in chats)
    text_only = [r for r in chats if not r["images"] and not r.get("videos")]
    docs = set(shipped_texts())
    assert text_only and all(
        any(r["messages"][-1]["content"] in d for d in docs) for r in text_only
    )
    photo_paths = {str(p.path) for p in packaged_photos()}
    assert photo_paths == {r["images"][0] for r in records if "caption" in r}
    assert photo_paths == {r["images"][0] for r in chats if len(r["images"]) == 1}


def test_records_are_deterministic(records):
    assert sample_records() == records


def test_every_record_encodes(records, tok):
    enc = ChatEncoder(tok)
    for r in records:
        if "messages" in r:
            videos = [VideoSpan((0.5, 1.5), 4)] * len(r.get("videos", []))
            ids_L, labels_L = enc.encode_chat(r["messages"], [4] * len(r["images"]), videos)
        else:
            ids_L, labels_L = enc.encode_text(r.get("caption") or r["text"])
        assert len(ids_L) == len(labels_L) and any(label != IGNORE_INDEX for label in labels_L)


def test_tokenizer_fits_tiny_model(tok):
    ChatEncoder(tok).check_model(VLMConfig.preset("tiny"))


def test_tokenizer_is_deterministic(tok):
    assert sample_tokenizer().to_str() == tok.to_str()
