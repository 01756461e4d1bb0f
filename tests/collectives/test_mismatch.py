"""Two ranks whose calls disagree, on real ranks: each case must end in the same named error on every rank within
its timeout (or give the right result), never in garbage, a hang, or a process killed by gloo.

- checked ``send``/``recv`` (``validate=True``): sizes, dtypes and roles that differ are named on both ranks;
- unchecked all-to-all (``validate=False``, ``all_to_all_single_start``): split sizes or row sizes that differ
  across ranks were garbage (a shorter send left zeros) or SIGABRT in gloo's thread on the receiver and
  "connection reset" on the sender;
- a rendezvous whose ``MASTER_PORT`` another process holds without answering blocked rank 1 in torch's store
  client for minutes, whatever ``timeout`` it was given;
- the MPI rank helper must refuse a job folder that is not the launcher's private one, before unpickling anything.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from collectives import Communicator, launch
from tests.collectives.conftest import needs_mpi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


# ------------------------------------------------------------------------------------------- send / recv
def _p2p_tensor(case: str, rank: int) -> torch.Tensor:
    pairs = {  # case: (rank 0's tensor, rank 1's tensor)
        "size": (torch.arange(6.0), torch.zeros(4)),
        "dtype": (torch.arange(4.0), torch.zeros(4, dtype=torch.int32)),
        "shape": (torch.zeros(2, 3), torch.zeros(3, 2)),
        "both_send": (torch.zeros(4), torch.zeros(4)),
        "match": (torch.arange(5.0) + 10, torch.zeros(5)),
        "bad_tensor": (torch.zeros(4), torch.zeros(4, 2)[:, 0]),  # not contiguous: bad on rank 1 alone
    }
    return pairs[case][rank]


def _p2p_case(comm, case: str) -> str:
    """Rank 0 sends, rank 1 receives (both send for ``both_send``), checked; returns this rank's outcome."""
    t = _p2p_tensor(case, comm.rank)
    if comm.rank == 0 or case == "both_send":
        return _outcome(lambda: comm.send(t, 1 - comm.rank, timeout=10, validate=True))
    outcome = _outcome(lambda: comm.recv(t, 0, timeout=10, validate=True))
    return f"{outcome} {t.tolist()}" if case == "match" else outcome


def p2p_job(comm) -> dict[str, list[str]]:
    cases = ("size", "dtype", "shape", "both_send", "bad_tensor", "match")
    mine = {case: _p2p_case(comm, case) for case in cases}
    return {case: _gather_text(comm, mine[case]) for case in cases}


def _gather_text(comm, text: str) -> list[str]:
    """Every rank's ``text`` (the group is still in step after a named mismatch, so it can carry them)."""
    raw = text.encode()[:600]
    buf = torch.zeros(600, dtype=torch.uint8)
    buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    everyone = torch.empty(comm.world_size * 600, dtype=torch.uint8)
    comm.all_gather(everyone, buf)
    return [bytes(row.tolist()).rstrip(b"\0").decode() for row in everyone.view(comm.world_size, 600)]


@pytest.mark.parametrize("backend", ["torch", "mpi"])
@pytest.mark.spawns
def test_checked_send_recv_names_a_mismatch_on_both_ranks(backend):
    """Unchecked, a 6-element send into a 4-element recv and float bits into int32 passed without a word."""
    if backend == "mpi":
        needs_mpi()
    t0 = time.monotonic()
    got = launch(p2p_job, 2, backend=backend, timeout=20, job_timeout=90)
    assert time.monotonic() - t0 < 60
    want = {
        "size": "send and recv disagree on shape: rank 0 sends (6,), rank 1 receives into (4,)",
        "dtype": "send and recv disagree on dtype: rank 0 sends torch.float32, rank 1 receives into torch.int32",
        "shape": "send and recv disagree on shape: rank 0 sends (2, 3), rank 1 receives into (3, 2)",
        "both_send": "ranks 0 and 1 both called send: a send pairs with a recv on the peer",
    }
    for case, text in want.items():
        ops = ("send", "send" if case == "both_send" else "recv")
        for rank, msg in enumerate(got[case]):
            assert msg == f"ValueError: {ops[rank]} on rank {rank}: {text}", (case, msg)
    assert got["bad_tensor"] == [
        "ValueError: send on rank 0: rank 1 passed invalid arguments (its own error says which); nothing was sent",
        "ValueError: recv on rank 1: tensor must be contiguous",
    ]
    assert got["match"] == ["ok", "ok [10.0, 11.0, 12.0, 13.0, 14.0]"]


def test_send_recv_say_unchecked_in_their_first_docstring_line():
    for fn in (Communicator.send, Communicator.recv):
        assert "UNCHECKED unless" in fn.__doc__.splitlines()[0]
    for fn in (Communicator.all_to_all_single, Communicator.all_to_all_single_start):
        assert "UNDETECTED" in fn.__doc__.splitlines()[0] and "CUDA" in fn.__doc__.splitlines()[0]


# ------------------------------------------------------------------------------------------- unchecked all-to-all
A2A_CASES = {
    # case: ((in_splits, out_splits, row width) on rank 0, the same on rank 1)
    "fewer_rows_sent": (([1, 2], [1, 1], 4), ([1, 1], [3, 1], 4)),  # rank 1 expects 3 rows, gets 2: zeros stayed
    "more_rows_sent": (([1, 3], [1, 1], 4), ([1, 1], [1, 1], 4)),  # rank 1 gets 3 rows into 1: gloo's SIGABRT
    "wider_rows_sent": (([1, 1], [1, 1], 8), ([1, 1], [1, 1], 4)),  # same splits, twice the bytes: SIGABRT
}
A2A_WANT = {
    "fewer_rows_sent": "split sizes do not match across ranks: rank 0 sends 2 rows to rank 1, which expects 3",
    "more_rows_sent": "split sizes do not match across ranks: rank 0 sends 3 rows to rank 1, which expects 1",
    "wider_rows_sent": "ranks disagree on elements per row: rank 0 8, rank 1 4",
}


