"""``mpi`` backend: mpi4py, tensors exchanged as raw buffers (never pickled).

A rank that never reaches a validated call is named on timeout, as on the torch backend: when the group lives on
one node, its ranks keep their counts of validated calls in an MPI shared-memory array (written and read with
plain memory accesses, no MPI call), so the rank whose call timed out can see whose count is behind.

Launch with ``mpiexec -n N python -m mpi4py your_script.py`` (the ``-m mpi4py`` runner aborts the whole job when
one rank raises; without it the other ranks would wait for their timeout). Every call is nonblocking and polled
until done or until its timeout, which raises ``CollectiveError``. CPU tensors are passed to MPI in place; CUDA
tensors are staged through host memory (correct everywhere, fast nowhere: use the torch/NCCL backend on GPUs).
Reductions of bf16/fp16 run in fp32 (MPI has no half-precision types) and are rounded once.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from collectives import agreement
from collectives.base import CollectiveError, Communicator
from collectives.peer_checks import row_numel as _row_numel
from collectives.trace import Tracer

if TYPE_CHECKING:  # optional: mpi4py (the mpi extra), for its types only; importing it at run time initialises MPI
    from mpi4py import MPI


def _mpi():
    from mpi4py import MPI  # optional: mpi4py (the mpi extra); importing it initialises MPI, which only MPI runs want

    return MPI


_NO_NUMPY = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}


def _bytes(t: torch.Tensor):
    """A writable numpy view of a contiguous CPU tensor's memory (sent as ``MPI.BYTE``: only the bytes count)."""
    return t.view(_NO_NUMPY[t.dtype]).numpy() if t.dtype in _NO_NUMPY else t.numpy()


def _typed(t: torch.Tensor):
    MPI = _mpi()
    kinds = {
        torch.float32: MPI.FLOAT,
        torch.float64: MPI.DOUBLE,
        torch.int32: MPI.INT32_T,
        torch.int64: MPI.INT64_T,
        torch.int16: MPI.INT16_T,
        torch.int8: MPI.INT8_T,
        torch.uint8: MPI.UINT8_T,
    }
    return [t.reshape(-1).numpy(), kinds[t.dtype]]


_HALF = (torch.bfloat16, torch.float16)


class _Staged:
    """Host copies of (possibly CUDA or half-precision) tensors for one MPI call, written back on exit."""

    def __init__(self, *tensors: torch.Tensor, upcast: bool = False):
        self.originals = tensors
        self.hosts = tensors
        self.staged = any(t.is_cuda or (upcast and t.dtype in _HALF) for t in tensors)
        if self.staged:  # the common case (CPU, no upcast) passes the tensors' own memory to MPI
            self.hosts = tuple(
                (t.cpu() if t.is_cuda else t).float() if upcast and t.dtype in _HALF else (t.cpu() if t.is_cuda else t)
                for t in tensors
            )

    def write_back(self, *which: int) -> None:
        if self.staged:
            for i in which:
                if self.hosts[i] is not self.originals[i]:
                    self.originals[i].copy_(self.hosts[i])


def _alltoallv_args(staged: _Staged, inp, out_splits, in_splits) -> tuple[list, list]:
    """(send spec, receive spec) of an (I)Alltoallv over the staged host buffers, splits in bytes."""
    row = _row_numel(inp) * inp.element_size()
    send, recv, BYTE = [n * row for n in in_splits], [n * row for n in out_splits], _mpi().BYTE
    return (
        [_bytes(staged.hosts[1]), (send, _displs(send)), BYTE],
        [_bytes(staged.hosts[0]), (recv, _displs(recv)), BYTE],
    )


