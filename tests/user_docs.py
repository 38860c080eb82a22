"""The user's documentation, for the tests that run or check what it says: README.md and the guide
pages in docs/ that hold its commands and examples (each test reads the page it checks)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = (
    "README.md",
    "docs/data.md",
    "docs/training.md",
    "docs/parallel.md",
    "docs/checkpoints.md",
    "docs/faults.md",
    "docs/fp8.md",
    "docs/plans.md",
    "docs/library.md",
)


def read(page: str) -> str:
    return (REPO / page).read_text()


def blocks(lang: str, page: str | None = None) -> list[str]:
    """The ```lang fenced blocks of `page`, or of every page in PAGES order."""
    pages = PAGES if page is None else (page,)
    return [b for p in pages for b in re.findall(rf"```{lang}\n(.*?)```", read(p), flags=re.S)]
