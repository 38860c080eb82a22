"""The README's library example, and the guide's loader example and own-data commands, run as written."""

import re
from pathlib import Path

import pytest
import user_docs
from processes import processes_with_env


@pytest.mark.parametrize("page", ["README.md", "docs/library.md"])
def test_readme_python_example_runs(page):
    blocks = user_docs.blocks("python", page)
    assert blocks, f"{page} has no python example"
    scope: dict = {}
    exec(compile(blocks[0], page, "exec"), scope)
    assert all(p.grad is not None for p in scope["model"].text.parameters())
    assert scope["out"].logits.shape[-1] == scope["cfg"].text.vocab_size


@pytest.mark.slow
def test_readme_loader_example_runs_as_a_script_and_ends(tmp_path):
    """docs/data.md's loader example, exactly as written, as its own script: it prints a batch's
    shape and the stats, and the interpreter exits by itself (no close() needed; a hang runs into the
    timeout) leaving no worker or fork server behind (found by an environment tag they inherit).  The
    session's sample cache."""
    import os
    import subprocess
    import sys
    import time
    import uuid

    block = next(b for b in user_docs.blocks("python", "docs/data.md") if "build_loader" in b)
    assert 'if __name__ == "__main__":' in block
    (tmp_path / "example.py").write_text(block)
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "README_TAG": tag}
    t0 = time.monotonic()
    # the one bound, wide (tests/data/test_loader_lifetime.py): it only stops a hang
    proc = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    took = time.monotonic() - t0
    print(f"README loader example: exit {proc.returncode} after {took:.1f} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("torch.Size([1, 4096]) {'skipped'"), proc.stdout
    assert "'samples_packed': 0," not in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["example.py"]
    left, deadline = processes_with_env(f"README_TAG={tag}"), time.monotonic() + 300
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = processes_with_env(f"README_TAG={tag}")
    assert not left, f"processes left after the example exited: {sorted(left)}"


@pytest.mark.slow
def test_readme_own_data_commands_run(tmp_path):
    """docs/data.md's own-data commands, as written, on packaged photos and a caption JSONL
    written here: shards with the tokenizer beside them, then a short training run."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from moevlm.data.sample import sample_photo_paths

    repo = Path(__file__).parents[1]
    block = next(b for b in user_docs.blocks("bash", "docs/data.md") if "--tokenizer" in b)
    (tmp_path / "photos").mkdir()
    photos = sample_photo_paths()
    for p in photos:
        shutil.copy(p, tmp_path / "photos" / p.name)
    (tmp_path / "captions.jsonl").write_text(
        "".join(
            json.dumps(
                {"image": p.name, "caption": f"A photograph called {p.stem.replace('_', ' ')}."}
            )
            + "\n"
            for p in photos * 2
        )
    )
    # exactly the README's commands, no extra flags: the default 20-step CPU job, which exits 1 unless the loss falls
    script = block.replace("python train.py", f"python {repo / 'train.py'}").replace(
        "python ", f"{sys.executable} "
    )
    assert re.search(r"train\.py data\.shards=\S+\s*$", script), (
        "the README's training command is not `python train.py data.shards=...`"
    )
    # one torch thread: the tiny model gains nothing from a second (tests/train/conftest.py)
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=tmp_path,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "my_shards" / "tokenizer.json").is_file()
    # what the commands made (not the inputs written above) is what .gitignore covers
    made = [p.name + "/" for p in tmp_path.iterdir() if p.name not in ("photos", "captions.jsonl")]
    assert sorted(made) == ["my_shards/", "outputs/", "sample_shards/"]
    for name in made:
        ignored = subprocess.run(["git", "check-ignore", "--no-index", "-q", name], cwd=repo)
        assert ignored.returncode == 0, f"{name} is not in .gitignore"
    assert len(
        json.loads((tmp_path / "my_shards" / "summary.json").read_text())["shards"]
    ) == 2 * len(photos)
    metrics = [
        json.loads(line)
        for line in next(tmp_path.glob("outputs/*/*/metrics.jsonl")).read_text().splitlines()
    ]
    assert [m["step"] for m in metrics if "loss" in m][
        -1
    ] == 20 and "ok: mean loss of the first 3 steps" in proc.stdout
