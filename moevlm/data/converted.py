"""data.shards=<what Hugging Face datasets saves>: converted once into shards in the moevlm cache
(moevlm.data.sample_cache.cache_root), keyed by the input files' real paths, sizes and mtimes, and
reused; built as the sample set is (moevlm.data.sample_cache.build_once).

    src = open_dataset(Path("ds"), split=None)    # moevlm.data.hf_datasets
    folder, built = ensure_converted(src, say=log.info)
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from moevlm.data.errors import DataSetupError, SkipCounter
from moevlm.data.hf_datasets import DatasetSource
from moevlm.data.sample_cache import build_once, cache_root

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

    def convert(tmp: Path, _found) -> None:
        say(f"converting {src.describe()} once into {final}")
        t0 = time.perf_counter()
        summary = _convert(src, tmp)
        say(
            f"converted {summary['samples']} samples, {summary['images']} images into "
            f"{len(summary['shards'])} shards in {time.perf_counter() - t0:.1f} s"
            + (f" ({sum(summary['skipped'].values())} rows skipped)" if summary["skipped"] else "")
        )

    return final, build_once(final, _unconverted, convert)


def _unconverted(final: Path) -> list[str]:
    return [] if (final / "summary.json").is_file() else ["not converted"]


def _convert(src: DatasetSource, tmp: Path) -> dict:
    """The builder's shards of `src` in `tmp`; DataSetupError when no row is usable."""
    # late: `python -m moevlm.data.build_shards` imports moevlm.data (this module) first
    from moevlm.data.build_shards import auto_samples_per_shard, build_shards

    skips = SkipCounter()
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
    return summary
