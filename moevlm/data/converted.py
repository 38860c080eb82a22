"""data.shards=<what Hugging Face datasets saves>: converted once into shards in the moevlm cache
(moevlm.data.sample_cache.cache_root), keyed by the input files' real paths, sizes and mtimes, and
reused; builders serialise on an flock and rename a finished folder into place.

    src = open_dataset(Path("ds"), split=None)    # moevlm.data.hf_datasets
    folder, built = ensure_converted(src, say=log.info)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from moevlm.data.errors import DataSetupError, SkipCounter
from moevlm.data.hf_datasets import DatasetSource
from moevlm.data.sample_cache import cache_root

CONVERT_FORMAT = 1  # bump when a conversion's output changes for the same input


def conversion_key(src: DatasetSource) -> str:
    """12 hex digits of what the conversion follows from: the files read (real path, size, mtime), the
    split, the format.  Images named by absolute path are not part of it."""
    files = [[os.path.realpath(f), f.stat().st_size, f.stat().st_mtime_ns] for f in src.files]
    key = {"format": CONVERT_FORMAT, "kind": src.kind, "split": src.split, "files": files}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def converted_dir(src: DatasetSource) -> Path:
    return cache_root() / f"dataset-{conversion_key(src)}"


def ensure_converted(src: DatasetSource, say=print) -> tuple[Path, bool]:
    """(folder of shards, built): `src` converted into the cache here (True) or earlier (False);
    `say` gets one line before a conversion (the builder shows its progress) and one after."""
    final = converted_dir(src)
    if (final / "summary.json").is_file():
        return final, False
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{final.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released on close, or by the kernel if this process dies
        if (final / "summary.json").is_file():
            return final, False
        say(f"converting {src.describe()} once into {final}")
        t0 = time.perf_counter()
        summary = _convert_locked(src, final)
        say(
            f"converted {summary['samples']} samples, {summary['images']} images into "
            f"{len(summary['shards'])} shards in {time.perf_counter() - t0:.1f} s"
            + (f" ({sum(summary['skipped'].values())} rows skipped)" if summary["skipped"] else "")
        )
    return final, True


def _convert_locked(src: DatasetSource, final: Path) -> dict:
    # late: `python -m moevlm.data.build_shards` imports moevlm.data (this module) first
    from moevlm.data.build_shards import auto_samples_per_shard, build_shards

    for stale in final.parent.glob(f"{final.name}.tmp-*"):
        shutil.rmtree(stale)
    if final.exists():
        shutil.rmtree(final)
    tmp = final.parent / f"{final.name}.tmp-{os.getpid()}"
    skips = SkipCounter()
    try:
        summary = build_shards(
            src.records(skips),
            None,
            tmp,
            auto_samples_per_shard(max(src.total, 1)),
            skips=skips,
            build_args={"dataset": str(src.path), "split": src.split},
            total=src.total,
        )
        if not summary["samples"]:
            skipped = ", ".join(f"{k} {n}" for k, n in summary["skipped"].items()) or "no rows"
            raise DataSetupError(f"data.shards={src.path}: no usable row ({skipped})")
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary
