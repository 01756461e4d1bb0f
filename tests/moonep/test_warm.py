"""``moonep.warm`` (with ``planner.warm``, which it imports): ranks forked from a forkserver that preloaded it run
the EP battery and every form of plan without compiling or loading a kernel of their own; without it they do."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from planner._jit import HAS_NUMBA

pytestmark = [
    pytest.mark.spawns,
    pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed or disabled: nothing to warm"),
]

REPO = Path(__file__).resolve().parents[2]
JITTED = ("planner._kernel", "planner._stages", "planner._topology", "planner.slack", "moonep.layout_cpu")

SCRIPT = """
import json
from collectives import launch
from tests.moonep.test_warm import rank_job
if __name__ == "__main__":
    print(json.dumps(launch(rank_job, 2, timeout=30, job_timeout=120)))
"""


def compiled_signatures() -> dict[str, int]:
    """Signatures each jitted function of ``JITTED`` holds in this process (compiled or loaded from the cache)."""
    out = {}
    for name in JITTED:
        for attr, f in vars(importlib.import_module(name)).items():
            if hasattr(f, "overloads") and hasattr(f, "py_func"):
                out[f"{name}.{attr}"] = len(f.overloads)
    return out


def rank_job(comm) -> dict:
    """In a rank: the signatures held before and after the EP battery and the planner's forms on other shapes."""
    import torch

    from planner import CostModel, plan
    from tests.moonep import battery

    before = compiled_signatures()
    verdicts = battery.run(comm, ("dispatch", "weights", "autograd", "moe"))
    counts = np.random.default_rng(comm.rank).integers(0, 9, size=(8, 16))
    for c in (counts, torch.from_numpy(counts)):
        for options in ({}, {"slack": 0.2}, {"cost": CostModel(row_seconds=1e-6, copy_seconds=1e-4)}):
            plan(c, previous=plan(c, token_padding=4, **options), token_padding=4, **options)
    plan(counts, topology=4, caps=np.full(8, counts.sum() // 8) + (np.arange(8) < counts.sum() % 8))
    failed = {k: v for k, v in verdicts.items() if v is not None}
    return {"before": before, "after": compiled_signatures(), "failed": failed}


def _ranks(preload: str) -> dict:
    env = {**os.environ, "MOONEP_LAUNCH_PRELOAD": preload, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_rank_forked_from_a_warm_forkserver_compiles_and_loads_nothing():
    got = _ranks("torch,moonep.warm")
    assert got["failed"] == {}
    # every form of plan hands the kernel the same argument types (planner.device.host_plan): one signature
    assert got["before"]["planner._kernel.plan_arrays"] == 1 and got["before"]["planner.slack.slack_caps"] == 1
    assert got["before"]["moonep.layout_cpu._route"] > 0
    grown = {k: (n, got["after"][k]) for k, n in got["before"].items() if got["after"][k] != n}
    assert grown == {}, f"signatures a warm rank compiled or loaded itself (before, after): {grown}"


def test_without_it_every_rank_loads_the_kernels_itself():
    """The control: the same job from a forkserver that imported the packages only."""
    got = _ranks("torch,moonep")
    assert got["failed"] == {}
    assert got["before"]["planner._kernel.plan_arrays"] == 0
    assert got["after"]["planner._kernel.plan_arrays"] > 0 and got["after"]["moonep.layout_cpu._route"] > 0
