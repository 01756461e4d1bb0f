"""numba's cache of a jitted function only watches its own file; ``refresh_cache`` makes it follow the files
whose jitted functions it calls (``_kernel`` calls ``_topology``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from planner import _jit

pytestmark = pytest.mark.spawns  # every test here starts processes: make test-fast leaves them out

CALLER = """
from numba import njit

from planner._jit import refresh_cache

from . import callee


@njit(cache=True)
def f():
    return callee.g()


FLUSHED = refresh_cache(globals(), [__file__, callee.__file__], "caller.sha256")
"""


def _callee(value: int) -> str:
    return f"from numba import njit\n\n\n@njit(cache=True)\ndef g():\n    return {value}\n"


@pytest.mark.skipif(not _jit.HAS_NUMBA, reason="numba is not installed or disabled")
def test_cached_caller_recompiles_after_an_edit_to_its_callee_only(tmp_path: Path):
    pkg = tmp_path / "pk"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "caller.py").write_text(textwrap.dedent(CALLER))
    callee = pkg / "callee.py"
    callee.write_text(_callee(1))
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo)])}

    def run() -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", "from pk import caller; print(caller.f(), caller.FLUSHED)"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.split()

    assert run() == ["1", "True"]  # first import: no digest yet
    assert run() == ["1", "False"]  # cached, digest unchanged
    callee.write_text(_callee(2))  # same size: only the digest tells the caller's cache it is stale
    st = callee.stat()
    os.utime(callee, (st.st_atime + 10, st.st_mtime + 10))
    assert run() == ["2", "True"]
