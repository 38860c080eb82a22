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
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "build_loader" in b)
    shards = ensure_sample()[0]
    scope: dict = {}
    exec(compile(block.replace('"SHARDS"', repr(str(shards))), "README.md", "exec"), scope)
    assert scope["batch"]["input_ids"].shape == (1, 4096) and scope["state"]["states"]
