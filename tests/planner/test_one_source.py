"""The CPU and the CUDA planner kernels share their steps through one source (``planner._stages``,
``planner.slack``), not through copies: no run of 6 or more near-identical lines between a CPU kernel module and
a CUDA kernel module. Lines are compared after ``ast.unparse`` without docstrings (formatting, comments and
quotes normalised away), in windows of 6 consecutive lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PLANNER = Path(__file__).resolve().parents[2] / "planner"
CPU = ("_kernel.py", "_topology.py", "slack.py")
CUDA = ("_device_kernel.py", "_device_slack.py")
RUN = 6


def normalised_lines(source: str) -> list[str]:
    """The code's lines as ``ast.unparse`` writes them, docstrings dropped, blank lines, bare punctuation and
    imports left out (what remains is what a reader would call the same code)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node) is not None:
            node.body = node.body[1:] or [ast.Pass()]
    lines = (line.strip() for line in ast.unparse(tree).splitlines())
    return [line for line in lines if line.strip("()[]{}:,") and not line.startswith(("import ", "from "))]


def shared_runs(a: str, b: str, run: int = RUN) -> list[list[str]]:
    """Every window of ``run`` consecutive normalised lines of ``a`` that also stands in ``b``."""
    la, lb = normalised_lines(a), normalised_lines(b)
    windows = {tuple(lb[i : i + run]) for i in range(len(lb) - run + 1)}
    return [la[i : i + run] for i in range(len(la) - run + 1) if tuple(la[i : i + run]) in windows]


CPU_STEP = """
def f(T, err):
    R, E = T.shape
    for r in range(R):
        s = 0
        for e in range(E):
            s += T[r, e]
        if s < 0:
            err[0] = 1
    return s
"""
DEVICE_COPY = '''
@cuda.jit(device=True)
def g(T, err, tid, nt):
    """The same step, copied: another name, a docstring, comments and other spacing."""
    R, E = T.shape
    for r in range(R):  # a comment does not hide a copy
        s = 0
        for e in range(E):
            s += T[r,  e]
        if (s < 0):
            err[0] = 1
    return s
'''


def test_the_check_finds_a_copied_run():
    """The comparison itself: a step copied with other formatting, docstring and comments is found; one that
    differs in every window of 6 lines is not."""
    assert shared_runs(CPU_STEP, DEVICE_COPY)
    assert not shared_runs(CPU_STEP, DEVICE_COPY.replace("s = 0", "s = T[r, 0]"))


@pytest.mark.parametrize("cpu", CPU)
@pytest.mark.parametrize("cuda", CUDA)
def test_cpu_and_cuda_kernels_share_no_copied_run(cpu: str, cuda: str):
    runs = shared_runs((PLANNER / cpu).read_text(), (PLANNER / cuda).read_text())
    assert not runs, (
        f"planner/{cpu} and planner/{cuda} share {len(runs)} runs of {RUN}+ near-identical lines; write the step "
        f"once in planner/_stages.py (re-bound for CUDA by planner._cuda.device_functions). First: {runs[0]}"
    )
