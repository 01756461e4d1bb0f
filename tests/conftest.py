"""Suite-wide pytest hooks.

``@pytest.mark.host_noise``: checks whose outcome depends on how quiet the host's CPUs are (a 1.2x slowdown
found among 4 ranks time-sharing 2 cores, 100 clean steps without an alarm, a calibrated step prediction within
20%). On a shared CI machine they fail now and then for reasons outside the code, so ``make test`` skips them,
saying so in its summary; run them with ``MOONEP_HOST_NOISE_TESTS=1 make test`` (or pytest) on a machine you
trust. Their measured pass rates are in tools/README.md and simulator/README.md.

Without a GPU, numba-cuda kernels run under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set below).

``@pytest.mark.spawns``: the test starts processes (local ranks, torchrun, a command line in a subprocess). A test
not marked so that starts one fails, naming itself, in every run, so the marks stay true (a ``gpu`` test on a CUDA
machine is left free: its compilers are processes). ``MOONEP_TEST_FAST=1`` (``make test-fast``, the edit loop)
deselects the marked ones.

``@pytest.mark.solo`` (with ``spawns``): the test's verdict rests on times its ranks measure (a slow rank or link
found, a clean probe, a calibrated prediction, a timeout's bound), so another test's ranks on the same cores would
move it. ``make test`` runs every other test on two workers, a file per worker at a time (spawning tests leave the
cores idle part of the time: start-up, waits on timeouts), then these one at a time.

Test files are handed out longest first (``file_cost``: a ``slow`` test, a spawning one, any other), so that the
last files two workers run are short ones and neither waits long on the other at the end (``make test`` passes
xdist ``--no-loadscope-reorder``, which keeps this order instead of xdist's, by number of tests).

``MOONEP_GPU_CHECK=1`` (set by ``make gpu-check``): every skip is turned into a failure carrying the skip reason.
The GPU checks skip wherever their GPU, library or driver is missing, so on the machine meant to run them a skip
means a check silently did not happen.
"""

import functools
import multiprocessing.process
import os
import subprocess

import pytest

HOST_NOISE_ENV = "MOONEP_HOST_NOISE_TESTS"
GPU_CHECK_ENV = "MOONEP_GPU_CHECK"
FAST_ENV = "MOONEP_TEST_FAST"

# The suite's rank pool: ranks that collectives.launch starts in this process (and in the jobs it runs in
# subprocesses) fork from one forkserver that imported these once, instead of each importing torch anew (about 1 s
# per rank per job; collectives/warm_start.py). Still a fresh process per rank per job. The launcher's own tests
# (tests/collectives/test_launchers.py, test_failures.py) also run the default, spawn. Set it empty to spawn all.
# torch._dynamo: a rank that builds a torch.optim optimizer imports it (Optimizer.__init__ is wrapped by
# torch._disable_dynamo), about 1 s per rank; matplotlib.pyplot: a training job's rank 0 draws its plots. With both,
# tests/k3's spawning tests ran in 91 and 95 s against 131 and 123 s (2 workers, alternating order). moonep.warm:
# the planner's and the send layout's numba kernels, compiled or loaded from numba's cache once in the forkserver
# instead of in every rank (four spawning files of tests/moonep and tests/k3: 54.9 and 52.9 s against 56.2 and 59.4).
os.environ.setdefault(
    "MOONEP_LAUNCH_PRELOAD",
    "torch,torch._dynamo,numpy,matplotlib.pyplot,collectives,planner,moonep,cp_kda,k3,moonep.warm",
)

# The device planner's numba-cuda kernel runs under numba's CUDA simulator unless a run asks for the real GPU
# (`make gpu-check` sets NUMBA_ENABLE_CUDASIM=0). numba reads this once, at import: set it before any test
# module imports numba.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


SLOW_COST, SPAWNS_COST, TEST_COST = 15.0, 1.5, 0.2
"""Rough seconds a test takes on two busy cores, by its marks: ``slow`` (10-40 s), ``spawns`` (about 1 s on
average), any other (0.2 s on average). Only the order of test files rests on these."""


def item_cost(item) -> float:
    if "slow" in item.keywords:
        return SLOW_COST
    return SPAWNS_COST if "spawns" in item.keywords else TEST_COST


def file_cost(items) -> dict:
    """Estimated seconds per test file (``item.path``), from its tests' marks."""
    cost: dict = {}
    for item in items:
        cost[item.path] = cost.get(item.path, 0.0) + item_cost(item)
    return cost


@pytest.hookimpl(trylast=True)  # after -m has deselected: order what will run
def pytest_collection_modifyitems(config, items):
    loose = [item.nodeid for item in items if "solo" in item.keywords and "spawns" not in item.keywords]
    if loose:  # a solo test without spawns would run beside another test
        raise pytest.UsageError(f"marked solo but not spawns: {', '.join(loose)}")
    if os.environ.get(FAST_ENV) == "1":
        spawning = [item for item in items if "spawns" in item.keywords]
        items[:] = [item for item in items if "spawns" not in item.keywords]
        config.hook.pytest_deselected(items=spawning)
    cost = file_cost(items)
    items.sort(key=lambda item: -cost[item.path])  # stable: a file's tests keep their order, and stay together
    if os.environ.get(HOST_NOISE_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"depends on a quiet host; set {HOST_NOISE_ENV}=1 to run")
    for item in items:
        if "host_noise" in item.keywords:
            item.add_marker(skip)


_RUNNING: list[str | None] = [None]  # the unmarked test being set up, run or torn down (fixtures of any scope too)


def pytest_configure(config):
    """Starting a process fails a test not marked ``spawns`` that does it: from the set-up of its fixtures, whatever
    their scope, to its teardown. Collection may (an import that asks ldconfig)."""
    # matplotlib's first import on a machine asks fc-list for the system fonts (a process) and caches the answer
    # under ~/.cache/matplotlib: ask before the guard, or a fresh machine's first plotting test reads as spawning
    import matplotlib.font_manager  # noqa: F401

    # torch's first import runs ldconfig (cuda.pathfinder looks for libdl): a test whose code imports torch lazily
    # (the console's subcommands do) read as spawning when its file ran alone, before any module had imported it
    import torch  # noqa: F401

    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def refuse(original):
        def guarded(*args, **kwargs):
            if _RUNNING[0] is None:
                return original(*args, **kwargs)
            pytest.fail(
                f"{_RUNNING[0]} starts a process: mark it @pytest.mark.spawns (make test-fast leaves those out)",
                pytrace=False,
            )

        return guarded

    subprocess.Popen.__init__ = refuse(popen_init)  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = refuse(process_start)  # type: ignore[method-assign]


def _guarded(item) -> bool:
    """Whether starting a process fails this test: it is not marked ``spawns``, nor is it a GPU check running where
    CUDA is (there the GPU toolchains start processes: Triton runs ptxas, and ldconfig to find libcuda; without CUDA
    a GPU check is guarded like any other test)."""
    if "spawns" in item.keywords:
        return False
    return "gpu" not in item.keywords or not _cuda_available()


@functools.cache
def _cuda_available() -> bool:
    import torch  # heavy: torch (asked once, by the first GPU check; every such test imports torch anyway)

    return torch.cuda.is_available()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _RUNNING[0] = item.nodeid if _guarded(item) else None
    try:
        yield
    finally:
        _RUNNING[0] = None
