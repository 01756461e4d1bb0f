"""``CommPlan``: one rank's view of one MoE layer's step — the planner's plan plus the row maps and split lists.

Built by ``Buffer.dispatch`` from the step's one host read (split lists, segment bounds: host ints) and the
device layout (``moonep.layout``: index tensors on the Buffer's device); reused unchanged by every other call
of the step, forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import planner


@dataclass(frozen=True)
class StepRead:
    """The host half of a dispatch: everything its one host read brings into Python (per rank ``r`` of ``R``)."""

    codes: tuple[int, ...]
    """[R] each rank's argument problem code (0 = fine; ``moonep._checks.Problem``)."""
    s: tuple[int, ...]
    """[R] tokens each rank dispatches."""
    totals: tuple[int, ...]
    """[R] total_num_tokens each rank passed (-1 = None)."""
    generations: tuple[int, ...]
    """[R] each rank's Buffer dispatch count (all equal, or an error)."""
    err: tuple[int, ...]
    """the planner's error triple (code, rank, expert; code 0 = a plan)."""
    send: tuple[tuple[int, ...], ...]
    """[R][R] routed slots rank q sends to rank r (the plan's send_counts)."""
    uniq: tuple[tuple[int, ...], ...]
    """[R][R] unique (token, destination) rows rank q sends to rank r."""
    mismatch: tuple[int, ...]
    """[R] 1 where a rank's layout disagreed with the plan's send_counts."""
    donor: tuple[int, ...]
    """[R] the rank that pushes each rank's replica weights (-1: none)."""
    replicas: tuple[int, ...]
    """[R] occupied replica slots per rank."""
    cu: tuple[int, ...]
    """[2*epn] this rank's padded segment ends."""

    @classmethod
    def from_flat(cls, flat: list[int], R: int, epn: int) -> StepRead:
        """Cut the one read's flat list (``Buffer._read_step`` concatenates the parts in field order)."""
        sizes = (4 * R, 3, R * R, R * (R + 1), R, R, 2 * epn)
        parts, cut = [], 0
        for n in sizes:
            parts.append(tuple(flat[cut : cut + n]))
            cut += n
        head, err, send, u, donor, replicas, cu = parts
        rows = [u[q * (R + 1) : (q + 1) * (R + 1)] for q in range(R)]
        return cls(
            codes=head[0::4],
            s=head[1::4],
            totals=head[2::4],
            generations=head[3::4],
            err=err,
            send=tuple(send[q * R : (q + 1) * R] for q in range(R)),
            uniq=tuple(row[:R] for row in rows),
            mismatch=tuple(row[R] for row in rows),
            donor=donor,
            replicas=replicas,
            cu=cu,
        )


@dataclass(frozen=True, eq=False)
class DispatchLayout:
    """A dispatch planned before any row moves (DeepEP's ``get_dispatch_layout``): made by
    ``Buffer.get_dispatch_layout`` (the count and unique-row all-gathers, the plan, the one host read), used by
    ``Buffer.dispatch(..., layout=)`` to move the rows. Carries the replica maps, so that the replica weight push
    can start before the rows move (``moonep.experts.start_push`` takes a layout)."""

    buffer_id: int
    """id() of the Buffer that planned it."""
    rank: int
    """the rank it belongs to."""
    generation: int
    """the Buffer's dispatch count when it was planned (dispatch refuses a layout that is not the latest)."""
    global_plan: planner.TensorPlan
    """the planner's plan (same on every rank)."""
    send: Any
    """this rank's ``moonep.layout.SendLayout`` (slots by destination, unique rows)."""
    step: StepRead
    """the one host read's values."""
    num_tokens: int
    """s: tokens this rank dispatches."""
    total_num_tokens: int
    """sum of s over ranks."""
    recv_uniq: torch.Tensor
    """[R] unique rows each rank sends here, on the device (``step.uniq`` holds the host copy)."""
    push_rows: torch.Tensor
    """[sum(push_splits)] local expert rows whose weights this rank sends to the ranks replicating them."""
    push_splits: list[int]
    """[R] expert weights this rank sends to each rank."""
    my_slots: torch.Tensor
    """[sum(slot_splits)] this rank's occupied replica slots, in slot order."""
    slot_splits: list[int]
    """[R] replica weights this rank receives from each rank."""
    num_replicas: int
    """replicas in the whole plan (0: every rank skips the weight exchanges)."""


