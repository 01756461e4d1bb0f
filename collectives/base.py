"""The ``Communicator``: one face over torch.distributed, mpi4py and NVSHMEM (the facade: the public calls over
the state and backend contract of ``collectives.core``).

Every public call takes and returns torch tensors, checks its arguments before any data moves (the header
agreement of ``collectives.agreement``: with ``validate=True``, the default, a bad argument on one rank is the same
``ValueError`` on *every* rank, naming the rank and the problem), records itself in the per-rank trace when tracing
is on, and gives up after ``timeout`` seconds with a ``CollectiveError`` instead of hanging (``collectives.timing``).
Backends implement the underscored primitives only (``_all_to_all_single``, ``_all_gather``, ...), which receive
arguments that were already checked. ``send``/``recv`` are unchecked unless both sides pass ``validate=True``.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Sequence

import torch

from collectives import agreement
from collectives.agreement import op_problem, pair_problem, shape_problem, tensor_problem
from collectives.core import CommunicatorCore
from collectives.errors import CollectiveError
from collectives.peer_checks import REDUCE_OPS
from collectives.peer_checks import rows as _rows
from collectives.timing import as_timedelta, call_timeout, link_delay, timed, traced_finish

__all__ = ["REDUCE_OPS", "CollectiveError", "Communicator", "Pending", "as_timedelta"]


class Pending:
    """A started collective (``Communicator.all_to_all_single_start``): ``wait()`` finishes it; later calls do
    nothing. Until then its output is undefined and its input must stay untouched."""

    def __init__(self, finish: Callable[[], None] | None = None) -> None:
        self._finish = finish

    def wait(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


class Communicator(CommunicatorCore):
    """A group of ranks that exchange torch tensors: the public calls over a backend's primitives.

    Attributes (set by ``CommunicatorCore``, which lists them all):
        rank: this process's index in the group, ``0 <= rank < world_size``.
        world_size: number of ranks in the group.
        group_ranks: global (world) rank of each member, indexed by group rank.
        timeout: default seconds any call may take before it raises ``CollectiveError``.
        validate: exchange a small header before each collective so bad input fails on every rank.

    Every collective also takes keyword-only ``timeout`` (seconds this call may take) and ``validate`` (whether it
    exchanges the argument header); None, their default, means the communicator's.
    """

    @abc.abstractmethod
    def _new_group(self, members: list[int], color: int) -> Communicator | None:
        """Sub-communicator over ``members`` (group ranks of self, in new-rank order).

        Called on every rank of ``self``; ranks that are not members get ``members == []`` and return ``None``.
        """

    # ---------------------------------------------------------------- public API
    def all_to_all_single(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: Sequence[int] | None = None,
        in_splits: Sequence[int] | None = None,
        *,
        timeout: float | None = None,
        validate: bool | None = None,
        splits_agreed: bool = False,
    ) -> torch.Tensor:
        """Exchange rows among ranks; unchecked on CUDA over NCCL/NVSHMEM, a peer's different splits go UNDETECTED.

        ``inp[rows for peer j]`` goes to peer j, peer i's rows land in ``out`` in rank order. ``in_splits[j]`` on
        rank i must equal ``out_splits[i]`` on rank j. Unchecked (``validate=False``), the sizes are still agreed
        wherever the host waits for the exchange anyway (CPU tensors, every tensor under MPI): a peer's different
        split sizes, dtype or row size is the same ``ValueError`` on every rank (``collectives.agreement``). On CUDA
        over NCCL or NVSHMEM nothing is checked then: a mismatch gives garbage or a hang until the timeout.

        Args:
            out: receive buffer ``[sum(out_splits), ...]``, any supported dtype (``peer_checks.DTYPES``), contiguous.
            inp: send buffer ``[sum(in_splits), ...]``, the same dtype, device and row shape as ``out``.
            out_splits: rows received from each rank, ``world_size`` ints (None: equal parts of ``out``).
            in_splits: rows sent to each rank, ``world_size`` ints (None: equal parts of ``inp``).
            splits_agreed: with ``validate=False``, the split sizes come from data every rank already agreed on (a
                shared plan, counts this exchange's peers sent), so they cannot disagree: the host round trip is
                skipped too (the EP layer's exchanges; on gloo it costs about 0.35 ms a call).

        Returns:
            ``out``.
        """
        problem, ins, outs = agreement.a2a_problem(self.world_size, out, inp, out_splits, in_splits)
        agreement.agree(
            self, "all_to_all_single", problem, out, inp, splits=(ins, outs), validate=validate, timeout=timeout,
            agreed=splits_agreed,
        )  # fmt: skip
        delay = link_delay(self, (j for j, n in enumerate(ins) if n))
        nbytes, fn = inp.numel() * inp.element_size(), self._all_to_all_single
        return timed(self, "all_to_all_single", nbytes, fn, out, inp, outs, ins, timeout, delay=delay)

    def all_to_all_single_start(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        *,
        timeout: float | None = None,
        splits_agreed: bool = False,
    ) -> Pending:
        """Start ``all_to_all_single`` and return; on CUDA via NCCL/NVSHMEM a peer's different splits go UNDETECTED.

        The hot-path form, checked like an unchecked ``all_to_all_single`` (sizes agreed before anything is posted,
        except on CUDA over NCCL or NVSHMEM). The caller can start another exchange or compute before ``wait()``.
        Every rank must start the same collectives in the same order. Backends without asynchronous collectives
        run it here and return a finished ``Pending``; torch.distributed (gloo, NCCL) and MPI overlap it.

        Args:
            out: receive buffer ``[sum(out_splits), ...]``; undefined until ``wait()``.
            inp: send buffer ``[sum(in_splits), ...]``, same dtype, device and row shape; untouched until ``wait()``.
            out_splits: rows received from each rank (``world_size`` ints).
            in_splits: rows sent to each rank (``world_size`` ints).
            timeout: bounds the size agreement and the wait (None: the communicator's).
            splits_agreed: as in ``all_to_all_single``.

        Returns:
            A ``Pending`` whose ``wait()`` finishes the exchange.
        """
        problem, ins, outs = agreement.a2a_problem(self.world_size, out, inp, out_splits, in_splits)
        agreement.agree(
            self, "all_to_all_single", problem, out, inp, splits=(ins, outs), validate=False, timeout=timeout,
            agreed=splits_agreed,
        )  # fmt: skip
        timeout = call_timeout(self, timeout)
        nbytes, t_enter = inp.numel() * inp.element_size(), time.time()
        delay = link_delay(self, (j for j, n in enumerate(ins) if n))
        finish = self._start_all_to_all_single(out, inp, outs, ins, timeout)
        return Pending(traced_finish(self, "all_to_all_single", nbytes, t_enter, finish, delay))

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, *, timeout: float | None = None, validate: bool | None = None
    ) -> torch.Tensor:
        """Concatenate every rank's ``inp`` into ``out`` in rank order.

        Args:
            out: ``[world_size * n, ...]``, the same dtype, device and row shape as ``inp``.
            inp: ``[n, ...]``, any supported dtype, contiguous; ``n`` the same on every rank.

        Returns:
            ``out``.
        """
        problem = pair_problem(out, inp) or shape_problem(
            out, (_rows(inp) * self.world_size, *inp.shape[1:]), "out", "world_size * inp rows"
        )
        agreement.agree(self, "all_gather", problem, out, inp, validate=validate, timeout=timeout)
        return timed(self, "all_gather", out.numel() * out.element_size(), self._all_gather, out, inp, timeout)

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", *, timeout: float | None = None, validate: bool | None = None
    ) -> torch.Tensor:
        """Reduce ``tensor`` over all ranks in place.

        Args:
            tensor: ``[...]``, the same shape and dtype on every rank (not bool; bf16/fp16 reduce in fp32 on CPU).
            op: ``sum``, ``max``, ``min`` or ``prod``.

        Returns:
            ``tensor``, now holding the reduction.
        """
        problem = tensor_problem(tensor, "tensor") or op_problem(op)
        agreement.agree(self, "all_reduce", problem, tensor, tensor, reduce_op=op, validate=validate, timeout=timeout)
        nbytes = tensor.numel() * tensor.element_size()
        return timed(self, "all_reduce", nbytes, self._all_reduce, tensor, op, timeout)

    def reduce_scatter(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        op: str = "sum",
        *,
        timeout: float | None = None,
        validate: bool | None = None,
    ) -> torch.Tensor:
        """Reduce ``inp`` over ranks; rank r keeps rows ``[r*n, (r+1)*n)`` of the result in ``out``.

        Args:
            out: ``[n, ...]``, the same dtype, device and row shape as ``inp``.
            inp: ``[world_size * n, ...]``, any supported dtype but bool, contiguous.
            op: ``sum``, ``max``, ``min`` or ``prod``.

        Returns:
            ``out``.
        """
        problem = (
            pair_problem(out, inp)
            or op_problem(op)
            or shape_problem(inp, (_rows(out) * self.world_size, *out.shape[1:]), "inp", "world_size * out rows")
        )
        agreement.agree(self, "reduce_scatter", problem, out, inp, reduce_op=op, validate=validate, timeout=timeout)
        nbytes = inp.numel() * inp.element_size()
        return timed(self, "reduce_scatter", nbytes, self._reduce_scatter, out, inp, op, timeout)

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, *, timeout: float | None = None, validate: bool | None = None
    ) -> torch.Tensor:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor`` (in place).

        Args:
            tensor: ``[...]``, the same shape and dtype on every rank, any supported dtype, contiguous.
            src: the group rank whose tensor is copied.

        Returns:
            ``tensor``.
        """
        problem = tensor_problem(tensor, "tensor")
        if not 0 <= src < self.world_size:
            problem = problem or f"src={src} is not a rank of this group (world_size={self.world_size})"
        agreement.agree(self, "broadcast", problem, tensor, tensor, src=src, validate=validate, timeout=timeout)
        nbytes = tensor.numel() * tensor.element_size()
        return timed(self, "broadcast", nbytes, self._broadcast, tensor, src, timeout)

    def barrier(self, *, timeout: float | None = None, validate: bool | None = None) -> None:
        """Wait until every rank of the group has arrived. Validated like every collective: a rank that calls
        another collective meanwhile is named on every rank, and so is a rank that never arrives."""
        agreement.agree(self, "barrier", None, None, None, validate=validate, timeout=timeout)
        timed(self, "barrier", 0, self._barrier, timeout)

    def send(self, tensor: torch.Tensor, dst: int, *, timeout: float | None = None, validate: bool = False) -> None:
        """Send ``tensor`` to group rank ``dst``; UNCHECKED unless both sides pass ``validate=True``.

        Unchecked, a ``recv`` whose size or dtype differs is not detected: a shorter send leaves the tail of the
        receive buffer as it was, another dtype is read as raw bits, and gloo aborts a receiver sent more bytes than
        it expects. ``validate=True`` first swaps a small header (dtype, shape) with the peer, so a difference is the
        same ``ValueError`` on both ranks before any data moves. ``validate`` must be the same on both sides: an
        unchecked peer would take the header for data.

        Args:
            tensor: ``[...]``, any supported dtype, contiguous; the receiver's has the same shape and dtype.
            dst: the receiving group rank (not this rank).
            timeout: seconds this call may take (None: the communicator's).
            validate: swap headers with the peer first (both sides must agree on it).
        """
        agreement.p2p_check(self, tensor, dst, "dst", validate, timeout)
        delay = link_delay(self, [dst])
        nbytes = tensor.numel() * tensor.element_size()
        timed(self, "send", nbytes, self._send, tensor, dst, timeout, delay=delay, peer=dst)

    def recv(
        self, tensor: torch.Tensor, src: int, *, timeout: float | None = None, validate: bool = False
    ) -> torch.Tensor:
        """Receive into ``tensor`` from group rank ``src`` and return it; UNCHECKED unless both pass ``validate=True``.

        The pair of ``send``: see there what goes undetected without ``validate=True``.

        Args:
            tensor: ``[...]`` receive buffer, the sender's shape and dtype, contiguous.
            src: the sending group rank (not this rank).
            timeout: seconds this call may take (None: the communicator's).
            validate: swap headers with the peer first (both sides must agree on it).

        Returns:
            ``tensor``.
        """
        agreement.p2p_check(self, tensor, src, "src", validate, timeout)
        nbytes = tensor.numel() * tensor.element_size()
        timed(self, "recv", nbytes, self._recv, tensor, src, timeout, peer=src)
        return tensor

    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """Sub-groups by ``color`` (like ``MPI_Comm_split``): ranks with equal color form a group ordered by
        ``(key, rank)``. Collective over this group (its headers are always exchanged).

        Args:
            color: the sub-group to join (>= 0), or None to join none.
            key: order within the sub-group (None: this rank).

        Returns:
            This rank's sub-group, or None for ``color=None``.
        """
        members, code = agreement.split_members(self, color, self.rank if key is None else int(key))
        return self._new_group(members, code)

    def inject_link_delay(self, src: int, dst: int, ms: float) -> None:
        """Fault injection: data this rank sends from global rank ``src`` to ``dst`` arrives ``ms`` later."""
        if ms < 0 or src == dst:
            raise ValueError(f"inject_link_delay needs two different ranks and ms >= 0, got {src}->{dst} {ms} ms")
        self.link_delays[(int(src), int(dst))] = ms / 1000.0

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
            f"group_ranks={list(self.group_ranks)})"
        )
