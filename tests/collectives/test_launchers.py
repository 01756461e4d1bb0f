"""The same script runs under our launcher, torchrun and mpiexec (each process joins the job it is in)."""

import json
import os
import subprocess
import sys

import pytest

from collectives.launch import mpiexec_path
from collectives.warm_start import PRELOAD_ENV
from tests.collectives.conftest import needs_mpi

pytestmark = pytest.mark.spawns  # every test here starts rank processes: make test-fast leaves them out

SCRIPT = os.path.join(os.path.dirname(__file__), "launched_script.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(cmd):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    # PRELOAD: the launcher's own tests start ranks the way a user's script does by default (spawn)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE", PRELOAD_ENV):
        env.pop(key, None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def _check(results, backend, processes):
    assert len(results) == processes
    assert sorted(r["rank"] for r in results) == list(range(len(results)))
    for r in results:
        assert r["world_size"] == 2 and r["sum"] == 3.0 and r["backend"] == backend


def test_plain_python_spawns_ranks():
    _check(_run([sys.executable, SCRIPT, "torch"]), "torch", processes=1)  # rank 0's result only


def test_plain_python_mpi_backend_spawns_mpiexec():
    needs_mpi()
    _check(_run([sys.executable, SCRIPT, "mpi"]), "mpi", processes=1)


def test_under_torchrun():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    _check(_run([torchrun, "--standalone", "--nproc_per_node=2", SCRIPT, "torch"]), "torch", processes=2)


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_under_mpiexec(backend):
    needs_mpi()
    results = _run([mpiexec_path(), "-n", "2", sys.executable, "-m", "mpi4py", SCRIPT, backend])
    _check(results, backend, processes=2)
