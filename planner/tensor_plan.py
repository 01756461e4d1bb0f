"""``TensorPlan``: a plan whose tables are tensors on the counts' device, made without a host copy.

``planner.plan(counts)`` returns one when ``counts`` is a torch tensor (``planner.Plan``, numpy, otherwise);
``planner.device`` computes it (CUDA: the numba-cuda kernels; CPU: the compiled CPU kernel; meta: shapes only,
for checking that code downstream has static shapes).

Every table's shape depends on (R, E, slots) alone, never on the counts: the flow table and the route pieces
are padded to static bounds and ``totals`` = (flows, pieces) says how many rows are real. By default an invalid
plan raises (which reads ``err``: a sync on a GPU); ``plan(..., defer_errors=True)`` keeps the error in ``err``
[3] (code, a, b) so that a caller can fold it into the one host read it makes anyway
(``planner.tables.raise_error(err.tolist(), slots)`` raises the same ValueError as the numpy path).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from planner._errors import OVERFLOW
from planner.tables import PlanShape, make_plan, raise_error

INT64_MAX = 2**63 - 1
"""the route pieces' padding rows (they sort after every real piece)."""


@dataclass(frozen=True, eq=False)
class TensorPlan(PlanShape):
    """The fields of ``planner.Plan`` as tensors on one device, with static shapes (see the module docstring)."""

    slots_per_expert: Any
    """[R, E] int32 the input counts."""
    caps: Any
    """[R] int64 rows each rank computes."""
    alloc: Any
    """[E, R] int32 routed slots of expert e computed on rank d."""
    donor: Any
    """[R] int64 the one home rank whose experts rank d computes as replicas; -1 = none."""
    experts_to_copy: Any
    """[R, slots] int64 expert id held in replica slot b of rank d; -1 = empty slot."""
    send_counts: Any
    """[R_src, R_dst] int64 rows rank r sends to rank d."""
    cu_seqlens: Any
    """[R, epn + slots] int64 cumulative padded segment ends (own experts in id order, then slots)."""
    flows: Any
    """[flow_rows, 4] int64 (expert, src, dst, rows) of every split expert, sorted; rows past totals[0] are 0."""
    pieces: Any
    """[E + flow_rows, 4] int64 (end, start, dest, first dest row) of the runs of the global slot sequence,
    sorted by start; rows past totals[1] hold INT64_MAX (``Plan._pieces`` explains the sequence)."""
    totals: Any
    """[2] int64 real rows of flows and of pieces."""
    err: Any
    """[3] int64 (code, a, b); code 0 = a valid plan (``planner.tables.raise_error`` names the others)."""
    token_padding: int
    """every non-empty segment is padded up to a multiple of this many rows."""

    @property
    def recv_counts(self):
        """[R] real rows rank d receives (= caps)."""
        return self.caps

    @property
    def device(self):
        """The device every table lives on."""
        return self.alloc.device

    def raise_if_invalid(self) -> None:
        """Raise the ValueError of an invalid plan (reads ``err``: one host read, a sync on a GPU)."""
        _raise(self.err.tolist(), self.slots_per_rank)

    def to_plan(self):
        """The same plan as a numpy ``planner.Plan`` (copies every table to the host; for tests and tools)."""
        self.raise_if_invalid()
        nf = int(self.totals[0])
        host = {
            f.name: getattr(self, f.name).cpu().numpy().copy()
            for f in fields(self)
            if f.name not in ("token_padding", "pieces", "totals", "err")
        }
        return make_plan(
            host["slots_per_expert"],
            host["caps"],
            host["alloc"],
            host["donor"],
            host["experts_to_copy"],
            host["send_counts"],
            host["cu_seqlens"],
            host["flows"][:nf],
            self.token_padding,
            self.experts_per_rank,
        )


def flow_rows(R: int, E: int, slots: int) -> int:
    """Static rows of the flow table (R ranks, E experts, slots per rank): >= any plain or sticky plan's flows.

    A split expert's north-west-corner matching emits at most (its non-zero sources) + (its destinations) - 1
    flows; at most min(E, R*slots) experts split (each one fills a replica slot) and all destinations together
    are the split experts' homes plus at most R*slots replicas.
    """
    return min(E, R * slots) * (R + 1) + R * slots


def _raise(err: list[int], slots: int) -> None:
    if err[0] == OVERFLOW:
        raise AssertionError(f"device planner: {err[1]} flows exceed the static table of {err[2]} rows")
    raise_error(np.asarray(err), slots)


def empty_tables(torch, device, R: int, E: int, slots: int, pad: int, fill: bool = False) -> TensorPlan:
    """A ``TensorPlan`` of empty tables of the right shapes and dtypes on ``device`` (``torch``: the module),
    filled with the device kernel's start values when ``fill``."""
    epn, F = E // R, flow_rows(R, E, slots)
    i64, i32 = torch.int64, torch.int32
    new = (
        (lambda shape, dt, v: torch.full(shape, v, dtype=dt, device=device))
        if fill
        else (lambda shape, dt, v: torch.empty(shape, dtype=dt, device=device))
    )
    return TensorPlan(
        slots_per_expert=new((R, E), i32, 0),
        caps=new((R,), i64, 0),
        alloc=new((E, R), i32, 0),
        donor=new((R,), i64, -1),
        experts_to_copy=new((R, slots), i64, -1),
        send_counts=new((R, R), i64, 0),
        cu_seqlens=new((R, epn + slots), i64, 0),
        flows=new((F, 4), i64, 0),
        pieces=new((E + F, 4), i64, INT64_MAX),
        totals=new((2,), i64, 0),
        err=new((3,), i64, 0),
        token_padding=pad,
    )
