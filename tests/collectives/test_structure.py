"""The shape of the package: modules that do one job each, no circle of imports between them, and the names other
packages import from a module that was split still importable from it."""

from __future__ import annotations

import importlib
import os

import pytest

from collectives.base import Communicator
from collectives.core import CommunicatorCore
from tests.test_layers import ROOT, _module_graph, import_cycles

MAX_MODULE_LINES = 400

# Names code outside collectives/ imports from modules that were split by job (base, launch, nvshmem_backend):
# each must stay importable from the module it was imported from.
KEPT_NAMES = {
    "collectives.base": ("CollectiveError", "Communicator", "Pending", "REDUCE_OPS", "as_timedelta"),
    "collectives.launch": (
        "BACKENDS",
        "LaunchError",
        "LaunchOptions",
        "check_device",
        "external_launcher",
        "init",
        "launch",
        "local_rank",
        "mpiexec_path",
        "rank_device",
    ),
    "collectives.nvshmem_backend": (
        "MPS_DEFAULT_PIPE_DIR",
        "MpsState",
        "NVSHMEMCommunicator",
        "mps_control",
        "mps_control_path",
        "mps_daemon",
        "mps_state",
        "nvshmem_available",
        "require_mps_if_shared",
        "shared_gpu_error",
    ),
}


def test_no_import_cycle_inside_collectives():
    """Module level, function level and ``TYPE_CHECKING`` imports alike (as tests/test_layers.py counts them)."""
    graph = {m: {d for d in deps if d.startswith("collectives.")} for m, deps in _module_graph().items()}
    graph = {m: deps for m, deps in graph.items() if m.startswith("collectives")}
    assert graph["collectives.base"] >= {"collectives.agreement", "collectives.timing", "collectives.core"}
    assert not import_cycles(graph)


def test_every_module_is_at_most_400_lines():
    folder = os.path.join(ROOT, "collectives")
    long = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                lines = len(f.read().splitlines())
            if lines > MAX_MODULE_LINES:
                long[name] = lines
    assert not long, f"split these by job: {long}"


@pytest.mark.parametrize("module", sorted(KEPT_NAMES))
def test_split_modules_keep_the_names_others_import(module):
    found = importlib.import_module(module)
    missing = [name for name in KEPT_NAMES[module] if not hasattr(found, name)]
    assert not missing, f"{module} no longer has {missing}"


def test_the_helpers_take_the_core_the_facade_builds_on():
    """agreement, timing and peer_checks take a ``CommunicatorCore`` (all they touch) and the facade is one."""
    assert issubclass(Communicator, CommunicatorCore)
    for method in ("_all_to_all_single", "_all_gather", "_send", "_recv"):
        assert method in CommunicatorCore.__abstractmethods__
    assert "_new_group" in Communicator.__abstractmethods__
