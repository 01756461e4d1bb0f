"""The house rule of docs/design.md, enforced: no package imports one above it, command lines included.

Every ``.py`` file of the toolkit's packages is parsed with ``ast``; every ``import`` / ``from ... import`` of a
toolkit package, at module level or inside a function, must be in ``ALLOWED`` (the same table as ARCHITECTURE.md,
which ``test_architecture_md_has_the_same_table`` keeps in step). Imports by name at run time
(``importlib.import_module``) are not seen: ``moonep.console`` gathers every package's ``cli.py`` that way, which is
the one sanctioned reach upwards (the console script only gathers).
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# package -> what it may import of the toolkit (a package, or one module of it). design.md's arrows followed
# through: k3 -> cp_kda.cp -> collectives, so k3 may import collectives; tools -> moonep -> planner, collectives.
# moonep_base is the ground floor (standard library only): every package may import it. The simulator takes
# k3.config only (its presets are K3's config) and the planner, which prices a plan ("the simulator calls the
# planner"). design.md's arrow below moonep is read as moonep -> collectives (the Communicator): EP never needs
# the CP code, so moonep may not import cp_kda.
ALLOWED: dict[str, frozenset[str]] = {
    "moonep_base": frozenset(),
    "planner": frozenset({"moonep_base"}),
    "collectives": frozenset({"moonep_base"}),
    "cp_kda": frozenset({"collectives", "moonep_base"}),
    "moonep": frozenset({"planner", "collectives", "moonep_base"}),
    "k3": frozenset({"moonep", "cp_kda", "planner", "collectives", "moonep_base"}),
    "simulator": frozenset({"k3.config", "planner", "moonep_base"}),
    "tools": frozenset({"simulator", "moonep", "planner", "collectives", "k3.config", "moonep_base"}),
}
PACKAGES = tuple(ALLOWED)

# Modules other packages may import from inside a package: they must stay at the bottom themselves, or the
# importer reaches further up through them (the simulator must not pull in K3's model through k3.config).
BOTTOM_MODULES = {"k3/config.py": frozenset({"moonep_base"})}

# (file, imported module) pairs that break the table today, in files owned elsewhere: each must go, and this list
# with it. The test fails on any new violation and on a listed one that is gone (shrink the list then).
KNOWN_VIOLATIONS: set[tuple[str, str]] = {
    ("simulator/calibrate_host.py", "cp_kda"),  # measure_kda times a cp_kda call: calibration runs the real kernels
    ("simulator/calibrate.py", "collectives.launch"),  # the all-to-all measurement launches local ranks
}


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def imports(path: str) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in ``path``; ``from a import b`` yields ``a.b``."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    module = _module_name(path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):  # module level and function level alike
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's own package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found += [(node.lineno, f"{base}.{alias.name}" if alias.name != "*" else base) for alias in node.names]
    return found


def _allowed(name: str, allowed: frozenset[str]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


def toolkit_files() -> list[str]:
    files = []
    for package in PACKAGES:
        for folder, dirs, names in os.walk(os.path.join(ROOT, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    return files


def violations() -> dict[tuple[str, str], list[str]]:
    """``(file, imported module) -> ["file:line", ...]`` for every import the table forbids."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in toolkit_files():
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        own = rel.split("/")[0]
        for line, name in imports(path):
            top = name.split(".")[0]
            if top not in ALLOWED:
                continue  # standard library or a third-party package
            if rel in BOTTOM_MODULES:
                ok = _allowed(name, BOTTOM_MODULES[rel])
            else:
                ok = top == own or _allowed(name, ALLOWED[own])
            if not ok:
                found.setdefault((rel, name), []).append(f"{rel}:{line}")
    return found


def test_no_package_imports_one_above_it():
    found = violations()
    new = {k: v for k, v in found.items() if k not in KNOWN_VIOLATIONS}
    gone = KNOWN_VIOLATIONS - set(found)
    assert not new, "imports the layering forbids (ARCHITECTURE.md, design.md):\n" + "\n".join(
        f"  {where} imports {name}" for (_, name), places in sorted(new.items()) for where in places
    )
    assert not gone, f"fixed, so drop them from KNOWN_VIOLATIONS: {sorted(gone)}"


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """A lazy import inside a handler counts as much as one at the top; relative imports stay in the package."""
    path = os.path.join(ROOT, "planner", "cli.py")
    names = {name for _, name in imports(path)}
    assert "moonep_base.write_json" in names  # module level
    assert "planner.synthetic.synthetic_counts" in names  # `from .synthetic import ...` inside _load_counts
    assert "numpy" in names  # `import numpy as np` inside a function


def test_table_covers_every_shipped_package():
    """A new top-level package needs its row here (and in ARCHITECTURE.md) before it ships."""
    # the `include = [...]` line of [tool.setuptools.packages.find], read without tomllib (Python >= 3.11)
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    section = text.split("[tool.setuptools.packages.find]", 1)[1].split("\n[", 1)[0]
    (line,) = [row for row in section.splitlines() if row.startswith("include = [")]
    include = re.findall(r'"([^"]+)"', line.split("#", 1)[0])
    assert include, line
    shipped = {
        d
        for d in os.listdir(ROOT)
        if os.path.isfile(os.path.join(ROOT, d, "__init__.py"))
        and any(fnmatch.fnmatch(d, pattern) for pattern in include)
    }
    assert shipped == set(ALLOWED)


def test_architecture_md_has_the_same_table():
    with open(os.path.join(ROOT, "ARCHITECTURE.md")) as f:
        text = f.read()
    rows = re.findall(r"^\| `([\w.]+)` \| (.*?) \|$", text, re.M)
    table = {package: frozenset(re.findall(r"`([\w.]+)`", cell)) for package, cell in rows}
    assert table == ALLOWED


def _module_graph() -> dict[str, set[str]]:
    """``module -> modules of the same package it imports`` (module level, function level and ``TYPE_CHECKING``
    alike: an import anywhere ties the two modules together for a reader, and a lazy import that closes a circle
    is still a circle)."""
    modules = {_module_name(p): p for p in toolkit_files()}

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        return next((m for k in range(len(parts), 0, -1) if (m := ".".join(parts[:k])) in modules), None)

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for _, name in imports(path):
            target = resolve(name)
            if target and target != module and target.split(".")[0] == module.split(".")[0]:
                graph[module].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that import one another round a circle (Tarjan's strongly connected components of
    two or more), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_cycle_inside_a_package():
    """Modules of one package form no circle of imports (``deepep`` <-> ``deepep_v2`` and ``calibrate`` <->
    ``calibrate_host`` were two): a circle means neither module can be read, tested or moved alone."""
    cycles = import_cycles(_module_graph())
    assert not cycles, "modules that import one another in a circle:\n" + "\n".join(
        "  " + " -> ".join(c + [c[0]]) for c in cycles
    )


def test_the_cycle_finder_finds_cycles():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}, "p.e": {"p.e"}}
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]
    assert import_cycles({"p.a": {"p.b"}, "p.b": set()}) == []
