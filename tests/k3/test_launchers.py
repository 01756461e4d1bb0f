"""`python -m k3.train` joins the job it is launched in: under torchrun and mpiexec (CPU, gloo) it trains the
same losses as under our own launcher (the issue's "also runs under torchrun / mpiexec"; on GPUs it is untested)."""

import json
import os
import subprocess
import sys

import pytest

from collectives.launch import mpiexec_path
from tests.collectives.conftest import needs_mpi

pytestmark = pytest.mark.spawns  # every test here starts processes: make test-fast leaves them out

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = ["-m", "k3.train", "--world-size", "2", "--steps", "2"]


def _losses(cmd, run_dir) -> list[float]:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE"):
        env.pop(key, None)
    proc = subprocess.run(cmd + ["--run-dir", str(run_dir)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _losses([sys.executable] + TRAIN, tmp_path_factory.mktemp("local"))


@pytest.mark.slow
def test_under_torchrun_same_losses(reference, tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    got = _losses([torchrun, "--standalone", "--nproc_per_node=2", "-m", "k3.train"] + TRAIN[2:], tmp_path)
    assert len(got) == 2 and got == reference


@pytest.mark.slow
def test_under_mpiexec_same_losses(reference, tmp_path):
    needs_mpi()
    got = _losses([mpiexec_path(), "-n", "2", sys.executable] + TRAIN, tmp_path)
    assert len(got) == 2 and got == reference