@dataclass(frozen=True, eq=False)
class CommPlan:
    """Everything dispatch, combine, prefetch_weight and reduce_grad need for one layer and one step.

    Built by ``Buffer.dispatch`` (identical ``global_plan`` on every rank); reused, unchanged, by combine, the
    backward ``redispatch``, ``prefetch_weight`` and ``reduce_grad``. Index tensors live on the Buffer's device;
    the split lists and segments are host ints from the step's one read.
    """

    global_plan: planner.TensorPlan
    """the planner's plan (same on every rank): alloc [E, R], experts_to_copy [R, slots], send_counts [R, R], ..."""
    rank: int
    """the rank this CommPlan belongs to."""
    buffer_id: int
    """id() of the Buffer that made it (combine refuses a foreign plan)."""
    generation: int
    """the Buffer's dispatch count when its dispatch made this plan (combine/redispatch refuse an older plan)."""
    num_tokens: int
    """s: tokens this rank dispatched."""
    total_num_tokens: int
    """sum of s over ranks (sizes recv_rows)."""
    recv_rows: int
    """rows of the receive views [recv_rows, H] this step: this rank's padded rows (``cu_host[-1]``), or with
    the Buffer's ``static_rows`` the static NvS (``layout.num_recv_rows`` of total_num_tokens)."""
    cu_seqlens: torch.Tensor
    """[2*epn] int64 padded segment ends: own experts in id order, then replica slots."""
    cu_host: tuple[int, ...]
    """[2*epn] host copy of cu_seqlens, from the step's one read (per-group GEMM bounds without a sync)."""
    slot_pos: torch.Tensor
    """[n] flat index t*K + k of each routed slot, in send order (destination rank, then token-major)."""
    send_slot_splits: list[int]
    """[R] routed slots this rank sends to each rank (= plan.send_counts[rank])."""
    uniq_token: torch.Tensor
    """[U] token of each unique (token, destination) row, in send order."""
    send_uniq_splits: list[int]
    """[R] unique rows this rank sends to each rank."""
    recv_slot_row: torch.Tensor
    """[n_recv] row in the [recv_rows] view of each received slot, in receive order (source rank, then send order)."""
    recv_slot_uniq: torch.Tensor
    """[n_recv] index of each received slot's unique row among the received unique rows."""
    recv_slot_splits: list[int]
    """[R] routed slots received from each rank (= plan.send_counts[:, rank])."""
    row_source: torch.Tensor
    """[recv_rows] 1 + the received unique row of each receive row, 0 = an unfilled row (``row_sources``)."""
    recv_uniq_splits: list[int]
    """[R] unique rows received from each rank."""
    layout: DispatchLayout
    """the layout the dispatch moved the rows along (a push started from it counts as this plan's); it holds the
    replica maps, which the properties below read (prefetch_weight and reduce_grad take either)."""

    def __post_init__(self) -> None:
        if sum(self.send_slot_splits) != self.slot_pos.numel():
            raise ValueError("send_slot_splits must sum to the number of routed slots")
        if sum(self.recv_slot_splits) != self.recv_slot_row.numel():
            raise ValueError("recv_slot_splits must sum to the number of received slots")
        if self.cu_host[-1] > self.recv_rows:
            raise ValueError(f"padded layout {self.cu_host[-1]} rows exceeds recv_rows={self.recv_rows}")

    @property
    def push_rows(self) -> torch.Tensor:
        """[sum(push_splits)] local expert rows whose weights this rank sends to the ranks replicating them."""
        return self.layout.push_rows

    @property
    def push_splits(self) -> list[int]:
        """[R] expert weights this rank sends to each rank (prefetch_weight; reduce_grad receives as many)."""
        return self.layout.push_splits

    @property
    def my_slots(self) -> torch.Tensor:
        """[sum(slot_splits)] this rank's occupied replica slots, in slot order."""
        return self.layout.my_slots

    @property
    def slot_splits(self) -> list[int]:
        """[R] replica weights this rank receives from each rank (all from its donor)."""
        return self.layout.slot_splits

    @property
    def num_replicas(self) -> int:
        """replicas in the whole plan, from the step's read (0: every rank skips the weight exchanges)."""
        return self.layout.num_replicas

    @property
    def segments(self) -> tuple[tuple[int, int, int], ...]:
        """(group, start, end) of the non-empty segments of this rank's layout."""
        return segments_of(list(self.cu_host))

    @property
    def experts_per_rank(self) -> int:
        """epn."""
        return self.global_plan.experts_per_rank

    @property
    def real_rows(self) -> int:
        """routed rows this rank computes (= plan.caps[rank]; a host read)."""
        return int(self.global_plan.caps[self.rank])


def segments_of(cu: list[int]) -> tuple[tuple[int, int, int], ...]:
    """(group, start, end) of the non-empty segments of host cu_seqlens [G]."""
    starts = [0] + cu[:-1]
    return tuple((g, a, b) for g, (a, b) in enumerate(zip(starts, cu)) if b > a)
