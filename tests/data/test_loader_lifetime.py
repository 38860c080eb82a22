"""The loader as a library: `with build_loader(...)` stops the workers (an exception included), and the
workers end with the process that uses the loader when it is killed (SIGKILL), even while it is still
an unreaped zombie (a pid probe takes that for alive: the fork server's end is what ends them), and
when an uncaught exception ends it.  The README's example run as a script (normal exit, no close()):
tests/test_readme.py."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from processes import processes_with_env

# scripts in their own processes: left out of the fast tier (`-m "not slow"`)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# the one bound, wide: it only stops a hang (on a loaded machine the fork server's exit takes seconds)
WIDE_S = 300

SCRIPT = textwrap.dedent(
    """
    import sys
    import time

    from moevlm.data import DataConfig, build_loader
    from moevlm.model import VLMConfig

    if __name__ == "__main__":
        cfg, model = DataConfig(shards="sample"), VLMConfig.preset("tiny")
        if sys.argv[1:] == ["raise"]:
            loader = build_loader(cfg, model)
            next(loader)
            print("workers", *[w.pid for w in loader._it._workers], flush=True)
            raise RuntimeError("uncaught, with the loader open")
        try:
            with build_loader(cfg, model) as loader:
                assert next(loader)["input_ids"].shape == (1, cfg.pack.seq_len)
                workers = list(loader._it._workers)
                raise KeyError("inside the with block")
        except KeyError:
            pass
        assert loader._it is None and workers and not any(w.is_alive() for w in workers)
        print("with: workers stopped", flush=True)
        loader = build_loader(cfg, model)
        next(loader)
        print("workers", *[w.pid for w in loader._it._workers], flush=True)
        time.sleep(600)
    """
)


def tagged(tag: str) -> set[int]:
    """The processes whose environment holds LIFETIME_TAG=`tag`: the script, its fork server, resource
    tracker and workers (they inherit the environment), wherever they were reparented."""
    return processes_with_env(f"LIFETIME_TAG={tag}")


def test_with_form_and_workers_end_with_a_killed_parent(tmp_path):
    (tmp_path / "use_loader.py").write_text(SCRIPT)
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(REPO), "LIFETIME_TAG": tag}
    proc = subprocess.Popen(
        [sys.executable, "use_loader.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert lines[0].strip() == "with: workers stopped", lines
        workers = {int(p) for p in lines[1].split()[1:]}
        assert len(workers) == 2 and workers <= tagged(tag)
        os.kill(proc.pid, signal.SIGKILL)
        # not reaped yet: the script stays a zombie while the rest must go
        t0, left = time.monotonic(), tagged(tag) - {proc.pid}
        while left and time.monotonic() - t0 < WIDE_S:
            time.sleep(0.05)
            left = tagged(tag) - {proc.pid}
        gone_s = time.monotonic() - t0
        print(f"workers and fork server gone {gone_s:.2f} s after the SIGKILL")
        assert not left, f"still running {gone_s:.0f} s after the SIGKILL: {sorted(left)}"
    finally:
        proc.kill()
        proc.wait()


def test_an_uncaught_exception_ends_the_script_and_its_workers(tmp_path):
    """No `with`, no close(): the exception's exit closes the loader (interpreter exit); it ends."""
    (tmp_path / "use_loader.py").write_text(SCRIPT)
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(REPO), "LIFETIME_TAG": tag}
    # the script ends by itself (a hang would run into the timeout)
    proc = subprocess.run(
        [sys.executable, "use_loader.py", "raise"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=WIDE_S,
        check=False,
    )
    assert proc.returncode == 1 and "uncaught, with the loader open" in proc.stderr, proc.stderr
    assert proc.stdout.startswith("workers "), proc.stdout
    deadline = time.monotonic() + WIDE_S
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not tagged(tag), "a worker or the fork server outlived the script"
