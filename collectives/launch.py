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

import atexit
import ctypes
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from collectives.base import CollectiveError, Communicator
from collectives.mpi_backend import MPICommunicator, mpi_env_rank
from collectives.nvshmem_backend import NVSHMEMCommunicator
from collectives.rendezvous import env_store, mpi_store
from collectives.torch_backend import from_group, init_torch
from collectives.trace import tracer_from_env

BACKENDS = ("torch", "mpi", "nvshmem")


class LaunchError(RuntimeError):
    """A rank of a launched job failed; ``rank`` is the global rank, ``details`` its traceback or exit status."""

    def __init__(self, rank: int | None, details: str):
        where = f"rank {rank}" if rank is not None else "a rank"
        super().__init__(f"{where} failed:\n{details}")
        self.rank = rank
        self.details = details


@dataclass(frozen=True)
class LaunchOptions:
    """How each rank sets itself up."""

    backend: str = "torch"
    """``torch`` (gloo on CPU, NCCL on GPU), ``mpi`` (mpi4py) or ``nvshmem`` (GPU only)."""
    timeout: float = 60.0
    """Seconds any single collective may take before it raises ``CollectiveError``."""
    threads_per_rank: int = 1
    """``torch.set_num_threads`` in each rank: one intra-op thread per rank, so ranks do not fight over cores."""
    validate: bool = True
    """Exchange an argument header before each collective (bad input fails on every rank)."""
    trace_dir: str | None = None
    """Folder for per-rank JSON-lines op traces; ``None`` defers to ``$MOONEP_TRACE_DIR``."""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {self.timeout}")
        if self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")


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
        return _launch_mpi(fn, world_size, opts, kwargs, job_timeout)
    return _launch_spawn(fn, world_size, opts, kwargs, job_timeout)


# ------------------------------------------------------------------------------------------- spawned ranks
def _launch_spawn(fn, world_size: int, opts: LaunchOptions, kwargs: dict, job_timeout: float | None):
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="moonep-launch-") as tmp:
        with open(os.path.join(tmp, "fn_name"), "w") as f:
            f.write(f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}")
        procs = [
            ctx.Process(target=_spawned_rank, args=(rank, world_size, tmp, fn, kwargs, opts), name=f"moonep-rank{rank}")
            for rank in range(world_size)
        ]
        previous = _exit_on_sigterm()
        try:
            for p in procs:
                p.start()
            _supervise(procs, tmp, job_timeout)
        finally:
            _terminate(procs)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        return _read_result(tmp)


def _exit_on_sigterm():
    """Make SIGTERM unwind this process (so ``finally`` terminates the ranks) instead of killing it outright,
    which would leave the spawned ranks running. Returns the previous handler, or None off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, _raise)


def _die_with_parent() -> None:
    """Linux: deliver SIGKILL to this rank if the launching process dies, even by SIGKILL (no orphans)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux/glibc: the parent's SIGTERM handler still cleans up
        pass


def _spawned_rank(rank: int, world_size: int, tmp: str, fn, kwargs: dict, opts: LaunchOptions) -> None:
    _die_with_parent()
    os.environ.update(
        MOONEP_LOCAL_RANK_OF=str(world_size),
        MOONEP_LOOPBACK="1",
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS=str(opts.threads_per_rank),
    )
    comm = None
    try:
        torch.set_num_threads(opts.threads_per_rank)
        comm = _rank_communicator(rank, world_size, tmp, opts)
        open(os.path.join(tmp, f"rank{rank}.started"), "w").close()  # fn was found and is running: see _failure
        result = fn(comm, **kwargs)
        if rank == 0:
            _write_result(tmp, result)
        comm.close()
    except BaseException as exc:
        _record_failure(tmp, rank, exc, comm)
        os._exit(1)  # skip interpreter teardown: peers may be mid-collective with us
    atexit._run_exitfuncs()  # Python-level cleanup (named semaphores, flushes) as a normal exit would do
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # but skip C++ static teardown, which can abort on gloo threads and adds nothing


def _rank_communicator(rank: int, world_size: int, tmp: str, opts: LaunchOptions) -> Communicator:
    store = dist.FileStore(os.path.join(tmp, "store"), world_size)
    comm = init_torch(
        rank, world_size, store=store, timeout=opts.timeout, validate=opts.validate, trace_dir=opts.trace_dir
    )
    if opts.backend == "nvshmem":
        return NVSHMEMCommunicator(comm)
    return comm


