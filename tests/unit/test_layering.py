"""Dependencies point one way (docs/architecture.md), and no module of ``torchrelay`` imports itself
back: checked on the import statements of every module.

Every ``import`` counts, wherever it stands (a function body, ``if TYPE_CHECKING:``) and however it
is spelled (absolute, relative, ``importlib.import_module("…")`` with the name written out): an import moved into a function to dodge a cycle is still one.
``from package import name`` depends on the submodule ``package.name`` when there is one, else on
the package. A module importing a package that contains it (its own package's ``__init__``, for
re-exports) is not an edge.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "torchrelay"

# package prefix -> torchrelay packages it must not import
FORBIDDEN = {
    "torchrelay.spec": ("torchrelay.server", "torchrelay.client", "torchrelay.agent", "torchrelay.train",
                        "torchrelay.scheduler"),
    "torchrelay.scheduler": ("torchrelay.server", "torchrelay.client", "torchrelay.agent", "torchrelay.train"),
    "torchrelay.train": ("torchrelay.server", "torchrelay.client", "torchrelay.scheduler"),
    "torchrelay.agent": ("torchrelay.server", "torchrelay.scheduler", "torchrelay.train"),
    "torchrelay.server": ("torchrelay.client", "torchrelay.agent", "torchrelay.train"),
    "torchrelay.client": ("torchrelay.train", "torchrelay.scheduler"),
    "torchrelay.shards": ("torchrelay.server", "torchrelay.client", "torchrelay.agent", "torchrelay.train",
                          "torchrelay.scheduler"),
    "torchrelay.storage": ("torchrelay.server", "torchrelay.client", "torchrelay.agent", "torchrelay.train",
                           "torchrelay.scheduler", "torchrelay.shards"),
}
# the CLI verbs that start a server or an agent process in the foreground may import them
ALLOWED = {"torchrelay.client.cli.server": ("torchrelay.server",), "torchrelay.client.cli.agent": ("torchrelay.agent",)}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__``)."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        out[".".join(rel.parts).removesuffix(".__init__")] = path
    return out


MODULES = modules()


def _absolute(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name of ``node``'s ``from`` part, as seen from module ``name``."""
    if node.level == 0:
        return node.module or ""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports, anywhere in its file (absolute names; third-party ones too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(name, path, node)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                out.add(submodule if submodule in MODULES else source)
        elif _imports_by_name(node):
            out.add(node.args[0].value)
    return out


def _imports_by_name(node: ast.AST) -> bool:
    """``importlib.import_module("a.b")`` or ``__import__("a.b")`` with the name written out."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return False
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or \
        (isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))


def import_graph() -> dict[str, set[str]]:
    """``module -> the torchrelay modules it imports``, without edges to a package containing it."""
    graph = {}
    for name, path in MODULES.items():
        graph[name] = {target for target in imports_of(name, path)
                       if target in MODULES and target != name and not name.startswith(target + ".")}
    return graph


def knots(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of two or more modules that all reach each other by imports (sorted). Pure."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return groups


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle (``[a, b, …, a]``) through each knot. Pure."""
    return [_cycle_through(group, graph) for group in knots(graph)]


def _cycle_through(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle from the group's first module back to it, within the group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & members):
                if target == start:
                    return paths[node] + [start]
                if target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{group} is not strongly connected")


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": set()}, []),
    ({"a": {"b"}, "b": {"a"}}, [["a", "b", "a"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c", "a"]]),
    ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b", "a"], ["c", "d", "c"]]),
    ({"a": {"b", "c"}, "b": {"c"}, "c": {"a"}}, [["a", "c", "a"]]),
])
def test_find_cycles_names_one_cycle_per_group(graph, expected):
    assert sorted(find_cycles(graph)) == expected


@pytest.mark.parametrize("name, source, expected", [
    ("torchrelay.train.ps.client", "from . import protocol", {"torchrelay.train.ps.protocol"}),
    ("torchrelay.train.ps.client", "from .plan import Plan", {"torchrelay.train.ps.plan"}),
    ("torchrelay.train.ps.client", "from .. import sync", {"torchrelay.train.sync"}),
    ("torchrelay.train.ps", "from .client import PSOptimizer", {"torchrelay.train.ps.client"}),
    ("torchrelay.train.data", "from torchrelay.train import ps", {"torchrelay.train.ps"}),
    ("torchrelay.train.data", "def f():\n    import torchrelay.train.context", {"torchrelay.train.context"}),
    ("torchrelay.train.data", "import importlib\nimportlib.import_module('torchrelay.train.report')",
     {"importlib", "torchrelay.train.report"}),
])
def test_imports_are_resolved_wherever_they_stand(name, source, expected, tmp_path):
    path = tmp_path / ("__init__.py" if name == "torchrelay.train.ps" else "m.py")
    path.write_text(source)
    assert imports_of(name, path) == expected


def test_no_module_imports_itself_back():
    graph = import_graph()
    found = [f"{' -> '.join(_cycle_through(group, graph))} (the knot: {', '.join(group)})" for group in knots(graph)]
    assert not found, "import cycles in torchrelay/: " + "; ".join(found)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_respects_layers(name):
    rules = [bad for prefix, bad in FORBIDDEN.items() if name == prefix or name.startswith(prefix + ".")]
    allowed = ALLOWED.get(name, ())
    for imported in imports_of(name, MODULES[name]):
        for bad in (b for group in rules for b in group):
            if (imported == bad or imported.startswith(bad + ".")) and bad not in allowed:
                pytest.fail(f"{name} imports {imported}, which its layer must not depend on")
