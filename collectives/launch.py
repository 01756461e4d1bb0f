"""Starting ranks: ``launch`` (local processes, the embedded default) and ``init`` (under torchrun or mpiexec).

``launch(fn, world_size)`` spawns ``world_size`` fresh interpreters (spawn, never fork), connects them over a
FileStore in a private temporary folder (no port is ever chosen by us), binds gloo to loopback, runs
``fn(comm, **kwargs)`` on every rank and returns rank 0's result. If any rank raises or dies, every other rank is
terminated and the caller gets ``LaunchError`` naming the rank and carrying its traceback. When the process was
started by ``torchrun`` or ``mpiexec`` (seen in the environment), ``launch`` spawns nothing: it joins that job
and runs ``fn`` in place, so one script works under all three.

``fn`` must be importable by name in a fresh interpreter (a module-level function; in a script, guard the call
with ``if __name__ == "__main__":``), and its kwargs and result must be picklable: they travel between our own
processes through files in our own temporary folder, never from a user's file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import FileStore  # pyright: ignore[reportPrivateImportUsage]  # public API; torch re-exports it without `as`

from collectives.base import Communicator
from collectives.launch_reports import LaunchError
from collectives.launch_spawn import BACKENDS, LaunchOptions, launch_mpi, launch_spawn, mpiexec_path
from collectives.mpi_backend import MPICommunicator, mpi_env_rank
from collectives.nvshmem_backend import NVSHMEMCommunicator
from collectives.rendezvous import env_store, mpi_store
from collectives.torch_backend import from_group, init_torch
from collectives.trace import tracer_from_env

__all__ = [
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
]


def external_launcher() -> str | None:
    """``"torchrun"`` or ``"mpi"`` when this process is one rank of a job started by that launcher, else None."""
    if os.environ.get("MOONEP_LOCAL_RANK_OF") is not None:
        return None  # one of our own spawned ranks: launch() must not recurse
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return "torchrun"  # checked first: under torchrun, mpi4py would report a singleton world
    return "mpi" if mpi_env_rank() is not None else None


LOCAL_RANK_ENV = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")
"""Where torchrun, MPICH and Open MPI put a rank's index among the job's ranks on its host."""
LOCAL_SIZE_ENV = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MOONEP_LOCAL_RANK_OF")
"""Where torchrun, MPICH, Open MPI and our own launcher put the number of the job's ranks on this host."""


def _env_int(keys: tuple[str, ...]) -> int | None:
    for key in keys:
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return None


def local_rank(rank: int) -> int:
    """This process's index among the job's ranks on its host: from the launcher's environment, else ``rank``
    (our launcher runs every rank on one host)."""
    found = _env_int(LOCAL_RANK_ENV)
    return rank if found is None else found


def check_device(device: str) -> None:
    """ValueError unless ``device`` is ``"cpu"``, or ``"cuda"`` with a CUDA device visible to torch."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda asked for, but torch sees no CUDA device")


def rank_device(comm: Communicator, device: str):
    """The ``torch.device`` for this rank's tensors: ``"cpu"``, or ``"cuda"`` = GPU ``local rank`` (made
    current). The torch backend moves CUDA tensors over NCCL, which takes one GPU per rank, so more local ranks
    than visible GPUs is a ValueError (on every rank); the MPI backend stages CUDA tensors through host memory
    and may share a GPU (``local rank % GPUs``). ValueError too when CUDA is asked for and absent."""
    check_device(device)
    if device == "cpu":
        return torch.device("cpu")
    gpus, local = torch.cuda.device_count(), _env_int(LOCAL_SIZE_ENV) or comm.world_size
    if comm.backend == "torch" and local > gpus:
        raise ValueError(
            f"device: {local} ranks on this host but {gpus} visible GPU(s); NCCL needs one GPU per "
            f"rank: run at most {gpus} ranks per host, or use the mpi backend"
        )
    index = local_rank(comm.rank) % gpus
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    backend: str = "torch",
    *,
    timeout: float = 60.0,
    threads_per_rank: int = 1,
    validate: bool = True,
    trace_dir: str | None = None,
    job_timeout: float | None = None,
    **kwargs,
) -> Any:
    """Run ``fn(comm, **kwargs)`` on ``world_size`` ranks and return rank 0's result.

    ``timeout`` bounds each collective; ``job_timeout`` (seconds, default unbounded) bounds the whole job.
    Under torchrun/mpiexec the launcher's world size is used and this rank's own result is returned.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    opts = LaunchOptions(backend, timeout, threads_per_rank, validate, trace_dir)
    if external_launcher() is not None:
        comm = init(backend, timeout=timeout, validate=validate, trace_dir=trace_dir)
        try:
            return fn(comm, **kwargs)
        except BaseException as exc:
            comm.report_failure(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            comm.close()
    if backend == "mpi":
        return launch_mpi(fn, world_size, opts, kwargs, job_timeout)
    return launch_spawn(fn, world_size, opts, kwargs, job_timeout)


# ------------------------------------------------------------------------------------------- join a job
def init(
    backend: str | None = None, *, timeout: float = 60.0, validate: bool = True, trace_dir: str | None = None
) -> Communicator:
    """This process's world communicator under torchrun, mpiexec, or alone (world size 1).

    When torch.distributed is already initialised (the trainer called ``init_process_group``), the torch and
    nvshmem backends adopt that default group (``from_group(None)``) instead of initialising again; closing the
    result then leaves the group to its owner. ``backend`` defaults to ``torch`` under torchrun or alone and to
    ``mpi`` under mpiexec. ``backend="torch"``
    under mpiexec bootstraps torch.distributed through MPI (rank 0's store address is broadcast); ``nvshmem``
    bootstraps NVSHMEM through a torch group.
    """
    launcher = external_launcher()
    backend = backend or ("mpi" if launcher == "mpi" else "torch")
    LaunchOptions(backend, timeout)  # argument checks
    if backend != "mpi" and dist.is_initialized():  # the trainer already called init_process_group: adopt it
        comm = from_group(None, timeout=timeout, validate=validate, trace_dir=trace_dir)
        return NVSHMEMCommunicator(comm) if backend == "nvshmem" else comm
    if backend == "mpi":
        from mpi4py import MPI  # optional: mpi4py (the mpi extra); importing it initialises MPI

        return MPICommunicator(
            timeout=timeout, validate=validate, tracer=tracer_from_env(MPI.COMM_WORLD.Get_rank(), trace_dir)
        )
    comm = _init_torch_from(launcher, timeout, validate, trace_dir)
    if backend == "nvshmem":
        return NVSHMEMCommunicator(comm)
    return comm


def _init_torch_from(launcher: str | None, timeout: float, validate: bool, trace_dir: str | None):
    if launcher == "torchrun":  # our bounded env:// store: torch's own blocks without limit on a mute port
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = env_store(rank, size, timeout)
        return init_torch(rank, size, store=store, timeout=timeout, validate=validate, trace_dir=trace_dir)
    if launcher == "mpi":
        from mpi4py import MPI  # optional: mpi4py (the mpi extra); importing it initialises MPI

        world = MPI.COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()
        store = mpi_store(world, timeout)
        return init_torch(rank, size, store=store, timeout=timeout, validate=validate, trace_dir=trace_dir)
    tmp = tempfile.mkdtemp(prefix="moonep-single-")
    os.environ.setdefault("MOONEP_LOOPBACK", "1")
    return init_torch(
        0,
        1,
        store=FileStore(os.path.join(tmp, "store"), 1),
        timeout=timeout,
        validate=validate,
        trace_dir=trace_dir,
    )
