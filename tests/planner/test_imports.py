"""The planner's modules import each other without a cycle, counting imports at module level and inside
functions alike (a function-level import is still a dependency: it only moves the failure to the first call)."""

from __future__ import annotations

import ast
from pathlib import Path

PLANNER = Path(__file__).resolve().parents[2] / "planner"


def planner_imports(source: str, modules: set[str]) -> set[str]:
    """The planner modules one module's source imports (``from planner import m``, ``from planner.m import``,
    ``import planner.m``), anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "planner":
            parts = node.module.split(".")
            out |= {parts[1]} if len(parts) > 1 else {a.name if a.name in modules else "__init__" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("planner.")}
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as a path (first node repeated at the end), or [] when there is none."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(u: str) -> list[str]:
        state[u] = 1
        path.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return [*path[path.index(v) :], v]
            found = visit(v) if v not in state else []
            if found:
                return found
        path.pop()
        state[u] = 2
        return []

    for m in sorted(graph):
        found = visit(m) if m not in state else []
        if found:
            return found
    return []


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_inside_planner():
    files = {p.stem: p.read_text() for p in PLANNER.glob("*.py")}
    graph = {m: planner_imports(src, set(files)) - {m} for m, src in files.items()}
    assert graph["_device_kernel"] and "device" not in graph["_device_kernel"]  # the imports are seen
    assert not find_cycle(graph), f"import cycle inside planner/: {' -> '.join(find_cycle(graph))}"
