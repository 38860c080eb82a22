"""The tree is formatted as `ruff format` writes it ([tool.ruff] in pyproject.toml: 100 columns; ruff is
pinned in the dev extra, since a new release may format differently)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_tree_is_formatted():
    pytest.importorskip("ruff", reason="ruff is not installed (pip install -e '.[dev]' brings it)")
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, (
        f"run `ruff format .` at the repository root:\n{out.stdout[-3000:]}{out.stderr[-2000:]}"
    )
