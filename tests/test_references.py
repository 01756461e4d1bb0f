"""Every document the code and docs cite resolves inside the repository.

A Markdown file cited in a ``.py`` or ``.md`` file (``k3_architecture.md 2.1``, ``docs/design.md``) must be a file
of the repository, found by its path when the citation has one, else by its name anywhere in the tree; a
citation of a path outside it (``../shared/...``, an absolute ``/work/...``) is refused. ``docs/reference/`` is
cited, not checked: it describes other projects and cites their files. ARCHITECTURE.md's
``package.module`` names must be importable modules.
"""

from __future__ import annotations

import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = {".venv", ".git", "out", "__pycache__", ".pytest_cache", "node_modules", ".ruff_cache"}
# other projects' files, cited with their repository named beside them (Megatron-Bridge's performance tables,
# ml-engineering's accelerator page)
EXTERNAL = {"docs/performance-summary-archive.md", "docs/performance-summary.md", "compute/accelerator/README.md"}
CITED = re.compile(r"(?<![\w/.-])((?:\.\./|/)?[\w./-]*?[\w-]+\.md)\b")


def _files(exts: tuple[str, ...]) -> list[str]:
    found = []
    for base, dirs, names in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIP and not d.startswith(".venv"))
        found += [os.path.join(base, n) for n in sorted(names) if n.endswith(exts)]
    return found


def test_every_cited_document_is_in_the_repository():
    docs = _files((".md",))
    names = {os.path.basename(p) for p in docs}
    rel = {os.path.relpath(p, ROOT) for p in docs}
    missing = []
    external = os.path.join(ROOT, "docs", "reference") + os.sep
    for path in [p for p in _files((".py", ".md")) if not p.startswith(external)] + [os.path.join(ROOT, "Makefile")]:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        here = os.path.relpath(os.path.dirname(path), ROOT)
        for cite in CITED.findall(text):
            if cite in EXTERNAL:
                continue
            if cite.startswith(("../", "/")):
                missing.append(f"{os.path.relpath(path, ROOT)}: {cite} (outside the repository)")
            elif "/" in cite:
                if cite not in rel and os.path.normpath(os.path.join(here, cite)) not in rel:
                    missing.append(f"{os.path.relpath(path, ROOT)}: {cite}")
            elif cite not in names:
                missing.append(f"{os.path.relpath(path, ROOT)}: {cite}")
    assert not missing, "cited documents not in the repository:\n" + "\n".join(missing)


def test_architecture_names_modules_that_exist():
    with open(os.path.join(ROOT, "ARCHITECTURE.md"), encoding="utf-8") as f:
        text = f.read()
    packages = ("collectives", "planner", "cp_kda", "moonep", "k3", "simulator", "tools", "moonep_base")
    cited = set(re.findall(r"`((?:{})\.\w+)".format("|".join(packages)), text))
    import sys

    sys.path.insert(0, ROOT)
    try:
        absent = sorted(m for m in cited if importlib.util.find_spec(m) is None)
    finally:
        sys.path.remove(ROOT)
    assert cited and not absent, f"ARCHITECTURE.md names modules that do not exist: {absent}"