def _blocking_a2a(comm, out, inp, outs, ins) -> None:
    comm.all_to_all_single(out, inp, outs, ins, validate=False, timeout=10)


def _started_a2a(comm, out, inp, outs, ins) -> None:
    comm.all_to_all_single_start(out, inp, outs, ins, timeout=10).wait()


def a2a_job(comm) -> dict[str, list[str]]:
    results = {}
    for case, per_rank in A2A_CASES.items():
        ins, outs, width = per_rank[comm.rank]
        inp = torch.arange(sum(ins) * width, dtype=torch.float32).reshape(-1, width)
        for form in ("blocking", "start"):
            out = torch.zeros(sum(outs), width)
            call = _blocking_a2a if form == "blocking" else _started_a2a
            msg = _outcome(functools.partial(call, comm, out, inp, outs, ins))
            results[f"{case}/{form}"] = _gather_text(comm, msg)
    return results


@pytest.mark.parametrize("backend", ["torch", "mpi"])
@pytest.mark.spawns
def test_unchecked_all_to_all_names_disagreeing_sizes_on_every_rank(backend):
    if backend == "mpi":
        needs_mpi()
    t0 = time.monotonic()
    got = launch(a2a_job, 2, backend=backend, timeout=20, job_timeout=90)
    assert time.monotonic() - t0 < 60
    for key, msgs in got.items():
        want = A2A_WANT[key.split("/")[0]]
        for rank, msg in enumerate(msgs):
            assert msg == f"ValueError: all_to_all_single on rank {rank}: {want}", (key, msg)


# ------------------------------------------------------------------------------------------- rendezvous timeout
RANK_CODE = """
import json, sys, time
import collectives
t0 = time.monotonic()
try:
    collectives.init(timeout=float(sys.argv[1]))
    outcome = "ok"
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
print("RESULT " + json.dumps({"s": time.monotonic() - t0, "outcome": outcome}), flush=True)
"""


class Squatter:
    """Holds a port like a foreign process that never answers: it listens, and accepts too when ``accept``."""

    def __init__(self, accept: bool):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        if accept:
            threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            while True:
                self.held.append(self.sock.accept()[0])
        except OSError:  # closed by close()
            pass

    def close(self) -> None:
        for s in [*self.held, self.sock]:
            s.close()


def _rank_env(rank: int, port: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MOONEP_", "TORCHELASTIC_"))}
    env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=ROOT)
    return env


@pytest.mark.parametrize("accept", [True, False], ids=["accepts-never-answers", "listens-never-accepts"])
@pytest.mark.spawns
@pytest.mark.solo
def test_rendezvous_on_a_held_port_fails_within_the_timeout_on_every_rank(accept):
    """Rank 1's store client waited for the squatter's first answer without limit (>100 s for timeout=8)."""
    timeout, squatter = 3.0, Squatter(accept)
    procs = []
    try:
        for rank in range(2):
            cmd = [sys.executable, "-c", RANK_CODE, str(timeout)]
            procs.append(subprocess.Popen(cmd, env=_rank_env(rank, squatter.port), stdout=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
        squatter.close()
    for rank, out in enumerate(outs):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert lines, f"rank {rank} printed no result: {out[-2000:]}"
        result = json.loads(lines[-1][len("RESULT ") :])
        assert result["outcome"].startswith("CollectiveError: rendezvous with the store at "), result
        assert f"127.0.0.1:{squatter.port}" in result["outcome"], result
        assert result["s"] < timeout + 1.5, f"rank {rank} took {result['s']:.1f}s for a {timeout}s timeout"


# ------------------------------------------------------------------------------------------- MPI rank helper
def _booby_trapped_job(folder: Path, marker: Path) -> None:
    """A ``job.pkl`` that creates ``marker`` when unpickled: proof that the helper read it."""
    with open(folder / "job.pkl", "wb") as f:
        pickle.dump(_Touch(str(marker)), f)


class _Touch:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _run_helper(folder: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "collectives._mpi_rank", folder]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.spawns
def test_mpi_rank_helper_refuses_a_job_folder_outside_its_private_one(tmp_path):
    """The helper unpickled whatever ``<folder>/job.pkl`` its argument named (and wrote pid files there)."""
    outside = tmp_path / "moonep-mpi-forged"
    outside.mkdir(mode=0o700)
    marker = tmp_path / "unpickled"
    _booby_trapped_job(outside, marker)
    proc = _run_helper(str(outside))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "refusing the job folder" in proc.stderr and "not a moonep-mpi-* folder directly in" in proc.stderr
    assert not marker.exists() and not list(outside.glob("rank*.pid"))

    with tempfile.TemporaryDirectory(prefix="moonep-mpi-") as private:  # the right folder, its job.pkl elsewhere
        os.symlink(outside / "job.pkl", os.path.join(private, "job.pkl"))
        proc = _run_helper(private)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "outside the job folder" in proc.stderr, proc.stderr[-2000:]
        assert not marker.exists() and not list(Path(private).glob("rank*.pid"))
