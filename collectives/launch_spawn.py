"""Starting the ranks of a job on this host: ``launch_spawn`` (fresh interpreters, spawn, never fork, joined
over a FileStore in a private temporary folder, gloo bound to loopback) and ``launch_mpi`` (``mpiexec`` running
``collectives._mpi_rank``). Both supervise the ranks until they end: when one raises or dies, the others are
terminated and the caller gets the ``LaunchError`` of ``collectives.launch_reports`` naming the root cause.
``collectives.launch`` is the front door; ``LaunchOptions`` says how each rank sets itself up.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
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
from dataclasses import dataclass

import torch
from torch.distributed import FileStore  # pyright: ignore[reportPrivateImportUsage]  # public API; torch re-exports it without `as`

from collectives.base import Communicator
from collectives.launch_reports import (
    LaunchError,
    failure,
    mark_started,
    mpi_failure,
    read_result,
    record_failure,
    write_result,
)
from collectives.nvshmem_backend import NVSHMEMCommunicator
from collectives.torch_backend import init_torch
from collectives.warm_start import adopt_launcher_state, launcher_state, preload_modules, start_context
from moonep_base import UsageError, seconds_problem

BACKENDS = ("torch", "mpi", "nvshmem")


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
        if problem := seconds_problem(self.timeout):
            raise ValueError(f"timeout {problem}")
        if self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")


def check_local_limits(world_size: int) -> None:
    """``UsageError`` when this machine's limits cannot hold ``world_size`` local ranks: each rank is a process, and
    gloo connects every pair, so each rank holds a socket per peer (``RLIMIT_NPROC``, ``RLIMIT_NOFILE``)."""
    try:
        import resource  # optional: POSIX only
    except ImportError:  # no such limits to read
        return
    for name, limit, need, fix in (
        ("processes per user", resource.RLIMIT_NPROC, world_size, "ulimit -u"),
        ("open files per process", resource.RLIMIT_NOFILE, world_size + 64, "ulimit -n"),
    ):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY and need > soft:
            raise UsageError(
                f"world_size {world_size}: {world_size} local ranks need about {need} {name}, more than this "
                f"machine's limit of {soft} (`{fix}`); start fewer ranks, or launch across machines"
            )


def launch_spawn(fn, world_size: int, opts: LaunchOptions, kwargs: dict, job_timeout: float | None):
    check_local_limits(world_size)
    ctx = start_context()  # spawn, or warm from a forkserver (collectives.warm_start)
    state = launcher_state() if preload_modules() else None
    with tempfile.TemporaryDirectory(prefix="moonep-launch-") as tmp:
        with open(os.path.join(tmp, "fn_name"), "w") as f:
            f.write(f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}")
        procs = [
            ctx.Process(
                target=_spawned_rank, args=(rank, world_size, tmp, fn, kwargs, opts, state), name=f"moonep-rank{rank}"
            )
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
        return read_result(tmp)


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
    with contextlib.suppress(OSError, AttributeError):  # not Linux/glibc: the parent's SIGTERM handler cleans up
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _spawned_rank(rank: int, world_size: int, tmp: str, fn, kwargs: dict, opts: LaunchOptions, state=None) -> None:
    _die_with_parent()
    adopt_launcher_state(state)  # a warm rank: the launcher's environment and directory, as spawn gives them
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
        mark_started(tmp, rank)  # fn was found and is running: see launch_reports.failure
        result = fn(comm, **kwargs)
        if rank == 0:
            write_result(tmp, result)
        comm.close()
    except BaseException as exc:
        record_failure(tmp, rank, exc, comm)
        os._exit(1)  # skip interpreter teardown: peers may be mid-collective with us
    atexit._run_exitfuncs()  # Python-level cleanup (named semaphores, flushes) as a normal exit would do
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # but skip C++ static teardown, which can abort on gloo threads and adds nothing


def _rank_communicator(rank: int, world_size: int, tmp: str, opts: LaunchOptions) -> Communicator:
    store = FileStore(os.path.join(tmp, "store"), world_size)
    comm = init_torch(
        rank, world_size, store=store, timeout=opts.timeout, validate=opts.validate, trace_dir=opts.trace_dir
    )
    if opts.backend == "nvshmem":
        return NVSHMEMCommunicator(comm)
    return comm


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
                rank = _root_rank(procs, tmp, rank)
                raise failure(tmp, rank, procs[rank].exitcode)
        if deadline is not None and time.monotonic() > deadline:
            raise LaunchError(
                None,
                f"the job did not finish within job_timeout={job_timeout}s; "
                f"ranks still running: {sorted(running.values())}",
            )


def _root_rank(procs, tmp: str, rank: int) -> int:
    """The rank to name first: one that died without writing a report (killed, or exited in C code) outranks the
    rank the supervisor happened to see first, which may only have reported that peer's death (both can be dead
    by the time the supervisor wakes, in either order)."""
    for r, p in enumerate(procs):
        reported = any(os.path.exists(os.path.join(tmp, f"rank{r}{s}")) for s in (".err", ".peer"))
        if p.exitcode not in (None, 0) and not reported:
            return r
    return rank


def _terminate(procs, grace_s: float = 2.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        if p.pid is None:  # never started: the start loop was cut short (SIGTERM, a failed start)
            continue
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


# ------------------------------------------------------------------------------------------- mpiexec ranks
def mpiexec_path() -> str:
    """The ``mpiexec`` beside this interpreter (the ``mpich`` wheel puts one there), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = here if os.access(here, os.X_OK) else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("backend='mpi' needs mpiexec: pip install 'moonep[mpi]' (mpi4py + mpich)")
    return found


def launch_mpi(fn, world_size: int, opts: LaunchOptions, kwargs: dict, job_timeout: float | None):
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
            raise mpi_failure(tmp, proc)
        return read_result(tmp)
