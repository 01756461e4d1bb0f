"""Each package runs its own command line, ``python -m <package>``, with every package above it unimportable; the
``moonep`` console script (``moonep.console``) gathers them all.

The subprocesses get a ``sitecustomize`` whose meta-path finder refuses the blocked packages (and logs each try), so
a ``python -m planner`` that reached for ``moonep``, ``collectives`` or torch fails here, even behind an
``except ImportError``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moonep.console import PACKAGES, build_parser
from tests.test_layers import ALLOWED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SITECUSTOMIZE = '''
import os, sys

_BLOCKED = frozenset(os.environ["MOONEP_TEST_BLOCK"].split(","))


class _Blocker:
    """Meta-path finder: the blocked packages are absent (ModuleNotFoundError), and each try is logged."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            with open(os.environ["MOONEP_TEST_BLOCK_LOG"], "a") as f:
                f.write(name + "\\n")
            raise ModuleNotFoundError(f"{name} is blocked by the test", name=name)
        return None


sys.meta_path.insert(0, _Blocker)
'''


def blocked_for(package: str) -> list[str]:
    """The toolkit packages ``package`` may not import at all (a package it may import a module of stays), and
    torch for the pure planner."""
    reachable = {name.partition(".")[0] for name in ALLOWED[package]} | {package}
    return sorted(set(ALLOWED) - reachable) + (["torch"] if package == "planner" else [])


def run_blocked(tmp_path, blocked: list[str], *argv: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "blocked.log"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(site), ROOT]),
        MOONEP_TEST_BLOCK=",".join(blocked),
        MOONEP_TEST_BLOCK_LOG=str(log),
    )
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    tried = log.read_text().split() if log.exists() else []
    return proc, tried


@pytest.mark.spawns
def test_python_m_planner_help_without_moonep_collectives_torch(tmp_path):
    proc, tried = run_blocked(tmp_path, ["moonep", "collectives", "torch"], "-m", "planner", "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: python -m planner") and "plan " in proc.stdout
    assert not tried, f"python -m planner --help tried to import {tried}"


@pytest.mark.spawns
def test_python_m_collectives_help_without_moonep(tmp_path):
    proc, tried = run_blocked(tmp_path, ["moonep"], "-m", "collectives", "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: python -m collectives") and "roundtrip" in proc.stdout
    assert not tried, f"python -m collectives --help tried to import {tried}"


@pytest.mark.spawns
def test_blocker_blocks(tmp_path):
    """The harness itself: a blocked import fails and is logged."""
    proc, tried = run_blocked(tmp_path, ["moonep"], "-c", "import moonep")
    assert proc.returncode == 1 and "ModuleNotFoundError" in proc.stderr and tried == ["moonep"]


@pytest.mark.spawns
@pytest.mark.parametrize("package", [p for p in PACKAGES if p not in ("planner", "collectives")])
def test_python_m_package_runs_without_the_packages_above_it(tmp_path, package):
    blocked = blocked_for(package)
    proc, tried = run_blocked(tmp_path, blocked, "-m", package, "bench", "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"usage: python -m {package} bench")
    assert not tried, f"python -m {package} tried to import {tried} (blocked: {blocked})"


def test_console_script_gathers_every_package():
    parser = build_parser()
    commands = {
        "roundtrip": "collectives",
        "plan": "planner",
        "train": "k3",
        "simulate": "simulator",
        "diagnose": "tools",
    }
    for command, package in commands.items():
        assert parser.parse_args([command, *_required(command)]).func.__module__ == f"{package}.cli"
    bench = {
        "collectives": "collectives",
        "planner": "planner",
        "kda": "cp_kda",
        "ep": "moonep",
        "train": "k3",
        "telemetry": "tools",
    }
    for target, package in bench.items():
        assert parser.parse_args(["bench", target]).func.__module__ == f"{package}.cli"


def _required(command: str) -> list[str]:
    return {"plan": ["--synthetic", "zipf:1"], "diagnose": ["somewhere"]}.get(command, [])


@pytest.mark.spawns
def test_console_script_help(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "moonep.console", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: moonep") and all(c in proc.stdout for c in ("plan", "train", "diagnose"))
