"""``Plan``: the tables of one layer's plan (numpy, frozen), and how the kernel's arrays and errors become one.

Axes: ``R`` ranks, ``E`` experts, ``epn = E / R`` experts owned per rank (rank r owns experts
``[r*epn, (r+1)*epn)``), ``K`` top-k, ``s`` tokens on one rank. ``planner.plan`` makes plans;
``planner.device.TensorPlan`` holds the same tables as tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from planner import _errors
from planner._inputs import expert_total_message, to_numpy


class PlanShape:
    """Sizes read off a plan's tables (numpy or tensor): ``alloc [E, R]`` and ``experts_to_copy [R, slots]``."""

    alloc: Any
    experts_to_copy: Any

    @property
    def num_ranks(self) -> int:
        """R."""
        return int(self.alloc.shape[1])

    @property
    def num_experts(self) -> int:
        """E."""
        return int(self.alloc.shape[0])

    @property
    def experts_per_rank(self) -> int:
        """epn = E / R."""
        return self.num_experts // self.num_ranks

    @property
    def slots_per_rank(self) -> int:
        """replica slots per rank."""
        return int(self.experts_to_copy.shape[1])

    @property
    def num_replicas(self) -> int:
        """Expert copies this plan needs (occupied replica slots over all ranks; a host read on a device)."""
        return int((self.experts_to_copy >= 0).sum())


