"""The layout's rules, read from the source with ``ast`` (nothing is imported):

- no import cycle among polyrl's modules (imports that run when a module loads, and those under
  ``if TYPE_CHECKING:``: a cycle of types is a cycle of design; imports inside functions do not count);
- no polyrl import inside a function in ``polyrl/envs``, ``polyrl/workflows`` and ``polyrl/config``:
  those sit low, and a function-level import is how an upward import hides;
- no import of an underscore name from another module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {_module_name(p): p for p in sorted((ROOT / "polyrl").rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in FILES.items()}


def _rel(name: str) -> str:
    return str(FILES[name].relative_to(ROOT))


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _load_time_imports(body: list[ast.stmt], typing: bool = False):
    """The import statements that run when the module loads (and, with ``typing``, those under
    ``if TYPE_CHECKING:``)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                _is_type_checking(node) and not typing):
            continue
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):  # if, try, with, class bodies
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    yield from _load_time_imports(inner, typing)


def _targets(node: ast.Import | ast.ImportFrom, importer: str) -> list[tuple[str, str | None]]:
    """The polyrl modules an import statement loads, each with the name it takes from it (if any)."""
    if isinstance(node, ast.Import):
        return [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "polyrl"]
    base = node.module or ""
    if node.level:  # relative: from the importer's package, one level up per extra dot
        package = importer.split(".") if FILES[importer].name == "__init__.py" else importer.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    if base.split(".")[0] != "polyrl":
        return []
    out: list[tuple[str, str | None]] = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        out.append((submodule, None) if submodule in FILES else (base, alias.name))
    return out


def _graph() -> dict[str, set[str]]:
    return {name: {target for node in _load_time_imports(tree.body, typing=True)
                   for target, _ in _targets(node, name)
                   if target in FILES and target != name}
            for name, tree in TREES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_what_it_looks_for():
    """The rules' own machinery on made-up sources: a cycle, a function-level import, a private name."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("import os\nfrom polyrl.envs import base\n"
                     "if TYPE_CHECKING:\n    from polyrl.rl import train\n"
                     "try:\n    import polyrl.rl.rollouts\nexcept ImportError:\n    pass\n"
                     "def f():\n    from polyrl.rl.train import x\n")
    loaded = [t for node in _load_time_imports(tree.body) for t in _targets(node, "polyrl.rl.episode")]
    assert loaded == [("polyrl.envs.base", None), ("polyrl.rl.rollouts", None)]
    typed = [t for node in _load_time_imports(tree.body, typing=True)
             for t in _targets(node, "polyrl.rl.episode")]
    assert typed == [("polyrl.envs.base", None), ("polyrl.rl.train", None), ("polyrl.rl.rollouts", None)]
    assert _function_level(tree) == ["from polyrl.rl.train import x (line 10)"]
    private = ast.parse("from polyrl.envs.builtin.base import _helper, public\n")
    assert _private_names(private, "polyrl.rl.train") == ["_helper from polyrl.envs.builtin.base (line 1)"]


def test_no_import_cycle_among_polyrl_modules():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def _function_level(tree: ast.Module) -> list[str]:
    found = []
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and _targets(node, "polyrl.x"):
                    found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return sorted(set(found), key=lambda s: int(s.rsplit("line ", 1)[1][:-1]))


LOW = [name for name in FILES if name.startswith(("polyrl.envs", "polyrl.workflows", "polyrl.config"))]


def _cases(names: list[str], known: dict[str, pytest.MarkDecorator]) -> list:
    """``names`` as test cases; the ``known`` failures of work under way marked as such."""
    return [pytest.param(n, marks=known[n], id=_rel(n)) if n in known else pytest.param(n, id=_rel(n))
            for n in names]


@pytest.mark.parametrize("name", _cases(LOW, {}))
def test_no_function_level_polyrl_import_in_low_modules(name):
    found = _function_level(TREES[name])
    assert not found, f"{_rel(name)} imports polyrl inside functions: {', '.join(found)}"


def _private_names(tree: ast.Module, importer: str) -> list[str]:
    return [f"{alias} from {module} (line {node.lineno})"
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            for module, alias in _targets(node, importer)
            if alias and alias.startswith("_") and not alias.startswith("__") and module != importer]


@pytest.mark.parametrize("name", _cases(list(FILES), {}))
def test_no_underscore_name_is_imported_from_another_module(name):
    found = _private_names(TREES[name], name)
    assert not found, f"{_rel(name)} imports private names of other modules: {', '.join(found)}"


def test_the_config_schema_is_a_leaf():
    """``polyrl/config/schema.py`` imports, anywhere in it, only the environment entry's schema and the
    leaves errors, secrets and optim_ranges: files, checks, errors and the reference sit above it."""
    imports = [node for node in ast.walk(TREES["polyrl.config.schema"])
               if isinstance(node, (ast.Import, ast.ImportFrom))]
    imported = {module for node in imports for module, _ in _targets(node, "polyrl.config.schema")}
    assert imported <= {"polyrl.config.env", "polyrl.errors", "polyrl.secrets", "polyrl.optim_ranges"}, \
        sorted(imported)
