"""One rank of a job started by ``collectives.launch(..., backend="mpi")``.

Run by ``mpiexec -n N python -m mpi4py -m collectives._mpi_rank <job folder>``; the job folder is the launcher's
private temporary folder, holding ``job.pkl`` that the launcher itself wrote (and ``main_path.txt`` when ``fn``
lives in the user's script). Only ever run under mpiexec, so mpi4py is imported at module level.
"""

from __future__ import annotations

import os
import pickle
import sys
from multiprocessing import spawn

import torch
from mpi4py import MPI

from collectives.launch import _record_failure, _write_result
from collectives.mpi_backend import _WATCHDOG, MPICommunicator
from collectives.trace import tracer_from_env


def main(folder: str) -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    with open(os.path.join(folder, f"rank{rank}.pid"), "w") as f:  # mpiexec names a dead rank by its PID
        f.write(str(os.getpid()))
    comm = None
    try:
        main_file = os.path.join(folder, "main_path.txt")
        if os.path.exists(main_file):  # fn lives in the user's script: import it as spawn would
            with open(main_file) as f:
                spawn._fixup_main_from_path(f.read())
        with open(os.path.join(folder, "job.pkl"), "rb") as f:
            job = pickle.load(f)
        opts = job["opts"]
        _WATCHDOG.report_path = os.path.join(folder, f"rank{rank}.peer")

        torch.set_num_threads(opts.threads_per_rank)
        comm = MPICommunicator(
            timeout=opts.timeout, validate=opts.validate, tracer=tracer_from_env(rank, opts.trace_dir)
        )
        result = job["fn"](comm, **job["kwargs"])
        if rank == 0:
            _write_result(folder, result)
        comm.close()
    except BaseException as exc:
        _record_failure(folder, rank, exc, comm)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    main(sys.argv[1])
