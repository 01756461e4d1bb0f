"""House rules the linters do not check, enforced over every ``.py`` file of the toolkit's packages (parsed with
``ast``, as tests/test_layers.py does):

- **function length**: no function or method is longer than ``MAX_FUNCTION_LINES`` lines, counted over its body:
  from the first statement (the docstring included) to the last line. The signature does not count: ruff's
  formatter puts a long parameter list one per line, which says nothing about the function's length. A nested
  function counts on its own and inside its parent. The anchors' p90 is 50-60 lines (style_and_ecosystem.md, A.0).
- **function-level imports say why**: an ``import`` inside a function keeps an optional or heavy dependency off
  the module's import, and its trailing comment says which (``# optional: mpi4py (the mpi extra)``, ``# heavy:
  torch, kept out of --help``, ``# layering exception: ...`` for the upward imports tests/test_layers.py lists).
  Anything else belongs at module level.
- **a command-line module costs no more than its package**: ``import <package>.cli`` (what ``moonep --help`` does
  for every package) loads no third-party module that ``import <package>`` does not load already.

``PENDING_*`` list what breaks a rule today in files owned elsewhere (``moonep/``, ``planner/``, ``k3/``): each
must go, and the list with it. The tests fail on any new breach, on a listed one that grew, and on a listed one
that is gone (shrink the list then), so the lists only shrink.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from tests.test_layers import PACKAGES, ROOT, toolkit_files

MAX_FUNCTION_LINES = 60

# Files whose owners have not split them yet: "file::qualified.name" -> its length in lines when listed. None today.
PENDING_LONG_FUNCTIONS: dict[str, int] = {}

# Function-level imports without a reason comment, per file, in packages owned elsewhere: file -> count when listed.
PENDING_BARE_IMPORTS: dict[str, int] = {}
OWNED_ELSEWHERE = ("moonep/", "planner/", "k3/")

REASON = re.compile(r"#.*\b(optional|heavy|layering exception):")


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT).replace(os.sep, "/")


def _parse(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read(), path)


def _functions(node: ast.AST, prefix: str = ""):
    """``(qualified name, def node)`` of every function and method under ``node``, nested ones included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + child.name, child
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def function_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of the body: its first statement (the docstring included) to its last line; no signature."""
    return fn.end_lineno - fn.body[0].lineno + 1


def long_functions() -> dict[str, int]:
    """``"file::qualified.name" -> lines`` of every function longer than ``MAX_FUNCTION_LINES``."""
    found = {}
    for path in toolkit_files():
        for name, fn in _functions(_parse(path)):
            if function_lines(fn) > MAX_FUNCTION_LINES:
                found[f"{_rel(path)}::{name}"] = function_lines(fn)
    return found


def bare_imports() -> dict[str, list[str]]:
    """``file -> ["line: source", ...]`` of the function-level imports whose line gives no reason."""
    found: dict[str, list[str]] = {}
    for path in toolkit_files():
        with open(path) as f:
            lines = f.read().splitlines()
        tree = ast.parse("\n".join(lines), path)
        seen = set()
        for _, fn in _functions(tree):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in seen:
                    seen.add(node.lineno)  # a nested function's import is walked from its parent too
                    text = lines[node.lineno - 1]
                    # the reason: on the import's own lines, or on a comment line right above it (when the
                    # formatter would otherwise wrap a long import around its comment)
                    above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                    said = lines[node.lineno - 1 : node.end_lineno] + ([above] if above.startswith("#") else [])
                    if not any(REASON.search(x) for x in said):
                        found.setdefault(_rel(path), []).append(f"{node.lineno}: {text.strip()}")
    return found


def test_no_function_is_longer_than_60_lines():
    found = long_functions()
    new = {k: v for k, v in found.items() if k not in PENDING_LONG_FUNCTIONS}
    grown = {
        k: (PENDING_LONG_FUNCTIONS[k], v)
        for k, v in found.items()
        if k in PENDING_LONG_FUNCTIONS and v > PENDING_LONG_FUNCTIONS[k]
    }
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines: split them into well-named helpers:\n" + "\n".join(
        f"  {k}: {v} lines" for k, v in sorted(new.items())
    )
    assert not grown, f"listed long functions that grew (listed, now): {grown}"


def test_pending_long_functions_list_only_shrinks():
    found = long_functions()
    stale = sorted(k for k in PENDING_LONG_FUNCTIONS if k not in found)
    assert not stale, f"now at most {MAX_FUNCTION_LINES} lines or gone: drop them from PENDING_LONG_FUNCTIONS: {stale}"
    assert all(k.startswith(OWNED_ELSEWHERE) for k in PENDING_LONG_FUNCTIONS), "fix these, do not list them"


def test_function_level_imports_give_a_reason():
    found = bare_imports()
    new = {f: places for f, places in found.items() if len(places) > PENDING_BARE_IMPORTS.get(f, 0)}
    assert not new, (
        "function-level imports with no `# optional: ...` / `# heavy: ...` / `# layering exception: "
        "...` reason: move them to module level, or say why they stay:\n"
        + "\n".join(f"  {f}:{p}" for f, places in sorted(new.items()) for p in places)
    )


def _pending_literal(found: dict[str, list[str]]) -> str:
    """The up-to-date ``PENDING_BARE_IMPORTS`` for the files owned elsewhere, to paste over the old one."""
    rows = [f'    "{f}": {len(places)},' for f, places in sorted(found.items()) if f.startswith(OWNED_ELSEWHERE)]
    return "PENDING_BARE_IMPORTS: dict[str, int] = {\n" + "\n".join(rows) + "\n}"


def test_pending_bare_imports_list_only_shrinks():
    found = bare_imports()
    shrunk = {f: (n, len(found.get(f, []))) for f, n in PENDING_BARE_IMPORTS.items() if len(found.get(f, [])) < n}
    assert not shrunk, f"fewer bare imports now (listed, now): {shrunk}; the list is now\n" + _pending_literal(found)
    assert all(f.startswith(OWNED_ELSEWHERE) for f in PENDING_BARE_IMPORTS), "fix these, do not list them"


def test_the_checkers_see_what_they_should(tmp_path):
    """The checkers themselves: decorators and signatures are not counted, nested functions and methods are, and
    a reason comment is recognised only in its three forms."""
    src = (
        "import os\n@staticmethod\n@property\ndef f():\n    '''doc'''\n    def g():\n        import json\n"
        "        return 1\n    return g\n\n\nclass C:\n    def m(self):\n        import numpy  # heavy: numpy\n"
        "        import torch  # lazy\n"
    )
    tree = ast.parse(src)
    found = {name: function_lines(fn) for name, fn in _functions(tree)}
    assert found == {"f": 5, "f.g": 2, "C.m": 2}
    lines = src.splitlines()
    reasons = [
        bool(REASON.search(lines[n.lineno - 1]))
        for n in ast.walk(tree)
        if isinstance(n, ast.Import) and n.col_offset > 0
    ]
    assert sorted(reasons) == [False, False, True]


@pytest.mark.spawns
@pytest.mark.parametrize("package", [p for p in PACKAGES if os.path.exists(os.path.join(ROOT, p, "cli.py"))])
def test_cli_module_loads_nothing_its_package_does_not(package):
    """``moonep --help`` imports every ``<package>.cli``: module-level imports there may only be what ``import
    <package>`` loads anyway (or the standard library and the toolkit); torch, matplotlib, tqdm stay in handlers."""
    code = (
        f"import sys\nimport {package}\nbefore = set(sys.modules)\nimport {package}.cli\n"
        "new = {m.partition('.')[0] for m in set(sys.modules) - before}\n"
        f"print(sorted(new - set(sys.stdlib_module_names) - {set(PACKAGES)!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"import {package}.cli also loads {out.stdout.strip()}"


MAX_MODULE_LINES = 400


def _long_modules() -> dict[str, int]:
    """``path -> lines`` of every Python file of the toolkit and its tests over ``MAX_MODULE_LINES``."""
    found = {}
    for top in (*PACKAGES, "tests"):
        for folder, dirs, names in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path) as f:
                        n = sum(1 for _ in f)
                    if n > MAX_MODULE_LINES:
                        found[_rel(path)] = n
    return found


def _named_long_modules() -> dict[str, str]:
    """``path -> why`` from ARCHITECTURE.md's "Modules over 400 lines" list (``- `path`: why``)."""
    with open(os.path.join(ROOT, "ARCHITECTURE.md")) as f:
        text = f.read()
    section = text.split("## Modules over 400 lines", 1)[1].split("\n## ", 1)[0] if "## Modules over" in text else ""
    return dict(re.findall(r"^- `([\w/.]+\.py)`: (.+)$", section, re.M))


def test_no_module_over_400_lines_unless_architecture_md_says_why():
    """A module does one job; one that must stay longer is named in ARCHITECTURE.md with its reason, and the
    name goes when the module shrinks."""
    long, named = _long_modules(), _named_long_modules()
    unnamed = {p: n for p, n in long.items() if p not in named}
    assert not unnamed, (
        f"modules over {MAX_MODULE_LINES} lines: split them by job, or name them in ARCHITECTURE.md's "
        f"'Modules over 400 lines' with the reason: {unnamed}"
    )
    stale = sorted(p for p in named if p not in long)
    assert not stale, f"now at most {MAX_MODULE_LINES} lines (or gone): drop them from ARCHITECTURE.md: {stale}"