def _record_failure(tmp: str, rank: int, exc: BaseException, comm: Communicator | None) -> None:
    details = traceback.format_exc()
    secondary = isinstance(exc, CollectiveError)  # a peer's failure surfacing here, not the root cause
    with open(os.path.join(tmp, f"rank{rank}.{'peer' if secondary else 'err'}"), "w") as f:
        f.write(details)
    if comm is not None:
        comm.report_failure(f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
        if comm.tracer is not None:
            comm.tracer.close()


def _supervise(procs, tmp: str, job_timeout: float | None) -> None:
    deadline = None if job_timeout is None else time.monotonic() + job_timeout
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    while running:
        wait_s = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
        for sentinel in multiprocessing.connection.wait(list(running), timeout=wait_s):
            rank = running.pop(sentinel)
            procs[rank].join()
            if procs[rank].exitcode != 0:
                time.sleep(0.2)  # let peers that fail in turn write their files, then name the root cause
                raise _failure(tmp, rank, procs[rank].exitcode)
        if deadline is not None and time.monotonic() > deadline:
            raise LaunchError(
                None,
                f"the job did not finish within job_timeout={job_timeout}s; "
                f"ranks still running: {sorted(running.values())}",
            )


def _failure(tmp: str, first_rank: int, exitcode: int | None) -> LaunchError:
    """Name the root cause: a rank's own exception, else the first rank to die without one (killed), else a
    rank that only saw a peer fail."""
    reports = {suffix: {} for suffix in (".err", ".peer")}
    for name in sorted(os.listdir(tmp)):
        for suffix, found in reports.items():
            if name.startswith("rank") and name.endswith(suffix):
                with open(os.path.join(tmp, name)) as f:
                    found[int(name[4 : -len(suffix)])] = f.read()
    if reports[".err"]:
        rank = min(reports[".err"])
        return LaunchError(rank, reports[".err"][rank])
    if first_rank not in reports[".peer"] and exitcode is not None and exitcode != 0 and first_rank >= 0:
        if exitcode < 0:
            return LaunchError(first_rank, f"killed by signal {signal.Signals(-exitcode).name}")
        if os.path.exists(os.path.join(tmp, f"rank{first_rank}.started")):
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


def _fn_name(tmp: str) -> str:
    """How the failure message names the job's function (it is in the parent: the launch call knows it)."""
    try:
        with open(os.path.join(tmp, "fn_name")) as f:
            return f.read() or "fn"
    except OSError:
        return "fn"


def _terminate(procs, grace_s: float = 2.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _write_result(tmp: str, result: Any) -> None:
    with open(os.path.join(tmp, "result.pkl.part"), "wb") as f:
        pickle.dump(result, f)
    os.replace(os.path.join(tmp, "result.pkl.part"), os.path.join(tmp, "result.pkl"))


def _read_result(tmp: str) -> Any:
    # Only ever a file that rank 0 of this very job wrote into our private temporary folder.
    if not os.path.exists(os.path.join(tmp, "result.pkl")):
        raise LaunchError(0, "exited with status 0 without returning a result (os._exit(0) inside fn?)")
    with open(os.path.join(tmp, "result.pkl"), "rb") as f:
        return pickle.load(f)


# ------------------------------------------------------------------------------------------- mpiexec ranks
def mpiexec_path() -> str:
    """The ``mpiexec`` beside this interpreter (the ``mpich`` wheel puts one there), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = here if os.access(here, os.X_OK) else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("backend='mpi' needs mpiexec: pip install 'moonep[mpi]' (mpi4py + mpich)")
    return found


def _launch_mpi(fn, world_size: int, opts: LaunchOptions, kwargs: dict, job_timeout: float | None):
    main_path = getattr(sys.modules.get("__main__"), "__file__", None) if fn.__module__ == "__main__" else None
    with tempfile.TemporaryDirectory(prefix="moonep-mpi-") as tmp:
        if main_path:
            with open(os.path.join(tmp, "main_path.txt"), "w") as f:
                f.write(os.path.abspath(main_path))
        with open(os.path.join(tmp, "job.pkl"), "wb") as f:
            pickle.dump({"fn": fn, "kwargs": kwargs, "opts": opts}, f)
        env = dict(
            os.environ, OMP_NUM_THREADS=str(opts.threads_per_rank), PYTHONPATH=os.pathsep.join(p for p in sys.path if p)
        )
        cmd = [
            mpiexec_path(),
            "-n",
            str(world_size),
            sys.executable,
            "-m",
            "mpi4py",
            "-m",
            "collectives._mpi_rank",
            tmp,
        ]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=job_timeout)
        except subprocess.TimeoutExpired as exc:
            raise LaunchError(None, f"the MPI job did not finish within job_timeout={job_timeout}s") from exc
        if proc.returncode != 0:
            raise _mpi_failure(tmp, proc)
        return _read_result(tmp)


def _mpi_failure(tmp: str, proc: subprocess.CompletedProcess) -> LaunchError:
    error = _failure(tmp, -1, proc.returncode)
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
        store=dist.FileStore(os.path.join(tmp, "store"), 1),
        timeout=timeout,
        validate=validate,
        trace_dir=trace_dir,
    )
