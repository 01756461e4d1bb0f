import importlib.util

import pytest

from collectives.launch import mpiexec_path


def mpi_available() -> bool:
    if importlib.util.find_spec("mpi4py") is None:
        return False
    try:
        mpiexec_path()
    except RuntimeError:
        return False
    return True


def needs_mpi():
    if not mpi_available():
        pytest.skip("mpi4py/mpiexec not installed (pip install 'moonep[mpi]')")