@dataclass(frozen=True, eq=False)
class Plan(PlanShape):
    """Where every routed (token, expert) slot is computed, for one MoE layer and one step.

    Arrays are read-only; ``slots_per_expert`` and ``alloc`` are int32 (their entries are bounded by one
    rank's rows, < 2**31; halving the two [R, E]-sized tables halves the planner's memory traffic), the rest
    int64. A plan is a pure function of its inputs: same counts, caps and options give the same plan.
    """

    slots_per_expert: np.ndarray
    """[R, E] the input counts: row r = rank r's routed slots per expert."""
    caps: np.ndarray
    """[R] rows each rank must compute (sums to the total routed slots)."""
    alloc: np.ndarray
    """[E, R] routed slots of expert e computed on rank d; row sums = per-expert load, column sums = caps."""
    donor: np.ndarray
    """[R] the one home rank whose experts rank d computes as replicas; -1 = none."""
    experts_to_copy: np.ndarray
    """[R, slots] expert id held in replica slot b of rank d; -1 = empty slot."""
    recv_counts: np.ndarray
    """[R] real rows rank d receives (= caps[d])."""
    send_counts: np.ndarray
    """[R_src, R_dst] rows rank r sends to rank d (a rank's rows to itself included)."""
    cu_seqlens: np.ndarray
    """[R, epn + slots] cumulative padded segment ends; segments = own experts in id order, then slots."""
    flows: np.ndarray
    """[F, 4] rows (expert, src, dst, count) of every split expert, sorted; unsplit experts stay home."""
    token_padding: int
    """every non-empty segment is padded up to a multiple of this many rows."""
    recv_rows: int
    """static rows per rank that hold any plan of this geometry: align_up(max caps + (pad-1)*(epn+slots), pad)."""

    @property
    def migrated(self) -> int:
        """Routed slots computed away from their expert's home rank."""
        home = np.arange(self.num_experts) // self.experts_per_rank
        return int(self.alloc.sum() - self.alloc[np.arange(self.num_experts), home].sum())

    @cached_property
    def _pieces(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Sorted contiguous pieces of the global slot sequence: (end, start, dest, first dest row).

        The sequence concatenates experts; expert e's slots are ordered by source rank, then by appearance in
        the source's top-k. An unsplit expert is one piece; a split expert has one piece per flow.
        """
        T, E, R, epn = self.slots_per_expert, self.num_experts, self.num_ranks, self.experts_per_rank
        cnt = self.alloc.sum(1)
        base = np.concatenate(([0], np.cumsum(cnt)))[:-1]
        seg_start = np.concatenate((np.zeros((R, 1), np.int64), self.cu_seqlens[:, :-1]), axis=1)
        e, r, d, c = self.flows.T
        split, col = np.unique(e, return_inverse=True)
        cols = T[:, split]
        src_before = (np.cumsum(cols, axis=0) - cols)[r, col]  # slots of e on ranks below r
        block = e * R + r
        first = np.searchsorted(block, block)  # flows are sorted by (e, r, d): first flow of each (e, r)
        within = np.cumsum(c) - c
        start = base[e] + src_before + within - within[first]
        by_dest = np.lexsort((r, d, e))  # row inside the destination segment: earlier sources first
        cd = c[by_dest]
        key = (e * R + d)[by_dest]
        before = np.cumsum(cd) - cd
        row_in = np.empty_like(c)
        row_in[by_dest] = before - before[np.searchsorted(key, key)]
        own = e // epn == d
        slot = np.argmax(self.experts_to_copy[d] == e[:, None], axis=1) if self.slots_per_rank else 0
        row0 = seg_start[d, np.where(own, e - d * epn, epn + slot)] + row_in
        whole = np.ones(E, bool)
        whole[e] = False  # experts without flows are one piece at home
        we = np.nonzero(whole)[0]
        starts = np.concatenate((base[we], start))
        order = np.argsort(starts, kind="stable")
        ends = np.concatenate((base[we] + cnt[we], start + c))[order]
        dests = np.concatenate((we // epn, d))[order]
        rows0 = np.concatenate((seg_start[we // epn, we % epn], row0))[order]
        return ends, starts[order], dests, rows0

    def route(self, rank: int, topk_idx: Any) -> tuple[np.ndarray, np.ndarray]:
        """Destination of every routed slot of source ``rank``.

        topk_idx: [s, K] expert ids of the rank's tokens (token-major; duplicates allowed); its histogram must
        equal ``slots_per_expert[rank]``. Returns (dest_rank [s, K], dest_row [s, K]): the row indexes the
        destination's [recv_rows] receive rows. Pure; O(rank*E + s*K*log) per call.
        """
        R, E = self.num_ranks, self.num_experts
        if not 0 <= int(rank) < R:
            raise ValueError(f"rank must be in [0, {R}), got {rank}")
        idx = to_numpy(topk_idx)
        flat = np.asarray(idx, dtype=np.int64).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= E):
            raise ValueError(f"topk_idx holds expert ids outside [0, {E})")
        counts = self.slots_per_expert[rank]
        if not np.array_equal(np.bincount(flat, minlength=E), counts):
            raise ValueError(f"topk_idx histogram does not match slots_per_expert[{rank}]")
        order = np.argsort(flat, kind="stable")
        occurrence = np.empty_like(flat)
        occurrence[order] = np.arange(flat.size) - (np.cumsum(counts) - counts)[flat[order]]
        base = np.concatenate(([0], np.cumsum(self.alloc.sum(1))))
        key = base[flat] + self.slots_per_expert[:rank].sum(0)[flat] + occurrence
        end, start, dest, row0 = self._pieces
        piece = np.searchsorted(end, key, side="right")
        shape = np.shape(idx)
        return dest[piece].reshape(shape), (row0[piece] + key - start[piece]).reshape(shape)


def raise_error(err: np.ndarray, slots: int) -> None:
    """Turn the kernel's error triple into a ValueError that names the problem."""
    code, a, b = (int(v) for v in err)
    if code == _errors.NEGATIVE:
        raise ValueError(f"slots_per_expert must be non-negative, got a negative count at ({a}, {b})")
    if code == _errors.CAPS_SUM:
        raise ValueError(f"caps must sum to the total routed slots: sum(caps)={a}, total={b}")
    if code == _errors.INFEASIBLE:
        raise ValueError(
            f"caps are too uneven for a one-donor plan: receiver rank {b} needs more rows than "
            f"its donor rank {a} holds (the guarantee needs max(caps) - min(caps) <= 1)"
        )
    if code == _errors.TOO_LARGE:
        raise ValueError(f"counts too large for int32 plan tables (count or caps >= 2**31) at ({a}, {b})")
    if code == _errors.EXPERT_TOO_LARGE:
        raise ValueError(expert_total_message(a, b))
    if code == _errors.TOO_MANY_REPLICAS:
        raise ValueError(f"rank {a} needs {b} replica slots but slots_per_rank={slots}")


def make_plan(T, caps, alloc, donor, copy, send, cu, flows, pad: int, epn: int, freeze: bool = True) -> Plan:
    """The kernel's arrays as a Plan (no copies), frozen read-only unless ``freeze=False`` (the tensor path
    wraps the same arrays as tensors, which must stay writable)."""
    arrays = [T, caps, alloc, donor, copy, caps.copy(), send, cu, flows]
    for a in arrays if freeze else ():
        a.setflags(write=False)
    slots = copy.shape[1]
    recv_rows = -(-(int(caps.max()) + (pad - 1) * (epn + slots)) // pad) * pad
    return Plan(*arrays, token_padding=pad, recv_rows=recv_rows)
