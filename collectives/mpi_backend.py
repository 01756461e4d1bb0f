"""``mpi`` backend: mpi4py, tensors exchanged as raw buffers (never pickled).

Launch with ``mpiexec -n N python -m mpi4py your_script.py`` (the ``-m mpi4py`` runner aborts the whole job when
one rank raises; without it the other ranks would wait for their timeout). Every call is nonblocking and polled
until done or until its timeout, which raises ``CollectiveError``. CPU tensors are passed to MPI in place; CUDA
tensors are staged through host memory (correct everywhere, fast nowhere: use the torch/NCCL backend on GPUs).
Reductions of bf16/fp16 run in fp32 (MPI has no half-precision types) and are rounded once.
"""
from __future__ import annotations

import time

import torch

from collectives.base import Communicator, CollectiveError, _row_numel


def _mpi():
    from mpi4py import MPI  # lazy: importing mpi4py initialises MPI, which only MPI runs want

    return MPI


def _bytes(t: torch.Tensor):
    """A writable uint8 numpy view of a contiguous CPU tensor's memory."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _typed(t: torch.Tensor):
    MPI = _mpi()
    kinds = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int32: MPI.INT32_T,
             torch.int64: MPI.INT64_T, torch.int16: MPI.INT16_T, torch.int8: MPI.INT8_T,
             torch.uint8: MPI.UINT8_T}
    return [t.reshape(-1).numpy(), kinds[t.dtype]]


class _Staged:
    """Host copies of (possibly CUDA or half-precision) tensors for one MPI call, written back on exit."""

    def __init__(self, *tensors: torch.Tensor, upcast: bool = False):
        self.originals = tensors
        self.hosts = []
        for t in tensors:
            h = t.cpu() if t.is_cuda else t
            if upcast and h.dtype in (torch.bfloat16, torch.float16):
                h = h.float()
            self.hosts.append(h)

    def write_back(self, *which: int) -> None:
        for i in which:
            if self.hosts[i] is not self.originals[i]:
                self.originals[i].copy_(self.hosts[i])


class MPICommunicator(Communicator):
    """A ``Communicator`` over an ``mpi4py`` communicator (``MPI.COMM_WORLD`` unless given)."""

    backend = "mpi"

    def __init__(self, comm=None, *, timeout: float = 60.0, validate: bool = True, tracer=None):
        MPI = _mpi()
        self.comm = MPI.COMM_WORLD if comm is None else comm
        world_group = MPI.COMM_WORLD.Get_group()
        group_ranks = MPI.Group.Translate_ranks(self.comm.Get_group(), list(range(self.comm.Get_size())),
                                                world_group)
        super().__init__(self.comm.Get_rank(), self.comm.Get_size(), group_ranks, timeout=timeout,
                         validate=validate, tracer=tracer, global_rank=MPI.COMM_WORLD.Get_rank())

    def _wait(self, request, op: str, timeout: float) -> None:
        # Spin on Test like MPICH's own blocking wait (progress happens inside MPI calls), with a deadline.
        deadline = time.monotonic() + timeout
        while not request.Test():
            if time.monotonic() > deadline:
                raise CollectiveError(f"{op} on rank {self.global_rank} did not complete within its {timeout:g}s "
                                      f"timeout (a peer is dead, stuck, or called a different collective)", op=op)

    def _all_to_all_single(self, out, inp, out_splits, in_splits, timeout):
        s = _Staged(out, inp)
        row = _row_numel(inp) * inp.element_size()
        send = [n * row for n in in_splits]
        recv = [n * row for n in out_splits]
        MPI = _mpi()
        req = self.comm.Ialltoallv([_bytes(s.hosts[1]), (send, _displs(send)), MPI.BYTE],
                                   [_bytes(s.hosts[0]), (recv, _displs(recv)), MPI.BYTE])
        self._wait(req, "all_to_all_single", timeout)
        s.write_back(0)
        return out

    def _all_gather(self, out, inp, timeout):
        s = _Staged(out, inp)
        MPI = _mpi()
        req = self.comm.Iallgather([_bytes(s.hosts[1]), MPI.BYTE], [_bytes(s.hosts[0]), MPI.BYTE])
        self._wait(req, "all_gather", timeout)
        s.write_back(0)
        return out

    def _all_reduce(self, tensor, op, timeout):
        if tensor.dtype == torch.bool:
            raise ValueError("all_reduce on bool tensors is not supported; reduce them as uint8")
        s = _Staged(tensor, upcast=True)
        req = self.comm.Iallreduce(_mpi().IN_PLACE, _typed(s.hosts[0]), _mpi_op(op))
        self._wait(req, "all_reduce", timeout)
        s.write_back(0)
        return tensor

    def _reduce_scatter(self, out, inp, op, timeout):
        s = _Staged(out, inp, upcast=True)
        req = self.comm.Ireduce_scatter_block(_typed(s.hosts[1]), _typed(s.hosts[0]), _mpi_op(op))
        self._wait(req, "reduce_scatter", timeout)
        s.write_back(0)
        return out

    def _broadcast(self, tensor, src, timeout):
        s = _Staged(tensor)
        req = self.comm.Ibcast([_bytes(s.hosts[0]), _mpi().BYTE], root=src)
        self._wait(req, "broadcast", timeout)
        s.write_back(0)
        return tensor

    def _barrier(self, timeout):
        self._wait(self.comm.Ibarrier(), "barrier", timeout)

    def _send(self, tensor, dst, timeout):
        s = _Staged(tensor)
        self._wait(self.comm.Isend([_bytes(s.hosts[0]), _mpi().BYTE], dest=dst, tag=7), "send", timeout)

    def _recv(self, tensor, src, timeout):
        s = _Staged(tensor)
        self._wait(self.comm.Irecv([_bytes(s.hosts[0]), _mpi().BYTE], source=src, tag=7), "recv", timeout)
        s.write_back(0)
        return tensor

    def _new_group(self, members, color):
        MPI = _mpi()
        if not members:
            self.comm.Split(MPI.UNDEFINED, 0)
            return None
        sub = self.comm.Split(color, members.index(self.rank))
        return MPICommunicator(sub, timeout=self.timeout, validate=self.validate, tracer=self.tracer)

    def close(self) -> None:
        super().close()
        MPI = _mpi()
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
            self.comm.Free()
        self.comm = MPI.COMM_NULL


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
    import os

    for rank_key, size_key in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMIX_RANK", "PMIX_SIZE")):
        if rank_key in os.environ and size_key in os.environ:
            return int(os.environ[rank_key]), int(os.environ[size_key])
    return None
