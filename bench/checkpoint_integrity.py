"""What checkpoint checksums cost, and what asynchronous checkpoints save: the embedded default's
checkpoint saved and loaded with and without checksums beside its step time, and training runs with
synchronous and asynchronous checkpoints (train.async_checkpoint) side by side.

    python bench/checkpoint_integrity.py [--steps 4] [--repeat 5] [--every 3] [--stall-repeat 9]
                                         [train overrides ...]

Baselines, in the same process: DCP's own save (dcp.save) and load on the same state, for the
checksums (ours adds a CRC-32 pass over the written files on save, `checksum_files`, and a
verification pass on load, `file_problems`; printed in ms and as a share of the save, the load and
one training step); and the same training steps without a checkpoint, for the stall.  The stall of a
checkpoint is the extra time of a trial (a save, then `--every` steps, then the wait for an async
write still going) over a trial without a save; sync, async and no-save trials are interleaved
`--stall-repeat` times in one trainer; printed for the median trials and for the fastest (the least
disturbed by other load on a shared machine).  Also printed: how long `Trainer.save` itself blocked
the loop (async: the host copy and the start of the write).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from moevlm.config import compose_job
from moevlm.train import integrity
from moevlm.train.checkpoint import MARKER, CheckpointManager, read_marker
from moevlm.train.metrics import Window
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
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--stall-repeat", type=int, default=9)
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

    stall_table(args.every, args.stall_repeat, overrides)


def stall_table(every: int, repeat: int, overrides: list[str]) -> None:
    """Sync against async checkpoints in one trainer: trials of `every` steps, each after a sync
    save, an async save or none, interleaved `repeat` times (a change of machine load hits every
    mode alike).  An async trial ends by waiting for its write, so all of its cost is counted."""
    with tempfile.TemporaryDirectory() as tmp:
        job = compose_job(
            [
                f"train.run_dir={tmp}/run",
                "train.steps=100000",
                "train.tensorboard=false",
                "train.log_every=100000",
                *overrides,
            ]
        )
        tr, window = Trainer(job), Window()
        managers = {
            mode: CheckpointManager(Path(tmp) / mode, keep=1, async_save=mode == "async")
            for mode in ("sync", "async")
        }
        for _ in range(2):  # warm-up: first steps, first saves
            tr.train_step(window)
        for mgr in managers.values():
            tr.ckpt = mgr
            tr.save(complete=True)
        trials: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
        blocked: dict[str, list[float]] = {"sync": [], "async": []}
        for _ in range(repeat):
            for mode, times in trials.items():
                t0 = time.perf_counter()
                if mode in managers:
                    tr.ckpt = managers[mode]
                    tr.save()
                    blocked[mode].append((time.perf_counter() - t0) * 1e3)
                for _ in range(every):
                    tr.train_step(window)
                if mode in managers:
                    managers[mode].wait()
                times.append((time.perf_counter() - t0) * 1e3)
        for mgr in managers.values():
            mgr.close()
        tr.close()
        size = sum(f["bytes"] for f in read_marker(managers["sync"].latest())["files"].values())
    block = {m: statistics.median(blocked[m]) for m in blocked}
    print(
        f"stall : checkpoint {size / 2**20:.1f} MiB; {every} steps without one: "
        f"{statistics.median(trials['none']):.0f} ms (median of {repeat} interleaved trials), "
        f"{min(trials['none']):.0f} ms (fastest)"
    )
    for name, pick in (("median", statistics.median), ("fastest", min)):
        stall = {m: pick(trials[m]) - pick(trials["none"]) for m in blocked}
        print(
            f"        per checkpoint ({name:7s}): sync {stall['sync']:7.1f} ms, async "
            f"{stall['async']:7.1f} ms; sync/async = {ratio(stall['sync'], stall['async'])}"
        )
    print(
        f"        Trainer.save blocked: sync {block['sync']:7.1f} ms, async {block['async']:7.1f} ms; "
        f"sync/async = {ratio(block['sync'], block['async'])}"
    )


def ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 else "n/a (async <= 0: within the noise)"


if __name__ == "__main__":
    main()
