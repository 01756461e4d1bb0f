"""What the ranks of a launched job leave in its private temporary folder, and how the launcher reads it.

A rank that raises writes its traceback to ``rank<N>.err`` (``rank<N>.peer`` when it only saw a peer fail: a
``CollectiveError``), rank 0 writes its result to ``result.pkl``, and a rank that found ``fn`` writes
``rank<N>.started``. When a rank fails the launcher turns those files, the exit status, and (under mpiexec) the
launcher's output into one ``LaunchError`` naming the root cause: a rank's own exception (one raised inside ``fn``
before one raised while joining the job), else the first rank to die without one, else a rank that only saw a
peer fail. Pickles travel only between our own processes, through
files in our own temporary folder, never from a user's file.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import traceback
from typing import Any

from collectives.base import CollectiveError, Communicator
from moonep_base import JobFailed


class LaunchError(JobFailed):
    """A rank of a launched job failed; ``rank`` is the global rank, ``details`` its traceback or exit status."""

    def __init__(self, rank: int | None, details: str):
        where = f"rank {rank}" if rank is not None else "a rank"
        super().__init__(f"{where} failed:\n{details}")
        self.rank = rank
        self.details = details


def record_failure(tmp: str, rank: int, exc: BaseException, comm: Communicator | None) -> None:
    """In a failing rank: write its traceback to ``rank<N>.err`` (``.peer`` for a ``CollectiveError``, a peer's
    failure surfacing here), tell peers through ``comm`` (when it was made) and flush its trace."""
    details = traceback.format_exc()
    secondary = isinstance(exc, CollectiveError)  # a peer's failure surfacing here, not the root cause
    with open(os.path.join(tmp, f"rank{rank}.{'peer' if secondary else 'err'}"), "w") as f:
        f.write(details)
    if comm is not None:
        comm.report_failure(f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
        if comm.tracer is not None:
            comm.tracer.close()


def mark_started(tmp: str, rank: int) -> None:
    """In a rank whose communicator is up: ``fn`` is about to run (``failure`` tells the two kinds of failure
    apart by this file)."""
    open(os.path.join(tmp, f"rank{rank}.started"), "w").close()


def _started(tmp: str, rank: int) -> bool:
    return os.path.exists(os.path.join(tmp, f"rank{rank}.started"))


def write_result(tmp: str, result: Any) -> None:
    """In rank 0: pickle ``fn``'s result to ``result.pkl`` (atomically: a reader never sees half a file)."""
    with open(os.path.join(tmp, "result.pkl.part"), "wb") as f:
        pickle.dump(result, f)
    os.replace(os.path.join(tmp, "result.pkl.part"), os.path.join(tmp, "result.pkl"))


def read_result(tmp: str) -> Any:
    """In the launcher: rank 0's result. Only ever a file that rank 0 of this very job wrote into our private
    temporary folder; ``LaunchError`` when there is none."""
    if not os.path.exists(os.path.join(tmp, "result.pkl")):
        raise LaunchError(0, "exited with status 0 without returning a result (os._exit(0) inside fn?)")
    with open(os.path.join(tmp, "result.pkl"), "rb") as f:
        return pickle.load(f)


def failure(tmp: str, first_rank: int, exitcode: int | None) -> LaunchError:
    """Name the root cause: a rank's own exception (raised inside ``fn`` first), else the first rank to die without
    one (killed), else a rank that only saw a peer fail."""
    reports = {suffix: {} for suffix in (".err", ".peer")}
    for name in sorted(os.listdir(tmp)):
        for suffix, found in reports.items():
            if name.startswith("rank") and name.endswith(suffix):
                with open(os.path.join(tmp, name)) as f:
                    found[int(name[4 : -len(suffix)])] = f.read()
    if reports[".err"]:
        # fn raising outranks a failure while joining the job: a peer that raised and exited can break a
        # handshake still under way on another rank (gloo's connectFullMesh: "Connection closed by peer")
        ran = [r for r in reports[".err"] if _started(tmp, r)]
        rank = min(ran or reports[".err"])
        return LaunchError(rank, reports[".err"][rank])
    if first_rank not in reports[".peer"] and exitcode is not None and exitcode != 0 and first_rank >= 0:
        if exitcode < 0:
            name = signal.Signals(-exitcode).name
            return LaunchError(first_rank, f"killed by signal {name}{_OOM_HINT if name == 'SIGKILL' else ''}")
        if _started(tmp, first_rank):
            return LaunchError(
                first_rank,
                f"exited with status {exitcode} while running {_fn_name(tmp)} without raising a Python exception "
                f"(os._exit, or a C extension ending the process; see its stderr above)",
            )
        return LaunchError(
            first_rank,
            f"exited with status {exitcode} before reporting an error: it failed "
            f"while starting (see its stderr above). Usual causes: the script calling "
            f'launch() lacks an `if __name__ == "__main__":` guard, or fn is not '
            f"importable by name (a lambda, a closure, or defined in an interactive "
            f"session)",
        )
    if reports[".peer"]:
        rank = min(reports[".peer"])
        return LaunchError(rank, reports[".peer"][rank])
    return LaunchError(None, f"exited with status {exitcode} without a Python traceback")


_OOM_HINT = (
    " (usually the kernel's out-of-memory killer, which `dmesg` names: fewer ranks or smaller sizes need less memory)"
)


def _fn_name(tmp: str) -> str:
    """How the failure message names the job's function (it is in the parent: the launch call knows it)."""
    try:
        with open(os.path.join(tmp, "fn_name")) as f:
            return f.read() or "fn"
    except OSError:
        return "fn"


def mpi_failure(tmp: str, proc: subprocess.CompletedProcess) -> LaunchError:
    error = failure(tmp, -1, proc.returncode)
    if error.rank is not None:
        return error
    # No rank wrote a traceback: one was killed. MPICH's Hydra reports the dead process by PID.
    text = proc.stdout + proc.stderr
    pids = {}
    for name in os.listdir(tmp):
        if name.startswith("rank") and name.endswith(".pid"):
            with open(os.path.join(tmp, name)) as f:
                pids[f.read().strip()] = int(name[4:-4])
    for line in text.splitlines():
        words = line.replace("=", " ").split()
        if "PID" in words and words.index("PID") + 1 < len(words) and words[words.index("PID") + 1] in pids:
            rank = pids[words[words.index("PID") + 1]]
            return LaunchError(rank, f"died without a Python traceback; mpiexec said:\n{text[-2000:]}")
    return LaunchError(None, f"mpiexec exited with status {proc.returncode}:\n{text[-4000:]}")
