"""moevlm.data's layering: it imports nothing from parallel/ or train/, and no module of it imports
another in a circle, counting imports made inside functions."""

import ast
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "moevlm" / "data"


def imported(path: Path) -> list[str]:
    """Every module `path` imports, at any depth of its code (relative imports are not used here)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_data_imports_nothing_from_parallel_or_train():
    for path in sorted(DATA.glob("*.py")):
        bad = [m for m in imported(path) if m.startswith(("moevlm.parallel", "moevlm.train"))]
        assert not bad, (path.name, bad)


def test_no_import_circle_among_data_modules():
    names = {p.stem for p in DATA.glob("*.py")} - {"__init__"}
    edges = {
        n: {m.split(".")[2] for m in imported(DATA / f"{n}.py") if m.startswith("moevlm.data.")}
        & names - {n}
        for n in names
    }
    done, path = set(), []

    def visit(n):
        assert n not in path, f"import circle: {' -> '.join(path[path.index(n) :] + [n])}"
        if n in done:
            return
        path.append(n)
        for m in sorted(edges[n]):
            visit(m)
        path.pop()
        done.add(n)

    for n in sorted(names):
        visit(n)
