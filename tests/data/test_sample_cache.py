"""The sample set's cache: where it is, when its version changes, and that concurrent or interrupted
builders never leave (or use) a half-built set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moevlm.data import sample_cache
from moevlm.data.sample_cache import (
    CACHE_ENV,
    cache_root,
    ensure_sample,
    is_complete,
    sample_dir,
    sample_version,
)

REPO = Path(__file__).resolve().parents[2]


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv(CACHE_ENV)
    assert cache_root() == tmp_path / "xdg" / "moevlm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "moevlm"
    assert sample_dir("abc") == tmp_path / "home" / ".cache" / "moevlm" / "sample-abc"


def test_version_changes_with_the_content(monkeypatch, tmp_path):
    photo = tmp_path / "photo.png"
    photo.write_bytes(b"x" * 10)
    records = [
        {"id": "caption-photo", "images": [str(photo)], "caption": "a photo"},
        {"id": "t", "text": "prose"},
    ]
    monkeypatch.setattr("moevlm.data.sample.sample_records", lambda: [dict(r) for r in records])
    base = sample_version()
    assert sample_version() == base and len(base) == 12  # deterministic
    records[1]["text"] = "other prose"
    assert sample_version() != base
    records[1]["text"] = "prose"
    # the builder changed
    monkeypatch.setattr(sample_cache, "SAMPLE_FORMAT", sample_cache.SAMPLE_FORMAT + 1)
    assert sample_version() != base
    monkeypatch.undo()
    monkeypatch.setattr("moevlm.data.sample.sample_records", lambda: [dict(r) for r in records])
    photo.write_bytes(b"y" * 11)  # the package was upgraded: another file
    assert sample_version() != base
    # another tokenizers/webdataset
    monkeypatch.setattr(sample_cache, "_package_version", lambda name: "9.9")
    assert len({base, sample_version()}) == 2


def test_a_failed_build_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))

    def crash(out, **kw):
        Path(out).mkdir()
        (Path(out) / "shard-000000.tar").write_bytes(b"half")
        raise OSError("disk gone")

    monkeypatch.setattr("moevlm.data.build_shards.build_sample", crash)
    with pytest.raises(OSError, match="disk gone"):
        ensure_sample("v1")
    # no final folder, no tmp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sample-v1.lock"]


BUILDER = """
import json, sys
from moevlm.data.sample_cache import ensure_sample
path, built = ensure_sample()
print(json.dumps({"path": str(path), "built": built}))
"""


@pytest.mark.slow
def test_concurrent_builders_make_one_set_and_skip_a_crashed_one(tmp_path, monkeypatch):
    """Two processes at once, over the leftovers of a builder that died (its tmp folder and lock file) and a
    final folder damaged by hand: one builds, the other waits and reuses; the leftovers are gone; a later
    caller reuses the folder untouched."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    final = sample_dir()
    stale = tmp_path / f"{final.name}.tmp-4242"
    stale.mkdir(parents=True)
    (stale / "shard-000000.tar").write_bytes(b"half a shard")
    (tmp_path / f"{final.name}.lock").touch()
    final.mkdir()
    (final / "summary.json").write_text("{}")  # no tokenizer.json: not complete, never used
    assert not is_complete(final)

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILDER], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(r["built"] for r in results) == [False, True] and {
        r["path"] for r in results
    } == {str(final)}
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name, f"{final.name}.lock"]
    summary = json.loads((final / "summary.json").read_text())
    shards = sorted(final.glob("shard-*.tar"))
    assert is_complete(final) and [s["name"] for s in summary["shards"]] == [p.name for p in shards]
    assert len(shards) >= 8 and summary["samples"] == sum(s["samples"] for s in summary["shards"])
    before = final.stat()
    assert ensure_sample() == (final, False)
    assert (final.stat().st_ino, final.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
