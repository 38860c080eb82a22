"""The structure the code keeps: nothing rewrites a model's classes or patches its methods, the model
imports no parallelism, and a dispatcher is built once per MoE layer by whoever builds the model."""

from __future__ import annotations

import ast
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from moevlm.dispatch import DispatcherSpec
from moevlm.parallel.build import BuildOptions

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "moevlm").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])


def _functions_in_scope(tree: ast.AST) -> set[str]:
    return {
        n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def _is_function_value(value: ast.AST, local_defs: set[str]) -> bool:
    """A lambda, a locally defined function, or a call that makes a function (disable, wraps, partial)."""
    if isinstance(value, ast.Lambda):
        return True
    if isinstance(value, ast.Name) and value.id in local_defs:
        return True
    if isinstance(value, ast.Call):
        name = ast.unparse(value.func)
        return name.endswith(("compiler.disable", "functools.partial", "partial", "wraps"))
    return False


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    local_defs = _functions_in_scope(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and t.attr == "__class__":
                        out.append(f"{path.name}:{node.lineno} assigns __class__")
                    elif (
                        isinstance(t, ast.Attribute)
                        and _is_function_value(node.value, local_defs)
                        and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                    ):
                        out.append(
                            f"{path.name}:{node.lineno} assigns a function to {ast.unparse(t)}"
                        )
                    elif isinstance(t, ast.Subscript) and ast.unparse(t.value).endswith("__dict__"):
                        if _is_function_value(node.value, local_defs):
                            out.append(
                                f"{path.name}:{node.lineno} puts a function in {ast.unparse(t.value)}"
                            )
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "setattr"
            and len(node.args) == 3
        ):
            if _is_function_value(node.args[2], local_defs):
                out.append(f"{path.name}:{node.lineno} setattr of a function")
    return out


# The planner (moevlm/plan/) simulates on a CPU build what it lacks, by patching torch for the span of
# a context manager and restoring it after; never a model.  Exactly these, by file and target:
PLANNER_PATCHES = {
    ("dry_run.py", "schedule._warmup_p2p"),  # the pipeline schedule's first-step vote over p2p
    ("environments.py", "dist.all_gather_object"),  # objects travel as tensors fake tensors lack
    ("fake.py", "torch.UntypedStorage.resize_"),  # FSDP's in-place storage resizes, tracked
    ("environments.py", "FakeTensor.__int__"),  # fake CUDA: C++ needs a CUDA device guard for these
    ("environments.py", "FakeTensor.__float__"),
    ("environments.py", "FakeTensor.__bool__"),
    ("environments.py", "FakeTensor.__index__"),
}


def test_no_class_rewriting_or_method_patching_in_the_product():
    found = [p for path in SOURCES for p in _problems(path)]
    planner = {
        (p.split(":")[0], p.split(" to ")[-1]) for p in found if " assigns a function to " in p
    } & PLANNER_PATCHES
    rest = [p for p in found if (p.split(":")[0], p.split(" to ")[-1]) not in planner]
    assert not rest, rest
    assert planner == PLANNER_PATCHES  # the list above stays exact


def test_the_check_above_finds_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\n"
        "def f(m):\n    m.__class__ = int\n"
        "def g(m):\n    def run(*a):\n        return a\n    m.forward = run\n"
        "def h(m):\n    m.forward = torch.compiler.disable(m.forward)\n"
        "def k(m):\n    m.__dict__['x'] = lambda: 0\n"
    )
    assert len(_problems(bad)) == 4, _problems(bad)


