"""No file in the repository points at a document the repository does not hold, or at an issue number.

A reader of the repository has its files and nothing else: a reference to a note kept elsewhere
(DESIGN.md, DISPATCHERS.md, STYLE.md, FACTS.md, or any `*.md` path that does not exist here) or to an
issue tracker's number ("issue 17", "issue #17") tells them nothing.  What a user or maintainer needs
is in README.md, conf/README.md and docs/.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".sbatch"}
SKIP_DIRS = {
    ".git",
    ".venv",
    "venv",
    "build",
    "dist",
    "outputs",
    "multirun",
    "runs",
    "__pycache__",
    ".pytest_cache",
    "gpu_suite_out",
}

# (file, line) pairs exempt from the check: none.
ALLOWED: set[tuple[str, int]] = set()

# Files the code writes (not documents): named in the docs and tests that describe or read them.
GENERATED = {
    "summary.md",
    "profile_components.md",
    "profile_components_rank<R>.md",
    "table.md",
    "t.md",
}

NOTES = re.compile(
    r"\b(?:DESIGN|DISPATCHERS|STYLE|FACTS)\.md\b|\b(?:DESIGN|STYLE|FACTS)\b(?=\s*(?:§|\d|\)))"
)
ISSUE = re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE)
MD_PATH = re.compile(r"[\w./<>-]*\w\.md\b")
URL = re.compile(r"\w+://\S+")


def repo_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files (a git checkout), else a walk of the tree."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        paths = [ROOT / p for p in out if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in ROOT.rglob("*") if not SKIP_DIRS & set(p.relative_to(ROOT).parts)]
    return sorted(
        p for p in paths if p.suffix in SUFFIXES and p.is_file() and p != Path(__file__).resolve()
    )


def missing_md(path: Path, token: str) -> bool:
    """`token` names a markdown file found neither beside `path` nor from the repository root."""
    if Path(token).name in GENERATED:
        return False
    return not any((base / token).exists() for base in (path.parent, ROOT))


def line_problems(path: Path, line: str) -> list[str]:
    line = URL.sub("", line)
    found = [f"note {m.group(0)!r}" for m in NOTES.finditer(line)]
    found += [f"issue number {m.group(0)!r}" for m in ISSUE.finditer(line)]
    found += [
        f"missing document {t!r}"
        for t in MD_PATH.findall(line)
        if not NOTES.search(t) and missing_md(path, t)
    ]
    return found


def all_problems() -> dict[tuple[str, int], list[str]]:
    problems = {}
    for path in repo_files():
        rel = path.relative_to(ROOT).as_posix()
        for i, line in enumerate(
            path.read_text(encoding="utf-8", errors="replace").splitlines(), 1
        ):
            found = line_problems(path, line)
            if found:
                problems[rel, i] = found
    return problems


def test_no_reference_outside_the_repository():
    problems = {k: v for k, v in all_problems().items() if k not in ALLOWED}
    report = "\n".join(f"{f}:{n}: {', '.join(v)}" for (f, n), v in sorted(problems.items()))
    assert not problems, f"references to documents or issues outside the repository:\n{report}"


def test_allow_list_is_current():
    """Every allowed hit still exists: a fixed one must leave ALLOWED (which must end empty)."""
    stale = ALLOWED - set(all_problems())
    assert not stale, (
        f"no longer referring outside the repository, remove from ALLOWED: {sorted(stale)}"
    )


def test_the_checks_catch_what_they_should():
    here = ROOT / "tests" / "x.py"
    assert line_problems(here, "see DESIGN.md") and line_problems(here, "(STYLE 12)")
    assert line_problems(here, "as issue #17 says") and line_problems(here, "Issue 3")
    assert line_problems(here, "docs/nowhere.md")
    assert not line_problems(here, "docs/architecture.md, README.md, sorted(DISPATCHERS)")
    assert not line_problems(here, "https://example.org/a/README.md")
