"""``nvshmem`` backend: one-sided puts with signals into symmetric GPU buffers (nvshmem4py).

What travels over NVSHMEM: ``all_to_all_single`` and ``all_gather`` (each rank puts its rows straight into the
peers' symmetric receive buffer at the right offset, with a put-with-signal per peer; receivers wait on their
signals on the stream) and ``barrier`` (``barrier_all`` on the stream). Reductions, ``broadcast`` and
``send``/``recv`` go through the bootstrap communicator (NCCL under torch), which is what NVSHMEM-based EP
libraries do too: their win is the irregular all-to-all, not reductions.

Bootstrap: a torch or MPI ``Communicator`` broadcasts NVSHMEM's unique id (``initializer_method="uid"``), so the
backend works under ``collectives.launch``, torchrun and mpiexec alike. ``import collectives.nvshmem_backend``
never fails; constructing ``NVSHMEMCommunicator`` without a GPU or without ``nvshmem4py`` raises a clear
``RuntimeError``. Symmetric buffers grow on demand (a collective allocation, to the largest size seen) and are
freed by ``close()``, which every rank must call: garbage collection is not collective.

Several PEs on one GPU need CUDA MPS, or NVSHMEM ends the process at the first ``signal_wait``: the constructor
first runs ``collectives.nvshmem_mps.require_mps_if_shared``, so such a job stops on every rank with one
``RuntimeError`` naming the fix (that module's names are importable from here too).
"""

from __future__ import annotations

import os
import time

import torch
from torch.utils.dlpack import from_dlpack

from collectives.base import CollectiveError, Communicator
from collectives.nvshmem_mps import (
    MPS_DEFAULT_PIPE_DIR,
    MpsState,
    mps_control,
    mps_control_path,
    mps_daemon,
    mps_state,
    require_mps_if_shared,
    shared_gpu_error,
)

__all__ = [
    "MPS_DEFAULT_PIPE_DIR",
    "MpsState",
    "NVSHMEMCommunicator",
    "mps_control",
    "mps_control_path",
    "mps_daemon",
    "mps_state",
    "nvshmem_available",
    "require_mps_if_shared",
    "shared_gpu_error",
]


def nvshmem_available() -> tuple[bool, str]:
    """(usable, reason): whether nvshmem4py imports and a CUDA device is visible."""
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible (torch.cuda.is_available() is False)"
    try:  # the import is the test: it must stay, unused (ruff's F401 fix once made it a `pass`)
        import nvshmem.core  # noqa: F401  # pyright: ignore[reportMissingImports]  # optional: nvshmem4py (gpu extra)
    except Exception as exc:  # ImportError, or a missing host library inside the wheel
        return False, f"nvshmem4py is not importable ({type(exc).__name__}: {exc}); pip install 'moonep[gpu]'"
    return True, ""


