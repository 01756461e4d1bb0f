"""What every ``Communicator`` is under its public calls: its state (rank, group, timeout, tracer, injected link
delays, arrival counts) and the contract a backend implements (the underscored primitives, which receive checked
arguments, and the hooks with defaults it may override).

``collectives.base.Communicator`` adds the public calls on top. The helpers those calls lean on (the header
agreement of ``collectives.agreement``, the header rows of ``collectives.peer_checks``, the timing of
``collectives.timing``) take a ``CommunicatorCore``: all they touch is here, and they can import it without
importing the facade that imports them (no circle of imports).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import torch

from collectives.faults import link_delays_from_env
from collectives.trace import Tracer, tracer_from_env
from moonep_base import seconds_problem


class CommunicatorCore(abc.ABC):
    """The state of a group of ranks that exchange torch tensors, and the primitives its backend implements.

    Attributes:
        rank: this process's index in the group, ``0 <= rank < world_size``.
        world_size: number of ranks in the group.
        group_ranks: global (world) rank of each member, indexed by group rank.
        timeout: default seconds any call may take before it raises ``CollectiveError``.
        validate: exchange a small header before each collective so bad input fails on every rank.
        global_rank: this process's rank in the world (the trace's and error messages' rank).
        tracer: the per-rank op trace (``collectives.trace``), None when tracing is off.
        link_delays: ``{(src, dst) global ranks: seconds}`` of injected link delays; empty when none.
    """

    backend: str = "abstract"
    split_can_reorder: bool = True
    """Whether ``split``'s ``key`` may order a sub-group differently from parent rank order."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        group_ranks: Sequence[int],
        *,
        timeout: float = 60.0,
        validate: bool = True,
        tracer: Tracer | None = None,
        global_rank: int | None = None,
    ):
        if problem := seconds_problem(timeout):
            raise ValueError(f"timeout {problem}")
        self.rank = rank
        self.world_size = world_size
        self.group_ranks = tuple(int(r) for r in group_ranks)
        self.timeout = float(timeout)
        self.validate = validate
        self.global_rank = self.group_ranks[rank] if global_rank is None else global_rank
        self.tracer = tracer if tracer is not None else tracer_from_env(self.global_rank)
        if self.tracer is not None and self.tracer.world_size is None and self.group_ranks == tuple(range(world_size)):
            self.tracer.world_size = world_size  # the world communicator comes first; sub-groups never set it
        self.link_delays = link_delays_from_env()  # {(src, dst) global ranks: seconds}; empty = no injection
        self._validated = 0  # validated calls entered on this group (``_mark_arrival``)
        self._header_of = ""  # the op whose argument header is being exchanged (names it in a backend's timeout)

    # ---------------------------------------------------------------- backend primitives (checked input)
    @abc.abstractmethod
    def _all_to_all_single(self, out, inp, out_splits: list[int], in_splits: list[int], timeout: float): ...

    @abc.abstractmethod
    def _all_gather(self, out, inp, timeout: float): ...

    @abc.abstractmethod
    def _all_reduce(self, tensor, op: str, timeout: float): ...

    @abc.abstractmethod
    def _reduce_scatter(self, out, inp, op: str, timeout: float): ...

    @abc.abstractmethod
    def _broadcast(self, tensor, src: int, timeout: float): ...

    @abc.abstractmethod
    def _barrier(self, timeout: float): ...

    @abc.abstractmethod
    def _send(self, tensor, dst: int, timeout: float): ...

    @abc.abstractmethod
    def _recv(self, tensor, src: int, timeout: float): ...

    # ---------------------------------------------------------------- backend hooks with defaults
    def _start_all_to_all_single(
        self, out, inp, out_splits: list[int], in_splits: list[int], timeout: float
    ) -> Callable[[], None] | None:
        """Backend hook: start the exchange, return a callable that finishes it (None: already done)."""
        self._all_to_all_single(out, inp, out_splits, in_splits, timeout)
        return None

    def _header_device(self) -> torch.device:
        """Where the validation header lives (a backend whose group only moves CUDA tensors overrides this)."""
        return torch.device("cpu")

    def _sizes_agreed_on_host(self, t: torch.Tensor | None) -> bool:
        """Whether an unchecked all-to-all of ``t`` agrees its split sizes first: where the host waits for the
        exchange anyway (not CUDA), so that costs one small round trip and no device read."""
        device = t.device if isinstance(t, torch.Tensor) else self.device
        return self.world_size > 1 and device.type != "cuda"

    def report_failure(self, message: str) -> None:  # noqa: B027  # optional hook: a no-op is a correct default
        """Tell peers that this rank failed, so their timeouts can name it. Best effort; backends may ignore."""

    def _mark_arrival(self, count: int) -> None:  # noqa: B027  # optional hook: a no-op is a correct default
        """Record that this rank entered its ``count``-th validated call on this group (where peers can read it
        after a timeout). Best effort; backends without a shared store ignore it."""

    def _arrivals(self) -> dict[int, int] | None:
        """``{group rank: validated calls entered}`` as recorded by ``_mark_arrival``; None when unknown."""
        return None

    @property
    def device(self) -> torch.device:
        """Where this group's data lives by default (where an EP ``Buffer`` over it allocates): the CPU unless the
        backend moves CUDA tensors (NCCL in the group, NVSHMEM), then the current CUDA device."""
        return torch.device("cpu")

    def close(self) -> None:
        """Release backend resources of this communicator (collective over the group where the backend needs it)."""
        if self.tracer is not None:
            self.tracer.close()
