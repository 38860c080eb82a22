"""The embedded sample set, built once per content version in a cache folder: what
`data.shards=sample` resolves to, for every run, rank and sweep job on the machine.

    path, built = ensure_sample()     # build (or reuse) <cache>/sample-<version>
    path = sample_dir()               # where it is (or will be); no building

The cache is $MOEVLM_CACHE, else $XDG_CACHE_HOME/moevlm, else ~/.cache/moevlm, made only under a folder
that exists and can be written; the version hashes what the content follows from; builders serialise on
an flock and rename a finished folder into place with manifest.json (every file's name, size and CRC-32),
which each launch checks (~25 ms for the 15 MB set): a damaged set is built again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import zlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from moevlm.errors import ConfigError
from moevlm.files import fsync_path

CACHE_ENV = "MOEVLM_CACHE"
SAMPLE_FORMAT = 2  # bump when build_sample's output changes for the same records and packages
_PACKAGES = ("tokenizers", "webdataset", "av")  # av: the sample clips' encoder
_REQUIRED = ("summary.json", "tokenizer.json")
MANIFEST = "manifest.json"


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


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def file_sums(path: Path) -> dict[str, list]:
    """{name: [bytes, crc32]} of every file in `path` but the manifest."""
    return {
        p.name: [p.stat().st_size, _crc32(p)]
        for p in sorted(Path(path).iterdir())
        if p.name != MANIFEST
    }


def damage(path: Path) -> list[str]:
    """What is wrong with the set in `path` against its manifest: a file missing, of another size or
    CRC-32, or not in it; ["not built"] when there is no such folder; [] when it is sound."""
    path = Path(path)
    if not path.is_dir():
        return ["not built"]
    try:
        want = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return [f"no {MANIFEST} (built by an earlier moevlm, or damaged)"]
    except (OSError, ValueError, KeyError, TypeError):
        return [f"{MANIFEST} unreadable"]
    have = {p.name: p for p in path.iterdir() if p.name != MANIFEST}
    problems = [f"{n}: missing" for n in sorted(set(want) - set(have))]
    problems += [f"{n}: not in the manifest" for n in sorted(set(have) - set(want))]
    for name in sorted(set(want) & set(have)):
        size = have[name].stat().st_size
        if size != want[name][0]:
            problems.append(f"{name}: {size} bytes, {want[name][0]} when built")
        elif _crc32(have[name]) != want[name][1]:
            problems.append(f"{name}: its bytes changed (CRC-32)")
    return problems + [f"{n}: missing" for n in _REQUIRED if n not in want]


def is_complete(path: Path) -> bool:
    return not damage(path)


def make_cache_root(root: Path) -> Path:
    """Makes `root` (the cache folder) unless it is there, only inside a folder that exists already:
    $MOEVLM_CACHE's or $XDG_CACHE_HOME's parent, or $HOME for ~/.cache/moevlm (a home that does not
    exist never creates folders from the file system's root).  A ConfigError names the variable to
    change when that folder is missing, the path is a file, or it cannot be written."""
    if os.environ.get(CACHE_ENV):
        anchor, var = root.parent, CACHE_ENV
    elif os.environ.get("XDG_CACHE_HOME"):
        anchor, var = root.parent.parent, "XDG_CACHE_HOME"
    else:
        anchor, var = Path(os.path.expanduser("~")).absolute(), "HOME"
    problem = None
    if not root.is_dir() and not anchor.is_dir():
        problem = f"{anchor} is not an existing folder"
    elif root.exists() and not root.is_dir():
        problem = f"{root} is a file, not a folder"
    else:
        try:
            root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=root):
                pass
        except OSError as err:
            problem = f"{err.filename or root}: {err.strerror or err}"
    if problem:
        raise ConfigError(
            f"the sample set's cache {root} (from ${var}): {problem}; set {CACHE_ENV} to a folder this "
            "user can write, or data.shards to built shards"
        )
    return root


def ensure_sample(version: str | None = None) -> tuple[Path, bool]:
    """(folder, built): the sample set's folder, built here (True) or reused (False).  A set damaged since
    it was built (its manifest says) is built again; `describe` says why."""
    final = sample_dir(version)
    return final, build_once(final, damage, _build_sample)


def build_once(final: Path, problems, build) -> bool:
    """The cache folder `final`, unless `problems(final)` is empty, built by `build(tmp, found)` into a
    fresh folder beside it and renamed into place; `problems` is asked again under an flock, so several
    processes may ask at once.  True when this call built it."""
    if not problems(final):
        return False
    make_cache_root(final.parent)
    with open(final.parent / f"{final.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released on close, or by the kernel if this process dies
        found = problems(final)
        if not found:
            return False  # another process built it while this one waited
        for stale in final.parent.glob(f"{final.name}.tmp-*"):
            shutil.rmtree(stale)  # an interrupted build: only the lock holder writes there
        if final.exists():
            shutil.rmtree(final)  # incomplete or damaged; renaming onto it would fail
        tmp = final.parent / f"{final.name}.tmp-{os.getpid()}"
        try:
            build(tmp, found)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_path(final.parent)  # the rename reaches the disk before anyone is told it is there
    return True


def _build_sample(tmp: Path, found: list[str]) -> None:
    """The sample set into `tmp` with its manifest (`found`: what was wrong with the set it replaces)."""
    from moevlm.data.build_shards import build_sample

    build_sample(tmp, progress=False, overwrite=True)
    damaged = None if found == ["not built"] else found
    manifest = {"files": file_sums(tmp), "replaced_damaged": damaged}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))


def describe(path: Path, built: bool) -> str:
    """One line: where the set is, whether it was built now, what it holds."""
    try:
        s = json.loads((Path(path) / "summary.json").read_text())
        what = f"{s['samples']} samples, {s['images']} images, {len(s['shards'])} shards"
    except (OSError, ValueError, KeyError, TypeError):
        what = "summary.json unreadable"
    damaged = None
    if built:
        try:
            damaged = json.loads((Path(path) / MANIFEST).read_text())["replaced_damaged"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if damaged:
        shown = "; ".join(damaged[:3]) + (f"; {len(damaged) - 3} more" if len(damaged) > 3 else "")
        return f"sample set rebuilt: {path} ({what}); the cached one was damaged ({shown})"
    return f"sample set {'built' if built else 'reused'}: {path} ({what})"
