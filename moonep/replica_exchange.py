"""The replica weight exchanges of an EP step: weights pushed to the ranks that compute an expert's copy, their
gradients reduced home. ``Buffer.prefetch_weight(_start)`` and ``Buffer.reduce_grad`` call these after checking
the plan is theirs.

Axes: ``epn`` experts per rank = replica slots per rank; a projection's tensors are ``[epn, ...]``. Each exchange
is one all-to-all per dtype: the projections of one copy travel side by side in one row, so a replica costs two
collectives a step (the push forward, the reduce backward) however many projections an expert has. When a plan has
no replica at all, every rank read the same plan and all skip the exchange together.
"""

from __future__ import annotations

import math

import torch

from collectives import Pending
from collectives.base import Communicator
from moonep.comm_plan import CommPlan, DispatchLayout

StepPlan = CommPlan | DispatchLayout
"""a step's ``CommPlan``, or its ``DispatchLayout`` before the rows move: both carry the replica maps."""


def push_start(comm: Communicator, epn: int, plan: StepPlan, local_weights, prefetch_buffers) -> Pending:
    """Start sending this rank's replicated experts (``local_weights``: [epn, ...] or a sequence, one per
    projection) into the replica slots (``prefetch_buffers``, same structure) of the ranks that compute them;
    ``wait()`` lands them (unused slots untouched)."""
    if not plan.num_replicas:
        return Pending()
    locals_, slots_all = _one_per_projection(local_weights, prefetch_buffers)
    started = []
    for which, slots in _by_dtype(slots_all):
        dtype = slots[0].dtype
        rows = [locals_[i].detach().reshape(epn, -1).index_select(0, plan.push_rows).to(dtype) for i in which]
        inp = torch.cat(rows, 1)  # [copies pushed, sum of the projections' sizes]
        got = torch.empty(plan.my_slots.numel(), inp.shape[1], dtype=inp.dtype, device=inp.device)
        started.append(
            (comm.all_to_all_single_start(got, inp, plan.slot_splits, plan.push_splits, splits_agreed=True), got, slots)
        )

    def land() -> None:
        for pending, got, slots in started:
            pending.wait()
            if plan.my_slots.numel():
                for slot, part in zip(slots, _columns(got, slots)):
                    slot.view(slot.shape[0], -1).index_copy_(0, plan.my_slots, part)

    return Pending(land)


def reduce(comm: Communicator, epn: int, plan: StepPlan, local_grads, reduce_buffers) -> None:
    """Sum the occupied replica slots' grads (``reduce_buffers``: [epn, ...] or a sequence) into their home
    experts' grads (``local_grads``, same structure) and zero the consumed slots."""
    _one_per_projection(local_grads, reduce_buffers)  # names a count mismatch before anything moves
    reduce_start(comm, plan, reduce_buffers).finish(epn, local_grads)


class GradsInFlight:
    """The replica grads on their way home (``reduce_start``); ``finish`` adds them into the home grads."""

    def __init__(self, plan: StepPlan, started: list) -> None:
        self.plan, self._started = plan, started

    def finish(self, epn: int, local_grads) -> None:
        """Wait, then add the received grads into ``local_grads`` ([epn, ...] or a sequence, one per projection,
        in the order of the slots given to ``reduce_start``)."""
        grads = _as_list(local_grads)
        for pending, got, slots, which in self._started:
            pending.wait()
            if self.plan.push_rows.numel():
                for i, part in zip(which, _columns(got, slots)):
                    grads[i].view(epn, -1).index_add_(0, self.plan.push_rows, part.to(grads[i].dtype))


def reduce_start(comm: Communicator, plan: StepPlan, reduce_buffers) -> GradsInFlight:
    """Start sending the occupied replica slots' grads (``reduce_buffers``: [epn, ...] or a sequence) home (one
    asynchronous all-to-all per dtype) and zero the consumed slots; ``finish`` lands them."""
    if not plan.num_replicas:
        return GradsInFlight(plan, [])
    slots_all = _as_list(reduce_buffers)
    started = []
    for which, slots in _by_dtype(slots_all):
        flats = [slot.view(slot.shape[0], -1) for slot in slots]
        inp = torch.cat([flat.index_select(0, plan.my_slots) for flat in flats], 1)
        for flat in flats:
            flat.index_fill_(0, plan.my_slots, 0)
        got = torch.empty(plan.push_rows.numel(), inp.shape[1], dtype=inp.dtype, device=inp.device)
        pending = comm.all_to_all_single_start(got, inp, plan.push_splits, plan.slot_splits, splits_agreed=True)
        started.append((pending, got, slots, which))
    return GradsInFlight(plan, started)


def _as_list(x) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _one_per_projection(locals_, slots) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Both as lists, refused unless they have one tensor per projection each."""
    locals_, slots = _as_list(locals_), _as_list(slots)
    if len(locals_) != len(slots):
        raise ValueError(f"{len(locals_)} local tensors but {len(slots)} slot tensors: one per projection")
    return locals_, slots


def _by_dtype(slots: list[torch.Tensor]) -> list[tuple[list[int], list[torch.Tensor]]]:
    """(projection indices, slot tensors) grouped by the slots' dtype: each group travels as one exchange."""
    groups: dict = {}
    for i, slot in enumerate(slots):
        pair = groups.setdefault(slot.dtype, ([], []))
        pair[0].append(i)
        pair[1].append(slot)
    return list(groups.values())


def _columns(rows: torch.Tensor, slots: list[torch.Tensor]) -> list[torch.Tensor]:
    """rows [n, sum of per-expert sizes] split into one [n, size] column block per slot tensor."""
    return list(torch.split(rows, [math.prod(t.shape[1:]) for t in slots], 1))
