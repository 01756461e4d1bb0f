"""The suite's own rules (tests/conftest.py), run on a small suite in a fresh pytest: a test that starts a process
without the ``spawns`` mark fails in every run (a GPU check on a CUDA machine aside), the marked one passes, and
test files are handed out longest first."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import conftest

SUITE = {
    "test_c_slow.py": """
        import pytest

        @pytest.mark.slow
        def test_long():
            pass
    """,
    "test_a_quick.py": "\n".join(f"def test_quick_{i}():\n    pass\n" for i in range(20)),
    "test_b_processes.py": """
        import subprocess
        import sys

        import pytest

        @pytest.mark.spawns
        def test_marked_starts_a_process():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        def test_unmarked_starts_a_process():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        def test_unmarked_stays_in_process():
            pass
    """,
}


def _run(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    for name, body in SUITE.items():
        (tmp_path / name).write_text(textwrap.dedent(body))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow\n    spawns\n    solo\n    host_noise\n")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.spawns  # runs pytest in a subprocess
def test_an_unmarked_test_that_starts_a_process_fails_in_a_full_run(tmp_path):
    out = _run(tmp_path, "-q", "-rf")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "test_unmarked_starts_a_process starts a process: mark it @pytest.mark.spawns" in out.stdout, out.stdout
    assert "1 failed, 23 passed" in out.stdout, out.stdout


@pytest.mark.spawns  # runs pytest in a subprocess
def test_files_run_longest_first_by_their_marks(tmp_path):
    out = _run(tmp_path, "--collect-only", "-q")
    files = list(dict.fromkeys(line.split("::")[0] for line in out.stdout.splitlines() if "::" in line))
    # c: one slow test (15), a: 20 x 0.2 = 4, b: 1.5 + 2 x 0.2 = 1.9 (pytest alone would go a, b, c)
    assert files == ["test_c_slow.py", "test_a_quick.py", "test_b_processes.py"], out.stdout


@pytest.mark.spawns  # runs pytest in a subprocess
def test_the_edit_loop_leaves_the_marked_test_out(tmp_path):
    out = _run(tmp_path, "-q", "-rf", env={**os.environ, "MOONEP_TEST_FAST": "1"})
    assert "1 failed, 22 passed, 1 deselected" in out.stdout, out.stdout


class _Item:
    def __init__(self, *marks: str) -> None:
        self.keywords = dict.fromkeys(marks, True)


def test_a_gpu_check_may_start_its_compilers_only_where_cuda_is(monkeypatch):
    monkeypatch.setattr(conftest, "_cuda_available", lambda: False)
    assert conftest._guarded(_Item("gpu")) and conftest._guarded(_Item())
    monkeypatch.setattr(conftest, "_cuda_available", lambda: True)  # Triton runs ptxas, ldconfig
    assert not conftest._guarded(_Item("gpu")) and conftest._guarded(_Item())
    assert not conftest._guarded(_Item("spawns")) and not conftest._guarded(_Item("spawns", "gpu"))
