"""``BufferCore``: a ``moonep.Buffer``'s state and the calls that are not dispatch or combine.

Its jobs: construction (the settings agreed across ranks before any rank raises alone), the capacity-sized
allocation of the receive and wire buffers, the checks that a plan-taking call's arguments are this Buffer's
(agreed on one small all-reduce), and the replica exchanges along a step's plan (``prefetch_weight``,
``reduce_grad``). ``moonep.buffer_rows`` adds the row movement along a saved plan (``redispatch``, ``combine``)
and ``moonep.buffer`` the planned ``dispatch``; ``moonep.buffer.Buffer`` is the public class.

Shapes as in ``moonep.buffer``: S token capacity per rank, H hidden, K top-k, E experts, R ranks,
epn = E / R experts per rank (= replica slots per rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import planner
from collectives import Pending
from collectives.base import Communicator
from moonep import _checks, replica_exchange
from moonep.agreement import agree_settings
from moonep.comm_plan import CommPlan, DispatchLayout
from moonep.geometry import EPGeometry
from moonep.layout import num_recv_rows
from moonep.replica_exchange import StepPlan

INT32_MAX = 2**31 - 1
SAME_BUFFER = "every rank of the EP group must pass the same sizes, dtype, token_padding and balancing"

Tensors = torch.Tensor | Sequence[torch.Tensor]
"""one [epn, ...] tensor, or a sequence of them (one per projection)."""


def resolve_device(comm: Communicator, device: Any) -> torch.device:
    """The Buffer's device: ``device`` ("cuda" = the current CUDA device), else the communicator's, else CPU."""
    if device is None:
        device = getattr(comm, "device", None) or "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class BufferCore:
    """A Buffer's sizes, settings and buffers (arguments: ``moonep.buffer.Buffer``, the public class)."""

    def __init__(
        self,
        comm: Communicator,
        *,
        S: int,
        H: int,
        K: int,
        E: int,
        token_padding: int = 1,
        dtype: torch.dtype = torch.float32,
        device: Any = None,
        check_reuse: bool = True,
        slack: float | None = None,
        cost: planner.CostModel | None = None,
        grow: bool = False,
        static_rows: bool = False,
    ) -> None:
        # compared across ranks BEFORE any rank raises on its own: a bad value on one rank is the same error on all
        words, problem = _checks.buffer_settings(comm, S, H, K, E, token_padding, dtype, slack, cost, grow)
        agree_settings(comm, "Buffer", words, problem, hint=SAME_BUFFER)
        self.geometry = EPGeometry(S=S, H=H, K=K, E=E, token_padding=token_padding)
        self.comm: Communicator = comm
        self.S, self.H, self.K, self.E, self.R = S, H, K, E, comm.world_size
        self.rank, self.epn, self.token_padding, self.dtype = comm.rank, E // self.R, token_padding, dtype
        self.device = resolve_device(comm, device)
        self.check_reuse = check_reuse
        self.slack, self.cost, self.max_slack = _checks.balance_options(slack, cost)
        self.grow = bool(grow)
        self.static_rows = bool(static_rows)
        self.generation = 0
        """dispatches made so far (agreed across ranks by each dispatch); a plan is valid until the next one."""
        self._allocate(S)

    def _allocate(self, S: int) -> None:
        """(Re)allocate every buffer for capacity S: their sizes never depend on the routing."""
        R, K, H, dtype, dev = self.R, self.K, self.H, self.dtype, self.device
        self.S, self.geometry = S, EPGeometry(S=S, H=H, K=K, E=self.E, token_padding=self.token_padding)
        self.max_recv_rows = num_recv_rows(R * S, K, R, self.epn, self.token_padding, self.max_slack)
        max_slots = planner.row_bound(R * S * K, R, self.max_slack)  # routed slots one rank may receive
        if max(self.max_recv_rows, S * K) > INT32_MAX:
            raise ValueError(f"receive rows {self.max_recv_rows} or slots S*K={S * K} exceed the int32 side table")
        # receive rows (expert-grouped) and their weights: the zero_copy views of dispatch
        self._recv = torch.zeros(self.max_recv_rows, H, dtype=dtype, device=dev)
        self._recv_w = torch.zeros(self.max_recv_rows, dtype=torch.float32, device=dev)
        # the two wire buffers: one row per (token, destination) out, and in behind the zero row (row_sources)
        self._wire_out = torch.empty(S * min(K, R), H, dtype=dtype, device=dev)
        self._wire_in = torch.zeros(1 + max_slots, H, dtype=dtype, device=dev)
        # the per-slot side table (int32: row, unique index, routing weight bits), out and in
        self._meta_out = torch.empty(S * K, 3, dtype=torch.int32, device=dev)
        self._meta_in = torch.empty(max_slots, 3, dtype=torch.int32, device=dev)

    @property
    def nbytes(self) -> int:
        """Bytes held by this Buffer (static)."""
        ts = (self._recv, self._recv_w, self._wire_out, self._wire_in, self._meta_out, self._meta_in)
        return sum(t.numel() * t.element_size() for t in ts)

    # ---------------------------------------------------------------------------- agreement and ownership
    def _check_owner(self, op: str, plan: object) -> None:
        """A plan-taking call refuses a plan (or layout) that this Buffer did not make on this rank (a plan is one
        rank's view of one Buffer's step; another's splits would exchange the wrong rows)."""
        ours = isinstance(plan, (CommPlan, DispatchLayout))
        if not ours or plan.buffer_id != id(self) or plan.rank != self.rank:
            where = "another Buffer or rank" if ours else type(plan).__name__
            raise ValueError(
                f"moonep.{op}: rank {self.rank}: plan must be the CommPlan this Buffer's dispatch returned on this "
                f"rank, got one from {where}"
            )

    def _agree(self, op: str, code: int, detail: str) -> None:
        """One small all-reduce of the error code so that every rank raises together (or none does)."""
        flags = torch.zeros(self.R, dtype=torch.int64, device=self.device)
        flags[self.rank] = code
        self.comm.all_reduce(flags, "sum", validate=False)
        _checks.raise_agreed(op, self.rank, flags.tolist(), detail)

    # ------------------------------------------------------------------------------ weights and grads
    def prefetch_weight(self, plan: StepPlan, local_weights: Tensors, prefetch_buffers: Tensors) -> None:
        """Copy the replicated experts' weights into the replica slots of the ranks that compute them.

        local_weights: [epn, ...] tensor (or a sequence of them, one per projection) = this rank's experts.
        prefetch_buffers: [epn, ...] replica slots (same structure); slot b of rank d receives expert
        ``plan.global_plan.experts_to_copy[d, b]`` (unused slots are left untouched). Collective: every rank calls it.
        """
        self.prefetch_weight_start(plan, local_weights, prefetch_buffers).wait()

    def prefetch_weight_start(self, plan: StepPlan, local_weights: Tensors, prefetch_buffers: Tensors) -> Pending:
        """``prefetch_weight`` started (one asynchronous all-to-all for all projections of one dtype: a copy's
        rows side by side); ``wait()`` lands the slots. Until then the slots are undefined and the local weights
        must not change."""
        self._check_owner("prefetch_weight", plan)
        return replica_exchange.push_start(self.comm, self.epn, plan, local_weights, prefetch_buffers)

    def reduce_grad(self, plan: StepPlan, local_grads: Tensors, reduce_buffers: Tensors) -> None:
        """Sum the replica slots' weight-gradients into their home experts' grads; zero the consumed slots.

        local_grads: [epn, ...] (or a sequence); reduce_buffers: [epn, ...] slot grads (same structure).
        Collective: every rank calls it, after every rank wrote its slot grads. One all-to-all for all
        projections of one dtype.
        """
        self._check_owner("reduce_grad", plan)
        replica_exchange.reduce(self.comm, self.epn, plan, local_grads, reduce_buffers)

    def reduce_grad_start(self, plan: StepPlan, reduce_buffers: Tensors) -> replica_exchange.GradsInFlight:
        """``reduce_grad`` started before the home grads exist (the EP step's backward computes its own experts
        meanwhile): sends the slots' grads and zeros them; ``.finish(epn, local_grads)`` adds them home."""
        self._check_owner("reduce_grad", plan)
        return replica_exchange.reduce_start(self.comm, plan, reduce_buffers)


__all__ = ["INT32_MAX", "SAME_BUFFER", "BufferCore", "Tensors", "resolve_device"]
