"""Every dotted `moevlm.` name written for a reader resolves: in README.md, docs/*.md and conf/README.md
(code blocks included), and in the docstrings and comments of moevlm/**/*.py and kernels/**/*.py.

A name resolves to a module (`importlib.util.find_spec`), or to an attribute of the longest importable
module prefix: a module attribute, a class, a method, property or field of a class (a dataclass field
or an annotated one counts; the rest of the name is then looked up on the field's type).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import io
import re
import signal
import tokenize
import typing
from pathlib import Path

import pytest

from moevlm.signals import STOP_SIGNALS

ROOT = Path(__file__).resolve().parents[1]
# not a path (a/moevlm.x, .moevlm-run) nor the config's resolver ${moevlm.options:}
NAME = re.compile(r"(?<![\w./-])(?<!\$\{)moevlm(?:\.[A-Za-z_]\w*)+")
MISSING = object()


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "conf" / "README.md"]


def source_files() -> list[Path]:
    return sorted([*(ROOT / "moevlm").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])


def docstrings_and_comments(text: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring (module, class, function) and comment of a Python source."""
    out = []
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and (
            doc := ast.get_docstring(node, clean=False)
        ):
            out.append((node.body[0].lineno, doc))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def written_names() -> dict[str, list[str]]:
    """Each dotted moevlm name -> where it is written (`file:line`)."""
    found: dict[str, list[str]] = {}

    def add(path: Path, line: int, text: str) -> None:
        for i, row in enumerate(text.splitlines()):
            for name in NAME.findall(row):
                found.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{line + i}")

    for path in doc_files():
        add(path, 1, path.read_text())
    for path in source_files():
        for line, text in docstrings_and_comments(path.read_text()):
            add(path, line, text)
    return found


def _field_type(cls: type, attr: str):
    """The declared type of field `attr` of `cls` (dataclass or annotated), MISSING when it has none;
    None when it is declared but its type cannot be followed."""
    declared = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for klass in cls.__mro__:
        declared |= set(vars(klass).get("__annotations__", {}))
    if attr not in declared:
        return MISSING
    try:
        hint = typing.get_type_hints(cls).get(attr)
    except Exception:  # a hint naming what the module imports only for type checkers
        return None
    classes = [a for a in (typing.get_args(hint) or (hint,)) if isinstance(a, type)]
    classes = [c for c in classes if c is not type(None)]
    return classes[0] if len(classes) == 1 else None


def _member(obj, attr: str):
    """`obj.attr` for a name's next part: a class's field is its declared type."""
    if isinstance(obj, type):
        declared = _field_type(obj, attr)
        if declared is not MISSING:
            return declared
    if isinstance(obj, property):
        ret = typing.get_type_hints(obj.fget).get("return") if obj.fget else None
        return _member(ret, attr) if isinstance(ret, type) else None
    return getattr(obj, attr, MISSING)


@pytest.fixture(autouse=True)
def _stop_signals_kept():
    """Resolving a name imports its module, and moevlm.data.deaf (the fork server's first import) sets
    the stop signals to be ignored: put this process's handlers back, or the rest of the session would
    ignore Ctrl-C and every process it starts would inherit the ignored signals (a shell's traps
    then never run: tests/test_slurm.py)."""
    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    yield
    for s, handler in handlers.items():
        signal.signal(s, handler)


def resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        obj = importlib.import_module(module)
        for attr in parts[i:]:
            if obj is None:  # a field whose type cannot be followed: the rest is not checked
                return True
            obj = _member(obj, attr)
            if obj is MISSING:
                return False
        return True
    return False


def test_every_written_moevlm_name_resolves():
    unresolved = {n: where for n, where in sorted(written_names().items()) if not resolves(n)}
    report = "\n".join(f"{n}  ({', '.join(where)})" for n, where in unresolved.items())
    assert not unresolved, f"dotted moevlm names that resolve to nothing:\n{report}"


def test_the_resolver_finds_what_it_should():
    assert resolves("moevlm.data.build_shards") and resolves("moevlm.kernels")
    assert resolves("moevlm.data.REASONS") and resolves("moevlm.model.VLMConfig.preset")
    assert resolves("moevlm.model.VLMConfig.moe.permute")  # dataclass fields, followed by type
    assert not resolves("moevlm.nowhere") and not resolves("moevlm.model.VLMConfig.nowhere")
    assert not resolves("moevlm.model.VLMConfig.moe.nowhere") and not resolves(
        "moevlm.data.nowhere"
    )
    assert NAME.findall("see `moevlm.parallel.save_hf(model, dir)`.") == ["moevlm.parallel.save_hf"]
    assert (
        NAME.findall(
            "~/.cache/moevlm.x, a/moevlm.y, .moevlm-run, moevlm[parquet], ${moevlm.options:}"
        )
        == []
    )
    lines = docstrings_and_comments('"""a moevlm.x"""\ndef f():\n    """b"""\n    return 1  # c\n')
    assert sorted(text for _, text in lines) == ["# c", "a moevlm.x", "b"]
