"""One rank of a job started by ``collectives.launch(..., backend="mpi")``.

Run by ``mpiexec -n N python -m mpi4py -m collectives._mpi_rank <job folder>``; the job folder is the launcher's
private temporary folder, holding ``job.pkl`` that the launcher itself wrote (and ``main_path.txt`` when ``fn``
lives in the user's script). Unpickling ``job.pkl`` and importing the script named in ``main_path.txt`` run code,
so before either the folder must be what the launcher makes (``job_folder_problem``): a folder of this user's, in
the temporary folder, named ``moonep-mpi-*``, closed to group and others, and the files in it regular files of this
user's that resolve inside it. Anything else is refused with exit status 2 before anything in it is read (and
before mpi4py is imported here, so a refusal needs no MPI).
"""

from __future__ import annotations

import os
import pickle
import stat
import sys
import tempfile
from multiprocessing import spawn

import torch

from collectives.launch_reports import mark_started, record_failure, write_result
from collectives.mpi_backend import _WATCHDOG, MPICommunicator
from collectives.trace import tracer_from_env

FOLDER_PREFIX = "moonep-mpi-"
"""How ``collectives.launch`` names its MPI job folders (``tempfile.TemporaryDirectory(prefix=...)``)."""
JOB_FILES = ("job.pkl", "main_path.txt")
"""The files this helper reads from the folder (``main_path.txt`` only when present)."""


def job_folder_problem(folder: str) -> str | None:
    """Why ``folder`` is not a private job folder that ``collectives.launch`` made, else None."""
    real = os.path.realpath(folder)
    temp = os.path.realpath(tempfile.gettempdir())
    if os.path.dirname(real) != temp or not os.path.basename(real).startswith(FOLDER_PREFIX):
        return f"{folder} resolves to {real}, which is not a {FOLDER_PREFIX}* folder directly in {temp}"
    info = os.lstat(real) if os.path.lexists(real) else None
    if info is None or not stat.S_ISDIR(info.st_mode):
        return f"{real} is not a folder"
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        return f"{real} is not private to this user (owner uid {info.st_uid}, mode {stat.filemode(info.st_mode)})"
    for name in JOB_FILES:
        path = os.path.join(real, name)
        if name == "main_path.txt" and not os.path.lexists(path):
            continue
        if not os.path.lexists(path):
            return f"{path} does not exist"
        if os.path.dirname(os.path.realpath(path)) != real:
            return f"{path} resolves to {os.path.realpath(path)}, outside the job folder"
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return f"{path} is not a regular file of this user's"
    return None


def main(folder: str) -> None:
    from mpi4py import MPI  # optional: mpi4py; importing it initialises MPI, which a refused folder never reaches

    rank = MPI.COMM_WORLD.Get_rank()
    with open(os.path.join(folder, f"rank{rank}.pid"), "w") as f:  # mpiexec names a dead rank by its PID
        f.write(str(os.getpid()))
    comm: MPICommunicator | None = None
    try:
        main_file = os.path.join(folder, "main_path.txt")
        if os.path.exists(main_file):  # fn lives in the user's script: import it as spawn would
            with open(main_file) as f:
                # a private CPython helper (absent from typeshed): imports the script as __mp_main__, as spawn does
                spawn._fixup_main_from_path(f.read())  # pyright: ignore[reportAttributeAccessIssue]
        with open(os.path.join(folder, "job.pkl"), "rb") as f:
            job = pickle.load(f)
        opts = job["opts"]
        _WATCHDOG.report_path = os.path.join(folder, f"rank{rank}.peer")

        torch.set_num_threads(opts.threads_per_rank)
        comm = MPICommunicator(
            timeout=opts.timeout, validate=opts.validate, tracer=tracer_from_env(rank, opts.trace_dir)
        )
        mark_started(folder, rank)  # fn is running: see launch_reports.failure
        result = job["fn"](comm, **job["kwargs"])
        if rank == 0:
            write_result(folder, result)
        comm.close()
    except BaseException as exc:
        record_failure(folder, rank, exc, comm)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(
            "usage: mpiexec -n N python -m mpi4py -m collectives._mpi_rank <job folder made by collectives.launch>"
        )
    problem = job_folder_problem(sys.argv[1])
    if problem:
        sys.stderr.write(f"collectives._mpi_rank: refusing the job folder: {problem}\n")
        sys.exit(2)
    main(sys.argv[1])
