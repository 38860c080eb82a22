"""The embedded sample set, built once per content version in a cache folder: what
`data.shards=sample` resolves to, for every run, rank and sweep job on the machine.

    path, built = ensure_sample()     # build (or reuse) <cache>/sample-<version>
    path = sample_dir()               # where it is (or will be); no building

The cache is $MOEVLM_CACHE, else $XDG_CACHE_HOME/moevlm, else ~/.cache/moevlm; the version hashes
what the content follows from; builders serialise on an flock and rename a finished folder into place.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

CACHE_ENV = "MOEVLM_CACHE"
SAMPLE_FORMAT = 1  # bump when build_sample's output changes for the same records and packages
_PACKAGES = ("tokenizers", "webdataset")
_REQUIRED = ("summary.json", "tokenizer.json")


def cache_root() -> Path:
    """$MOEVLM_CACHE, else $XDG_CACHE_HOME/moevlm, else ~/.cache/moevlm."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).absolute() / "moevlm"


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def sample_version() -> str:
    """12 hex digits that change whenever the built set's content would."""
    from moevlm.data.sample import sample_records

    records = sample_records()
    files = {}
    for path in sorted({p for r in records for p in r.get("images") or []}):
        st = os.stat(path)
        files[path] = [st.st_size, st.st_mtime_ns]
    key = {
        "format": SAMPLE_FORMAT,
        "records": records,
        "files": files,
        "packages": {p: _package_version(p) for p in _PACKAGES},
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def sample_dir(version: str | None = None) -> Path:
    """The folder of the sample set of `version` (default: the installed packages' one)."""
    return cache_root() / f"sample-{version or sample_version()}"


def is_complete(path: Path) -> bool:
    return all((Path(path) / name).is_file() for name in _REQUIRED)


def ensure_sample(version: str | None = None) -> tuple[Path, bool]:
    """(folder, built): the sample set's folder, built here (True) or reused (False)."""
    final = sample_dir(version)
    if is_complete(final):
        return final, False
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{final.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released on close, or by the kernel if this process dies
        if is_complete(final):
            return final, False  # another process built it while this one waited
        _build_locked(final)
    return final, True


def _build_locked(final: Path) -> None:
    """Build into a fresh tmp folder beside `final` and rename it into place (the lock is held)."""
    from moevlm.data.build_shards import build_sample

    for stale in final.parent.glob(f"{final.name}.tmp-*"):
        shutil.rmtree(stale)  # an interrupted build: only the lock holder writes there
    if final.exists():
        shutil.rmtree(final)  # incomplete by hand; renaming onto it would fail
    tmp = final.parent / f"{final.name}.tmp-{os.getpid()}"
    try:
        build_sample(tmp, progress=False, overwrite=True)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename reaches the disk before anyone is told the set is there
    finally:
        os.close(fd)


def describe(path: Path, built: bool) -> str:
    """One line: where the set is, whether it was built now, what it holds."""
    try:
        s = json.loads((Path(path) / "summary.json").read_text())
        what = f"{s['samples']} samples, {s['images']} images, {len(s['shards'])} shards"
    except (OSError, ValueError, KeyError, TypeError):
        what = "summary.json unreadable"
    return f"sample set {'built' if built else 'reused'}: {path} ({what})"