class MPICommunicator(Communicator):
    """A ``Communicator`` over an ``mpi4py`` communicator (``MPI.COMM_WORLD`` unless given). Construction is
    collective over that communicator (it sets up the shared arrival counts)."""

    backend = "mpi"

    def __init__(
        self,
        comm: MPI.Comm | None = None,
        *,
        timeout: float = 60.0,
        validate: bool = True,
        tracer: Tracer | None = None,
        blocking: bool = True,
    ):
        MPI = _mpi()
        self.blocking = blocking
        self.comm: MPI.Comm = MPI.COMM_WORLD if comm is None else comm  # mpi4py's, not a Communicator
        world_group = MPI.COMM_WORLD.Get_group()
        group_ranks = MPI.Group.Translate_ranks(self.comm.Get_group(), list(range(self.comm.Get_size())), world_group)
        super().__init__(
            self.comm.Get_rank(),
            self.comm.Get_size(),
            group_ranks,
            timeout=timeout,
            validate=validate,
            tracer=tracer,
            global_rank=MPI.COMM_WORLD.Get_rank(),
        )
        self._arrival_win, self._arrival_counts = _arrival_array(self.comm)
        # one run id for every rank's trace header (construction is collective: every rank takes part)
        run_id = self.comm.bcast(uuid.uuid4().hex if self.rank == 0 else None, root=0)
        if self.tracer is not None and self.tracer.run_id is None and self.comm.Get_size() == MPI.COMM_WORLD.Get_size():
            self.tracer.run_id = run_id

    def _mark_arrival(self, count: int) -> None:
        if self._arrival_counts is not None:
            self._arrival_counts[self.rank] = count

    def _arrivals(self) -> dict[int, int] | None:
        if self._arrival_counts is None:
            return None
        return {r: int(c) for r, c in enumerate(self._arrival_counts)}

    def _sizes_agreed_on_host(self, t) -> bool:
        """Always (world > 1): CUDA tensors are staged through host memory anyway, so the host waits for every
        exchange and an unchecked all-to-all can agree its sizes like a CPU one."""
        return self.world_size > 1

    def _call(self, name: str, op: str, timeout: float, *args, **kwargs) -> None:
        """Run MPI's ``name`` (blocking spelling, e.g. ``Alltoallv``) within ``timeout`` seconds.

        Blocking mode (default) calls MPI's blocking routine, which MPICH tunes best, while a watchdog thread
        ends the job with a message naming the op if the deadline passes: an MPI collective cannot be cancelled,
        so a timed-out communicator is unusable anyway. ``blocking=False`` posts the nonblocking twin and polls
        it, raising a catchable ``CollectiveError`` instead (slower on oversubscribed cores).
        """
        if self.blocking:
            _WATCHDOG.arm(self, op, timeout)
            try:
                getattr(self.comm, name)(*args, **kwargs)
            finally:
                _WATCHDOG.disarm()
            return
        request = getattr(self.comm, "I" + name[0].lower() + name[1:])(*args, **kwargs)
        self._finish(request, op, timeout)

    def _finish(self, request, op: str, timeout: float) -> None:
        """Wait for a posted nonblocking request within ``timeout`` seconds (polling: a catchable error)."""
        deadline = time.monotonic() + timeout
        while not request.Test():
            os.sched_yield()  # MPI progresses only inside MPI calls; yielding lets oversubscribed peers run
            if time.monotonic() > deadline:
                raise CollectiveError(
                    f"{op} on rank {self.global_rank} did not complete within its {timeout:g}s "
                    f"timeout (a peer is dead, stuck, or called a different collective)",
                    op=op,
                )

    def _all_to_all_single(self, out, inp, out_splits, in_splits, timeout):
        s = _Staged(out, inp)
        BYTE = _mpi().BYTE
        if len(set(in_splits)) == 1 and len(set(out_splits)) == 1:  # MPICH's Alltoall beats Alltoallv here
            self._call("Alltoall", "all_to_all_single", timeout, [_bytes(s.hosts[1]), BYTE], [_bytes(s.hosts[0]), BYTE])
            s.write_back(0)
            return out
        self._call("Alltoallv", "all_to_all_single", timeout, *_alltoallv_args(s, inp, out_splits, in_splits))
        s.write_back(0)
        return out

    def _start_all_to_all_single(self, out, inp, out_splits, in_splits, timeout):
        """Post MPI's nonblocking Ialltoallv now; the returned callable polls it to completion."""
        s = _Staged(out, inp)
        request = self.comm.Ialltoallv(*_alltoallv_args(s, inp, out_splits, in_splits))

        def finish() -> None:
            self._finish(request, "all_to_all_single", timeout)
            s.write_back(0)

        return finish

    def _all_gather(self, out, inp, timeout):
        s = _Staged(out, inp)
        BYTE = _mpi().BYTE
        self._call("Allgather", "all_gather", timeout, [_bytes(s.hosts[1]), BYTE], [_bytes(s.hosts[0]), BYTE])
        s.write_back(0)
        return out

    def _all_reduce(self, tensor, op, timeout):
        if tensor.dtype == torch.bool:
            raise ValueError("all_reduce on bool tensors is not supported; reduce them as uint8")
        s = _Staged(tensor, upcast=True)
        self._call("Allreduce", "all_reduce", timeout, _mpi().IN_PLACE, _typed(s.hosts[0]), _mpi_op(op))
        s.write_back(0)
        return tensor

    def _reduce_scatter(self, out, inp, op, timeout):
        s = _Staged(out, inp, upcast=True)
        self._call(
            "Reduce_scatter_block", "reduce_scatter", timeout, _typed(s.hosts[1]), _typed(s.hosts[0]), _mpi_op(op)
        )
        s.write_back(0)
        return out

    def _broadcast(self, tensor, src, timeout):
        s = _Staged(tensor)
        self._call("Bcast", "broadcast", timeout, [_bytes(s.hosts[0]), _mpi().BYTE], root=src)
        s.write_back(0)
        return tensor

    def _barrier(self, timeout):
        self._call("Barrier", "barrier", timeout)

    def _send(self, tensor, dst, timeout):
        s = _Staged(tensor)
        self._call("Send", "send", timeout, [_bytes(s.hosts[0]), _mpi().BYTE], dest=dst, tag=7)

    def _recv(self, tensor, src, timeout):
        s = _Staged(tensor)
        self._call("Recv", "recv", timeout, [_bytes(s.hosts[0]), _mpi().BYTE], source=src, tag=7)
        s.write_back(0)
        return tensor

    def _new_group(self, members, color):
        MPI = _mpi()
        if not members:
            self.comm.Split(MPI.UNDEFINED, 0)
            return None
        sub = self.comm.Split(color, members.index(self.rank))
        return MPICommunicator(
            sub, timeout=self.timeout, validate=self.validate, tracer=self.tracer, blocking=self.blocking
        )

    def close(self) -> None:
        super().close()
        MPI = _mpi()
        if self._arrival_win is not None:  # collective over the group, like the window's creation
            self._arrival_counts = None
            self._arrival_win.Free()
            self._arrival_win = None
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
            self.comm.Free()
        self.comm = MPI.COMM_NULL