@pytest.mark.slow
def test_model_imports_no_parallelism():
    """`moevlm.model` imports nothing from parallel/, train/, data/ or dispatch/, not even lazily."""
    banned = ("moevlm.parallel", "moevlm.train", "moevlm.data", "moevlm.dispatch")
    for path in (ROOT / "moevlm" / "model").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not [n for n in names if n.startswith(banned)], (path.name, node.lineno, names)
    code = (
        "import sys, moevlm.model; "
        "print(sorted(m for m in sys.modules if m.startswith(('moevlm.parallel', 'moevlm.dispatch'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", out


def test_built_model_has_no_function_attributes_and_repr_shows_what_runs():
    """Under every build step that wraps (recompute, activation offload, CUDA-graph regions), no module
    instance holds a function of its own; the regions are modules, so `repr(model)` names them."""
    from moevlm.model import VLMConfig
    from moevlm.parallel import ParallelDims, build_model

    cfg = VLMConfig.preset("tiny")
    cfg.attn_backend = "sdpa"
    model, ctx = build_model(
        cfg,
        ParallelDims(1),
        BuildOptions(
            recompute=("selective", ("core_attn", "moe_act", "layernorm")),
            offload=("core_attn",),
            cuda_graph_scope=("moe_router",),
        ),
    )
    for name, m in model.named_modules():
        own = {
            k: v
            for k, v in vars(m).items()
            if isinstance(v, (types.FunctionType, types.MethodType))
        }
        assert not own, (name, own)
    text = repr(model)
    assert (
        "Recompute()" in text
        and "scope=core_attn" in text
        and "GraphedRegion(moe_router" in text
        and "LocalDispatcher(local" in text
    )
    assert ctx.cuda_graphs is not None and len(ctx.cuda_graphs.regions) == sum(
        layer.is_moe for layer in model.text.layers
    )


@pytest.mark.parametrize("name", ["local", "alltoall"])
def test_dispatcher_built_once_per_moe_layer(monkeypatch, name):
    from moevlm.dispatch import DISPATCHERS
    from moevlm.model import VLMConfig
    from moevlm.model.moe import MoEBlock
    from moevlm.parallel import ParallelDims, build_model

    cls, made = DISPATCHERS[name], []
    init = cls.__init__

    def counting(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", counting)
    cfg = VLMConfig.preset("tiny")
    model, _ = build_model(cfg, ParallelDims(1), BuildOptions(dispatcher=DispatcherSpec(name)))
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    assert blocks and len(made) == len(blocks)
    assert [id(b.dispatcher) for b in blocks] == [id(d) for d in made]
    assert all(type(b.dispatcher) is cls for b in blocks)
    assert torch.device("meta") == next(model.parameters()).device


# ------------------------------------------------------------------ the layout of the files
# package -> the moevlm packages its files may import (its own included); top-level modules are
# moevlm.errors, moevlm.fields, moevlm.comm, moevlm.signals, moevlm.files, moevlm.kernels
MAY_IMPORT = {
    "kernels": {"kernels"},
    "model": {"model", "kernels", "errors", "exports"},
    "dispatch": {"dispatch", "model", "kernels", "comm", "errors"},
    "parallel": {"parallel", "dispatch", "model", "kernels", "comm", "errors", "files", "exports"},
    "data": {"data", "model", "kernels", "errors", "fields", "signals", "files", "exports"},
    "config": {"config", "data", "dispatch", "parallel", "model", "kernels", "errors", "fields"},
}


def _module(path: Path) -> str:
    """The dotted module a product file is (kernels/ is installed as moevlm.kernels)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":
        parts = ["moevlm", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every moevlm import of a file, inside functions too; not the ones under
    `if TYPE_CHECKING:` (annotations only)."""
    tree = ast.parse(path.read_text())
    hidden = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for n in ast.walk(node)
    }
    out = []
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(line, name) for line, name in out if name.startswith("moevlm.")]


def _graph() -> dict[str, set[str]]:
    """Product module -> the product modules it imports (a `from package import name` names the
    submodule when there is one, else the package)."""
    modules = {_module(p): p for p in SOURCES}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for _, imported in _imports(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_product_file_is_over_650_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in [*SOURCES, ROOT / "train.py"]
        if (n := len(p.read_text().splitlines())) > 650
    }
    assert long == {}


def test_no_import_circle_among_product_files():
    """Counting the imports made inside functions too: a circle held together by a late import is
    still a circle."""
    assert _circles(_graph()) == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_each_package_imports_only_the_layers_below_it():
    """model/ nothing of parallel/, train/, data/, dispatch/ or config/; data/ nothing of parallel/ or
    train/; config/ nothing of train/ or the planner; and so on (MAY_IMPORT)."""
    wrong = []
    for path in SOURCES:
        package = _module(path).split(".")[1] if "." in _module(path) else ""
        allowed = MAY_IMPORT.get(package)
        if allowed is None:
            continue
        for line, name in _imports(path):
            if name.split(".")[1] not in allowed:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert wrong == []


def test_nothing_imports_a_main_module():
    found = [
        f"{p.relative_to(ROOT)}:{line} {name}"
        for p in [
            *SOURCES,
            ROOT / "train.py",
            *ROOT.glob("bench/*.py"),
            *ROOT.glob("tests/**/*.py"),
        ]
        for line, name in _imports(p)
        if ".__main__" in name
    ]
    assert found == []


