"""Every collective, dtype and split pattern on real ranks: gloo and MPI, world sizes 1-4.

One job per (backend, world size) runs the whole battery (tests/collectives/battery.py) and reports per check,
so the suite pays one spawn per job rather than one per assertion.
"""

import functools

import pytest

from collectives import launch
from tests.collectives import battery
from tests.collectives.conftest import needs_mpi

pytestmark = pytest.mark.spawns  # every test here starts rank processes: make test-fast leaves them out

JOBS = [("torch", n) for n in (1, 2, 3, 4)] + [("mpi", n) for n in (1, 2, 3, 4)]


@functools.cache
def job(backend: str, world_size: int) -> dict:
    return launch(battery.run_battery, world_size, backend=backend, timeout=30, job_timeout=240)


def _check_names() -> list[str]:
    # Names come from the battery itself (cheap: a world-size-1 run without spawning is not possible, so list them).
    names = ["even_all_to_all", "reduce_scatter", "broadcast", "ring", "split", "bad_input"]
    for dtype in battery.DTYPES:
        n = str(dtype).replace("torch.", "")
        names += [f"all_to_all_{n}", f"all_gather_{n}"]
    for d in ("float32", "bfloat16", "int32", "int64"):
        names += [f"all_reduce_{op}_{d}" for op in ("sum", "max", "min", "prod")]
    return names


@pytest.mark.parametrize("backend,world_size", JOBS, ids=[f"{b}-{n}" for b, n in JOBS])
@pytest.mark.parametrize("check", _check_names())
def test_collective(backend, world_size, check):
    if backend == "mpi":
        needs_mpi()
    results = job(backend, world_size)
    assert check in results, f"battery did not run {check}"
    assert results[check] is None, results[check]


@pytest.mark.parametrize("backend", ["torch", "mpi"])
def test_battery_covers_every_listed_check(backend):
    """Catches a check silently dropped from the battery (its test would then fail with a KeyError above)."""
    if backend == "mpi":
        needs_mpi()
    assert set(job(backend, 2)) == set(_check_names())
