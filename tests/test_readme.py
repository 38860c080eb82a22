"""The README's library example runs as written."""

import re
from pathlib import Path


def test_readme_python_example_runs():
    text = (Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    assert all(p.grad is not None for p in scope["model"].text.parameters())
    assert scope["out"].logits.shape[-1] == scope["cfg"].text.vocab_size


def test_readme_data_example_runs():
    from moevlm.data.sample_cache import ensure_sample

    text = (Path(__file__).parents[1] / "README.md").read_text()
    block = next(
        b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "build_loader" in b
    )
    shards = ensure_sample()[0]
    scope: dict = {}
    exec(compile(block.replace('"SHARDS"', repr(str(shards))), "README.md", "exec"), scope)
    assert scope["batch"]["input_ids"].shape == (1, 4096) and scope["state"]["states"]


def test_readme_own_data_commands_run(tmp_path):
    """The Data section's commands, as written, on packaged photos and a caption JSONL
    written here: shards with the tokenizer beside them, then a short training run."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from moevlm.data.sample import sample_photo_paths

    repo = Path(__file__).parents[1]
    text = (repo / "README.md").read_text()
    block = next(
        b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) if "--tokenizer" in b
    )
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
    env = {**os.environ, "PYTHONPATH": str(repo)}
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