def test_module_docstrings_say_what_the_module_is_in_a_dozen_lines():
    """The median module docstring is at most 12 lines; the design rationale lives in
    docs/architecture.md, and no docstring carries a "Design choices" essay."""
    lengths, essays = [], []
    for path in SOURCES:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        lengths.append(len(doc.splitlines()))
        if "Design choices" in doc:
            essays.append(str(path.relative_to(ROOT)))
    lengths.sort()
    assert lengths[len(lengths) // 2] <= 12, lengths
    assert essays == []


def _names_compared(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines where a value is compared with one of `names` (==, !=, in a literal tuple/list/set)."""

    def literals(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(literals(e) for e in node.elts))
        return set()

    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and literals(node.left).union(*(literals(c) for c in node.comparators)) & names
    ]


def test_the_dispatcher_backend_is_chosen_in_one_function(monkeypatch):
    """`model.dispatcher` becomes a DispatcherSpec in moevlm.config.dispatcher.choose_dispatcher and
    nowhere else: no product code outside it (and the backends themselves) compares a backend name,
    and the model built from the plan runs exactly the backend that function chose."""
    from moevlm.config import compose_job, validate
    from moevlm.config import validation as validate_module
    from moevlm.dispatch import DISPATCHERS, DispatcherSpec, LocalDispatcher
    from moevlm.model.moe import MoEBlock
    from moevlm.parallel import build_model

    names = set(DISPATCHERS)
    allowed = {
        ROOT / "moevlm" / "config" / "dispatcher.py",
        *(ROOT / "moevlm" / "dispatch").glob("*.py"),
    }
    found = {
        str(p.relative_to(ROOT)): lines
        for p in SOURCES
        if p not in allowed and (lines := _names_compared(ast.parse(p.read_text()), names))
    }
    assert found == {}
    assert _names_compared(ast.parse("x.name == 'alltoall'\ny in ('a', 'deepep')"), names) == [1, 2]

    class ChosenForTest(LocalDispatcher):  # a test double: the local dispatcher under another name
        name = "chosen_for_test"

    monkeypatch.setitem(DISPATCHERS, ChosenForTest.name, ChosenForTest)
    chosen = validate_module.choose_dispatcher
    monkeypatch.setattr(
        validate_module,
        "choose_dispatcher",
        lambda *a, **k: (DispatcherSpec(ChosenForTest.name), chosen(*a, **k)[1]),
    )
    plan = validate(compose_job(["data.shards=sample"]))
    model, _ = build_model(plan.model, plan.dims, plan.build)
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    assert blocks and all(type(b.dispatcher) is ChosenForTest for b in blocks)


# Attributes a foreign base class's own constructor or set-up call creates, which a subclass then
# assigns again: not born outside a constructor.
INHERITED = {
    ("_SafePlanner", "state_dict"): "torch's DefaultLoadPlanner.set_up_planner",
    ("Scheduler", "last_epoch"): "torch's LRScheduler.__init__",
    ("Scheduler", "_step_count"): "torch's LRScheduler.__init__",
    ("Scheduler", "_last_lr"): "torch's LRScheduler.__init__",
}
CONSTRUCTORS = {"__init__", "__post_init__", "__new__", "__setstate__"}


def _born_outside_constructor(tree: ast.AST) -> list[str]:
    """`Class.attr (method)` for each `self.attr` first assigned outside the class's constructor and
    its class body (dataclass fields, class attributes)."""
    out = []
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        born, later = set(), {}
        for st in cls.body:
            targets = st.targets if isinstance(st, ast.Assign) else [getattr(st, "target", None)]
            born |= {t.id for t in targets if isinstance(t, ast.Name)}
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else []
                if isinstance(node, ast.AugAssign | ast.AnnAssign):
                    targets = [node.target]
                for attr in (e for t in targets for e in ast.walk(t)):
                    if isinstance(attr, ast.Attribute) and getattr(attr.value, "id", "") == "self":
                        if fn.name in CONSTRUCTORS:
                            born.add(attr.attr)
                        else:
                            later.setdefault(attr.attr, fn.name)
        out += [
            f"{cls.name}.{a} ({m})"
            for a, m in later.items()
            if a not in born and (cls.name, a) not in INHERITED
        ]
    return out


def test_no_attribute_is_born_outside_its_constructor():
    found = {
        str(p.relative_to(ROOT)): bad
        for p in SOURCES
        if (bad := _born_outside_constructor(ast.parse(p.read_text())))
    }
    assert found == {}


def test_the_attribute_check_finds_a_late_attribute():
    src = (
        "class A:\n    x: int = 0\n    def __init__(self):\n        self.y = 1\n"
        "    def go(self):\n        self.x = self.y = 2\n        self.z = 3\n"
    )
    assert _born_outside_constructor(ast.parse(src)) == ["A.z (go)"]
