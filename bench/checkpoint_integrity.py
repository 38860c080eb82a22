"""What checkpoint checksums cost: the embedded default's checkpoint saved and loaded with and
without them, beside its step time.

    python bench/checkpoint_integrity.py [--steps 4] [--repeat 5] [train overrides ...]

Baseline: DCP's own save (dcp.save) and load, in the same process, on the same state.  Ours adds a
CRC-32 pass over the written files on save (`checksum_files`) and a verification pass on load
(`file_problems`); both are printed in ms and as a share of the save, the load and one training step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from moevlm.train import integrity
from moevlm.train.checkpoint import MARKER, CheckpointManager, read_marker
from moevlm.train.config import compose_job
from moevlm.train.trainer import Trainer


def timed(fn, repeat: int) -> float:
    """Median wall time of `fn()` in ms."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    args, overrides = ap.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        job = compose_job(
            [
                f"train.run_dir={tmp}/run",
                f"train.steps={args.steps}",
                "train.checkpoint_every=0",
                "train.checkpoint_at_end=false",
                "train.tensorboard=false",
                "train.log_every=1000",
                "train.require_loss_decrease=false",
                *overrides,
            ]
        )
        tr = Trainer(job)
        steps = []
        orig = tr.train_step

        def timed_step(window):
            t0 = time.perf_counter()
            ok = orig(window)
            steps.append((time.perf_counter() - t0) * 1e3)
            return ok

        tr.train_step = timed_step
        tr.run()
        step_ms = statistics.median(steps[1:] or steps)

        ck = tr.ckpt = CheckpointManager(Path(tmp) / "ckpt", keep=1)
        save_ms = timed(tr.save, args.repeat)
        path = ck.latest()
        files = read_marker(path)["files"]
        names = integrity.stored_files(path, skip=[MARKER])
        crc_ms = timed(lambda: integrity.checksum_files(path, names), args.repeat)
        verify_ms = timed(lambda: integrity.file_problems(path, files), args.repeat)
        load = dict(
            model=tr.model,
            optimizer=tr.opt,
            extra={"scheduler": tr.sched, "counters": {}},
            per_rank=["rng"],
        )
        load_plain_ms = timed(
            lambda: CheckpointManager(ck.root).load(path, verify=False, **load), args.repeat
        )
        load_ms = timed(
            lambda: CheckpointManager(ck.root).load(path, verify=True, **load), args.repeat
        )
        size = sum(f["bytes"] for f in files.values())
    print(
        f"embedded default checkpoint: {len(files)} files, {size / 2**20:.1f} MiB; step {step_ms:.0f} ms (median)"
    )
    print(
        f"save  : {save_ms:8.1f} ms total, of which checksums {crc_ms:6.1f} ms = {100 * crc_ms / save_ms:4.1f}% of "
        f"the save, {100 * crc_ms / step_ms:4.1f}% of a step; DCP alone ~{save_ms - crc_ms:.1f} ms"
    )
    print(
        f"load  : {load_ms:8.1f} ms verified vs {load_plain_ms:.1f} ms unverified (DCP); verification {verify_ms:.1f}"
        f" ms = {100 * verify_ms / load_ms:4.1f}% of the load, {100 * verify_ms / step_ms:4.1f}% of a step"
    )
    print(
        f"ratio : save with checksums / DCP alone = {save_ms / max(save_ms - crc_ms, 1e-9):.3f}; "
        f"verified / unverified load = {load_ms / load_plain_ms:.3f}"
    )


if __name__ == "__main__":
    main()
