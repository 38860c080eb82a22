"""The run directory belongs to one run (moevlm.train.run_dir): a second launch on it is refused naming
the holder and the first is unaffected; a directory moevlm did not make is refused with nothing in it
touched; nothing is written through a link; default names never collide; a file or an unwritable path is
a config error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_trainer import last_loss_per_step, launch

from moevlm.config import compose_job
from moevlm.train.run_dir import LOCK, MARKER, RunDir, RunDirError, holder
from moevlm.train.trainer import Trainer

HOLD = (
    "import sys, time; from moevlm.train.run_dir import RunDir; RunDir.claim(sys.argv[1]); "
    "print('held', flush=True); time.sleep(120)"
)


def snapshot(path: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def test_a_foreign_directory_is_refused_and_left_as_it_was(tmp_path):
    mine = tmp_path / "thesis"
    (mine / "checkpoints" / "step_00000001").mkdir(parents=True)
    (mine / "config.yaml").write_text("chapter: 3\n")
    (mine / "metrics.jsonl").write_text('{"step": 1}\n')
    before = snapshot(mine)
    with pytest.raises(RunDirError, match="was not made by moevlm .* nothing in it was touched"):
        RunDir.claim(mine)
    assert snapshot(mine) == before and not (mine / MARKER).exists() and not (mine / LOCK).exists()


def test_empty_and_older_moevlm_directories_are_accepted_and_marked(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    run = RunDir.claim(empty)
    assert json.loads((empty / MARKER).read_text())["made_by"] == "moevlm"
    assert holder(empty).startswith("host ") and f"pid {os.getpid()}" in holder(empty)
    run.release()
    old = tmp_path / "old"  # a run directory written before the marker existed
    old.mkdir()
    (old / "config.yaml").write_text("model: {}\ndata: {}\nparallel: {}\noptim: {}\ntrain: {}\n")
    RunDir.claim(old).release()
    assert (old / MARKER).is_file()


def test_nothing_is_written_through_a_link(tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").symlink_to(outside)
    with pytest.raises(RunDirError, match=r"symbolic links where moevlm writes \(config.yaml\)"):
        RunDir.claim(run_dir)
    assert outside.read_text() == "keep me\n"
    (run_dir / "config.yaml").unlink()
    run = RunDir.claim(run_dir)
    run.write_config("a: 1\n")
    run.write_config("a: 2\n")  # the one it replaces is kept
    assert (run_dir / "config.yaml").read_text() == "a: 2\n"
    assert (run_dir / "config.previous.yaml").read_text() == "a: 1\n"
    run.release()


def test_default_names_never_collide_and_bad_paths_are_config_errors(tmp_path):
    first = RunDir.claim(tmp_path / "outputs" / "12-00-00", default=True)
    second = RunDir.claim(tmp_path / "outputs" / "12-00-00", default=True)
    assert (first.path.name, second.path.name) == ("12-00-00", "12-00-00-1")
    first.release(), second.release()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(RunDirError, match="is a file, not a directory"):
        RunDir.claim(a_file)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "ro"
        locked.mkdir(mode=0o500)
        with pytest.raises(RunDirError, match="not writable"):
            RunDir.claim(locked)


def test_a_held_directory_is_refused_naming_the_holder_until_it_dies(tmp_path):
    run_dir = tmp_path / "run"
    other = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(
            RunDirError, match=f"in use by another launch \\(host .*, pid {other.pid}"
        ):
            RunDir.claim(run_dir)
    finally:
        other.kill()
        other.wait()
    RunDir.claim(run_dir).release()  # the kernel dropped the dead holder's lock: no stale lock


@pytest.mark.slow
def test_a_second_launch_is_refused_and_the_first_runs_as_if_alone(tmp_path):
    """Launch A is paused while it holds the run directory; launch B on the same directory exits 2 naming
    A; A then finishes with the losses of a lone run, bit for bit."""
    common = ["train.steps=4", "train.tensorboard=false", "train.log_every=1"]
    shared, alone = tmp_path / "shared", tmp_path / "alone"
    first = launch(common + [f"train.run_dir={shared}"])
    deadline = time.time() + 300
    while time.time() < deadline and f'"pid": {first.pid}' not in _text(shared / LOCK):
        assert first.poll() is None, first.communicate()[0]
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGSTOP)  # A holds the lock and stands still
    try:
        started = time.perf_counter()
        second = launch(common + [f"train.run_dir={shared}"])
        out = second.communicate(timeout=300)[0]
        refused_after = time.perf_counter() - started
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    assert second.returncode == 2, out
    assert f"config error: train.run_dir={shared} is in use by another launch" in out
    assert f"pid {first.pid}" in out and refused_after < 120  # a wide margin: CI may be busy
    out_first = first.communicate(timeout=300)[0]
    assert first.returncode == 0, out_first
    # the lone run, in this process (one torch thread, as the launches: tests/train/conftest.py)
    assert Trainer(compose_job(common + [f"train.run_dir={alone}"])).run() == 0
    assert last_loss_per_step(shared) == last_loss_per_step(alone)
    assert sorted(p.name for p in (shared / "checkpoints").iterdir()) == sorted(
        p.name for p in (alone / "checkpoints").iterdir()
    )


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
