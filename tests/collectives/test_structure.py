"""The shape of the package after its split by job: the names other packages import from a split module still
importable from it, and the facade built on the core its helpers take. (No circle of imports and no module over
400 lines are checked for every package by tests/test_layers.py and tests/test_style.py.)"""

from __future__ import annotations

import importlib

import pytest

from collectives.base import Communicator
from collectives.core import CommunicatorCore

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
