"""The cached sample set is checked against its manifest (names, sizes, CRC-32) at every launch and built
again when damaged, one line saying why; the cache folder is made only inside a folder that exists and
can be written (else one `config error:` line, exit 2)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moevlm.data import sample_cache
from moevlm.data.sample_cache import CACHE_ENV, damage, describe, ensure_sample, sample_dir
from moevlm.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
BUILDS: list[Path] = []


def fake_build(out, **kw):
    """A set of the real one's layout, written in milliseconds."""
    out = Path(out)
    out.mkdir()
    for i in range(3):
        (out / f"shard-{i:06d}.tar").write_bytes(bytes([i]) * 10240)
    (out / "tokenizer.json").write_text("{}")
    shards = [{"name": f"shard-{i:06d}.tar", "samples": 4} for i in range(3)]
    (out / "summary.json").write_text(json.dumps({"samples": 12, "images": 0, "shards": shards}))
    BUILDS.append(out)


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr("moevlm.data.build_shards.build_sample", fake_build)
    BUILDS.clear()
    return tmp_path / "cache"


@pytest.mark.parametrize("how", ["truncated", "deleted", "changed", "added", "no_manifest"])
def test_a_damaged_set_is_built_again_with_one_line(cache, how):
    path, built = ensure_sample("v1")
    assert built and damage(path) == [] and describe(path, built).startswith("sample set built:")
    shard = path / "shard-000001.tar"
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:5000])
    elif how == "deleted":
        shard.unlink()
    elif how == "changed":
        shard.write_bytes(b"x" * 10240)
    elif how == "added":
        (path / "shard-000003.tar").write_bytes(b"stray")
    else:
        (path / "manifest.json").unlink()
    why = {
        "truncated": "shard-000001.tar: 5000 bytes, 10240 when built",
        "deleted": "shard-000001.tar: missing",
        "changed": "shard-000001.tar: its bytes changed (CRC-32)",
        "added": "shard-000003.tar: not in the manifest",
        "no_manifest": "no manifest.json (built by an earlier moevlm, or damaged)",
    }[how]
    assert damage(path) == [why]
    again, built = ensure_sample("v1")
    assert again == path and built and damage(path) == [] and len(BUILDS) == 2
    assert describe(path, built) == (
        f"sample set rebuilt: {path} (12 samples, 0 images, 3 shards); the cached one was damaged "
        f"({why})"
    )
    assert (path / "shard-000001.tar").read_bytes() == bytes([1]) * 10240
    # sound now: reused untouched, and said so
    assert ensure_sample("v1") == (path, False) and len(BUILDS) == 2
    assert describe(path, False).startswith("sample set reused:")


def test_a_missing_home_creates_nothing(monkeypatch, tmp_path):
    home = tmp_path / "nonexistent" / "home"
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(ConfigError) as err:
        ensure_sample("v1")
    assert str(err.value) == (
        f"the sample set's cache {home}/.cache/moevlm (from $HOME): {home} is not an existing folder; "
        f"set {CACHE_ENV} to a folder this user can write, or data.shards to built shards"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_home_is_one_config_error(monkeypatch, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(home))
    real_mkdir = Path.mkdir

    def read_only(self, *a, **kw):  # chmod does not stop root: the error a read-only mount gives
        if self.is_relative_to(home):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ConfigError, match=r"\(from \$HOME\): .*Read-only file system; set"):
        ensure_sample("v1")
    assert list(home.iterdir()) == []


def test_a_cache_that_is_a_file_is_one_line_and_exit_2(tmp_path):
    """train.py with data.shards=sample (the default) and $MOEVLM_CACHE a file."""
    file = tmp_path / "cache"
    file.write_text("not a folder")
    env = {**os.environ, CACHE_ENV: str(file), "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            "train.steps=1",
            f"train.run_dir={tmp_path / 'run'}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines == [
        f"config error: the sample set's cache {file} (from ${CACHE_ENV}): {file} is a file, not a folder; "
        f"set {CACHE_ENV} to a folder this user can write, or data.shards to built shards"
    ], r.stderr
    assert file.read_text() == "not a folder"


def test_sample_dir_still_follows_the_cache(cache):
    assert sample_dir("v9") == cache / "sample-v9" and sample_cache.MANIFEST == "manifest.json"
