"""The core's import graph: no module imports itself back through others, and every import points
down the layers architecture.md draws (read from the source with ``ast``; imports inside
``if TYPE_CHECKING:`` are for type checkers only and are left out, as is the package face's
lazy ``__getattr__``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fastdeploy_core"

#: Rooms from the bottom up; a module may import its own room and the rooms below it.
LAYERS = [
    {"__init__", "errors", "hookspecs", "host_memory", "default_model", "sealing"},
    {"devices", "config"},
    {"plugins"},
    {"layers"},
    {"loader"},
    {"quantization"},
    {"tokenizer"},
    {"guided"},
    {"executor"},
    {"spec_decode"},
    {"scheduler"},
    {"disaggregation"},
    {"engine"},
    {"entrypoints"},
    {"router"},
    {"cli"},
    {"testing"},
    {"builtin"},
]
RANK = {room: rank for rank, rooms in enumerate(LAYERS) for room in rooms}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = module.split(".")
                    anchor = anchor if is_package else anchor[:-1]
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in child.names)
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        if name == "fastdeploy_core":
            continue  # the package face: lazy exports and the process settings only
        imported = _imports(ast.parse(path.read_text()), name, path.name == "__init__.py")
        graph[name] = {target for target in imported if target in files and target != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"  # the package face: version numbers only


def test_the_graph_is_read():
    graph = _graph()
    assert "fastdeploy_core.executor.step_io" in graph["fastdeploy_core.engine.scheduler"]
    assert "fastdeploy_core.quantization.base" in graph["fastdeploy_core.quantization.weight_only"]


def test_no_module_imports_itself_back():
    assert _cycles(_graph()) == []


def test_every_import_points_down_the_layers():
    graph = _graph()
    unknown = sorted({_room(m) for m in graph} - set(RANK))
    assert not unknown, f"rooms missing from LAYERS: {unknown}"
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        for target in targets
        if RANK[_room(target)] > RANK[_room(source)]
    )
    assert upward == []


@pytest.mark.parametrize(
    ("lower", "higher"), [("executor", "engine"), ("loader", "quantization"), ("plugins", "builtin")]
)
def test_rooms_that_must_not_reach_up(lower, higher):
    graph = _graph()
    assert not [(s, t) for s, ts in graph.items() for t in ts if _room(s) == lower and _room(t) == higher]


def test_a_planted_cycle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