class _Watchdog:
    """One daemon thread per process that aborts the MPI job when a guarded blocking call overruns.

    Arming is two attribute writes (no lock, no wake-up): the thread looks at the deadline a few times a second,
    so an armed call costs nothing measurable and a timeout fires at most ``POLL_S`` late.
    """

    POLL_S = 0.2

    def __init__(self):
        self._deadline: float | None = None
        self._what: tuple = ()
        self._thread: threading.Thread | None = None
        self.report_path: str | None = None

    def arm(self, comm: MPICommunicator, op: str, timeout: float) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="moonep-mpi-watchdog", daemon=True)
            self._thread.start()
        self._what = (comm, op, timeout)
        self._deadline = time.monotonic() + timeout

    def disarm(self) -> None:
        self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(self.POLL_S)
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                comm, op, timeout = self._what
                op = comm._header_of or op  # a validated call times out in its header's exchange: name the call
                absent = agreement.absent_ranks(comm)
                who = (
                    f"rank(s) {absent} never reached it (stuck or busy before it, or dead)"
                    if absent
                    else "a peer is dead, stuck, or called a different collective"
                )
                message = (
                    f"moonep CollectiveError: {op} on rank {comm.global_rank} did not complete within its "
                    f"{timeout:g}s timeout ({who}); aborting the MPI job\n"
                )
                sys.stderr.write(message)
                sys.stderr.flush()
                if self.report_path:  # set by collectives.launch's MPI ranks: the launcher names us from it
                    with open(self.report_path, "w") as f:
                        f.write(message)
                _mpi().COMM_WORLD.Abort(3)


_WATCHDOG = _Watchdog()


def _arrival_array(comm: MPI.Comm) -> tuple[MPI.Win, np.ndarray] | tuple[None, None]:
    """(window, int64 [size] view) of the group's validated-call counts in node-shared memory; (None, None) when
    the group spans nodes (then nobody is named). Collective over ``comm``, like its creation."""
    MPI = _mpi()
    node = cast("MPI.Intracomm", comm.Split_type(MPI.COMM_TYPE_SHARED))  # an intracomm's split is one (mpi4py: Comm)
    try:
        if node.Get_size() != comm.Get_size():
            return None, None
        n = comm.Get_size()
        win = MPI.Win.Allocate_shared(8 * n if node.Get_rank() == 0 else 0, 8, comm=node)
        buf, _ = win.Shared_query(0)
        counts = np.ndarray(buffer=buf.cast("B"), dtype=np.int64, shape=(n,))  # a memoryview of the shared bytes
        if node.Get_rank() == 0:
            counts[:] = 0
        node.Barrier()
        return win, counts
    finally:
        node.Free()


def _displs(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def _mpi_op(op: str):
    MPI = _mpi()
    return {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[op]


def mpi_env_rank() -> tuple[int, int] | None:
    """(rank, world size) from an MPI launcher's environment (MPICH/Hydra, Open MPI, Slurm PMI), else None."""
    for rank_key, size_key in (
        ("PMI_RANK", "PMI_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMIX_RANK", "PMIX_SIZE"),
    ):
        if rank_key in os.environ and size_key in os.environ:
            return int(os.environ[rank_key]), int(os.environ[size_key])
    return None