class NVSHMEMCommunicator(Communicator):
    """A ``Communicator`` whose all-to-all and all-gather are NVSHMEM puts between GPUs.

    Args:
        bootstrap: a torch or MPI communicator over the same ranks (carries the unique id, reductions,
            broadcast and point-to-point).
        device: CUDA device index for this rank (default: ``LOCAL_RANK``, else rank modulo visible GPUs;
            several ranks may share one GPU, NVSHMEM allows several PEs per GPU when CUDA MPS runs).
    """

    backend = "nvshmem"
    split_can_reorder = False  # sub-groups come from the bootstrap's split (torch orders by rank)

    def __init__(self, bootstrap: Communicator, device: int | None = None):
        ok, reason = nvshmem_available()
        if not ok:
            raise RuntimeError(f"NVSHMEM backend unavailable: {reason}")
        import nvshmem.core as nvshmem  # pyright: ignore[reportMissingImports]  # optional: nvshmem4py (the gpu extra)

        # optional: cuda-core (comes with nvshmem4py); Device is re-exported at run time, which pyright cannot see
        from cuda.core import Device  # pyright: ignore[reportAttributeAccessIssue]

        self.bootstrap = bootstrap
        self._nvshmem = nvshmem
        super().__init__(
            bootstrap.rank,
            bootstrap.world_size,
            bootstrap.group_ranks,
            timeout=bootstrap.timeout,
            validate=bootstrap.validate,
            tracer=bootstrap.tracer,
            global_rank=bootstrap.global_rank,
        )
        if device is None:
            device = int(os.environ.get("LOCAL_RANK", bootstrap.rank)) % torch.cuda.device_count()
        torch.cuda.set_device(device)
        self._device = torch.device("cuda", device)
        cuda_device = Device(device)
        cuda_device.set_current()
        require_mps_if_shared(bootstrap, device)  # before init: NVSHMEM's limited mode would end the process later
        uid = nvshmem.get_unique_id(empty=bootstrap.rank != 0)
        uid_bytes = uid._data.view("uint8")
        carrier = torch.from_numpy(uid_bytes.copy())
        bootstrap.broadcast(carrier, src=0)
        uid_bytes[:] = carrier.numpy()
        nvshmem.init(
            device=cuda_device, uid=uid, rank=bootstrap.rank, nranks=bootstrap.world_size, initializer_method="uid"
        )
        self._inbox: torch.Tensor | None = None  # symmetric uint8 receive buffer, grown on demand
        self._outbox: torch.Tensor | None = None  # symmetric uint8 send staging (IB puts need registered memory)
        self._signals = nvshmem.buffer(8 * self.world_size)  # one uint64 per sender, counts ops
        torch.cuda.current_stream().synchronize()
        self._signal_view = from_dlpack(self._signals).view(torch.int64)
        self._signal_view.zero_()
        self._seq = 0
        self._barrier(self.timeout)

    @property
    def device(self) -> torch.device:
        """This PE's GPU: NVSHMEM moves CUDA tensors (a property, as ``Communicator.device`` is one)."""
        return self._device

    # ---------------------------------------------------------------- helpers
    def _stream(self):
        return self._nvshmem.NvshmemStream(torch.cuda.current_stream(self.device))

    def _ensure_boxes(self, recv_bytes: int, send_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Grow the symmetric in/out buffers on every rank to the largest size any rank needs (collective).

        Returns:
            ``(inbox, outbox)``: the symmetric uint8 receive buffer and send staging, ``[nbytes]`` each.
        """
        need = torch.tensor([recv_bytes, send_bytes], dtype=torch.int64)
        self.bootstrap._all_reduce(need, "max", self.timeout)
        nbytes = max(int(need.max()), 1)
        if self._inbox is not None and self._outbox is not None and self._inbox.numel() >= nbytes:
            return self._inbox, self._outbox
        if self._inbox is not None:
            self._barrier(self.timeout)
            self._nvshmem.free_tensor(self._inbox)
            self._nvshmem.free_tensor(self._outbox)
        self._inbox = inbox = self._nvshmem.bytetensor((nbytes,), dtype=torch.uint8)
        self._outbox = outbox = self._nvshmem.bytetensor((nbytes,), dtype=torch.uint8)
        return inbox, outbox

    def _slice_buffer(self, tensor: torch.Tensor, offset: int, nbytes: int):
        # optional: cuda-core (comes with nvshmem4py); Buffer is re-exported at run time, which pyright cannot see
        from cuda.core import Buffer  # pyright: ignore[reportAttributeAccessIssue]

        return Buffer.from_handle(int(tensor.data_ptr()) + offset, nbytes)

    def _sync(self, op: str, timeout: float) -> None:
        """Wait for the stream's work, polling so that a peer that never signals becomes a timeout."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + timeout
        while not event.query():
            if time.monotonic() > deadline:
                raise CollectiveError(
                    f"{op} on rank {self.global_rank}: NVSHMEM signals did not arrive within "
                    f"{timeout:g}s (a peer is dead or stuck)",
                    op=op,
                )
            time.sleep(0)

    def _exchange(self, out, inp, out_splits, in_splits, op: str, timeout: float):
        """Put ``inp``'s row blocks into the peers' receive buffers, signal, wait for our own, copy out."""
        nv = self._nvshmem
        row = int(inp[0].numel() if inp.shape[0] else torch.Size(inp.shape[1:]).numel()) * inp.element_size()
        counts = torch.tensor(list(in_splits), dtype=torch.int64)
        matrix = torch.empty(self.world_size, self.world_size, dtype=torch.int64)
        self.bootstrap._all_gather(matrix, counts.view(1, -1), timeout)  # matrix[i, j]: rows rank i sends to rank j
        inbox, src = self._ensure_boxes(sum(out_splits) * row, sum(in_splits) * row)
        self._seq += 1
        stream = self._stream()
        nv.barrier_all(stream=stream)  # everyone finished reading the previous contents of its receive buffer
        src[: sum(in_splits) * row].copy_(inp.reshape(-1).view(torch.uint8))
        send_off = 0
        for peer in range(self.world_size):
            nbytes = int(matrix[self.rank, peer]) * row
            recv_off = int(matrix[: self.rank, peer].sum()) * row  # rows of lower ranks land first at the peer
            signal = self._slice_buffer(self._signal_view, 8 * self.rank, 8)
            if nbytes:
                nv.put_signal(
                    self._slice_buffer(inbox, recv_off, nbytes),
                    self._slice_buffer(src, send_off, nbytes),
                    signal,
                    self._seq,
                    nv.SignalOp.SIGNAL_SET,
                    remote_pe=peer,
                    stream=stream,
                )
            else:
                nv.signal_op(signal, self._seq, nv.SignalOp.SIGNAL_SET, remote_pe=peer, stream=stream)
            send_off += nbytes
        for peer in range(self.world_size):
            nv.signal_wait(
                self._slice_buffer(self._signal_view, 8 * peer, 8), self._seq, nv.ComparisonType.CMP_GE, stream=stream
            )
        total = sum(out_splits) * row
        out.view(-1).view(torch.uint8).copy_(inbox[:total])
        self._sync(op, timeout)
        return out

    # ---------------------------------------------------------------- primitives
    def _all_to_all_single(self, out, inp, out_splits, in_splits, timeout):
        return self._exchange(out, inp, out_splits, in_splits, "all_to_all_single", timeout)

    def _all_gather(self, out, inp, timeout):
        if not inp.is_cuda:  # validation headers and other host-side metadata
            return self.bootstrap._all_gather(out, inp, timeout)
        n = inp.shape[0]
        repeated = inp.repeat(self.world_size, *([1] * (inp.dim() - 1)))
        return self._exchange(out, repeated, [n] * self.world_size, [n] * self.world_size, "all_gather", timeout)

    def _all_reduce(self, tensor, op, timeout):
        return self.bootstrap._all_reduce(tensor, op, timeout)

    def _reduce_scatter(self, out, inp, op, timeout):
        return self.bootstrap._reduce_scatter(out, inp, op, timeout)

    def _broadcast(self, tensor, src, timeout):
        return self.bootstrap._broadcast(tensor, src, timeout)

    def _barrier(self, timeout):
        self._nvshmem.barrier_all(stream=self._stream())
        self._sync("barrier", timeout)

    def _send(self, tensor, dst, timeout):
        return self.bootstrap._send(tensor, dst, timeout)

    def _recv(self, tensor, src, timeout):
        return self.bootstrap._recv(tensor, src, timeout)

    def _new_group(self, members, color):
        # One NVSHMEM world per process: a sub-group keeps torch/MPI semantics through the bootstrap's split.
        return self.bootstrap._new_group(members, color)

    def close(self) -> None:
        if self._signals is None:
            return
        self._barrier(self.timeout)
        if self._inbox is not None:
            self._nvshmem.free_tensor(self._inbox)
            self._nvshmem.free_tensor(self._outbox)
            self._inbox = self._outbox = None
        self._nvshmem.free(self._signals)
        self._signals = None
        self._nvshmem.finalize()
        super().close()
