"""``CommPlan``: one rank's view of one MoE layer's step — the global ``planner.Plan`` plus the row maps.

Axes: ``s`` tokens on this rank, ``K`` top-k, ``R`` ranks, ``E`` experts, ``epn = E / R``, ``nvs`` receive rows
(static: depends on S-independent geometry and the global token count only), ``n`` this rank's routed
(valid) slots, ``U`` unique (token, destination rank) pairs.

Wire dedup: the planner counts routed (token, expert) *slots* (``send_counts``); a token routed to several
experts on one destination crosses the wire once. The sender ships one row per (token, destination) and a
small per-slot side table (destination row, index of its unique row, routing weight) whose row counts are the
plan's exact ``send_counts``; the receiver expands the unique rows into the slots (the "epilogue") and, in
combine, sums a token's slots on that rank back into one row before it travels home (the "prologue").
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import planner


@dataclass(frozen=True, eq=False)
class CommPlan:
    """Everything dispatch, combine, prefetch_weight and reduce_grad need for one layer and one step.

    Built by ``Buffer.dispatch`` (identical global ``plan`` on every rank); reused, unchanged, by combine, the
    backward re-dispatch, ``prefetch_weight`` and ``reduce_grad``.
    """

    plan: planner.Plan
    """the global plan (same on every rank): alloc [E, R], experts_to_copy [R, epn], send_counts [R, R], ..."""
    rank: int
    """the rank this CommPlan belongs to."""
    buffer_id: int
    """id() of the Buffer that made it (combine refuses a foreign plan)."""
    num_tokens: int
    """s: tokens this rank dispatched."""
    total_num_tokens: int
    """sum of s over ranks (sizes nvs)."""
    nvs: int
    """rows of the receive views [nvs, H] this step: align_up(ceil(total*K/R) + (tp-1)*2*epn, tp)."""
    cu_seqlens: torch.Tensor
    """[2*epn] int64 padded segment ends: own experts in id order, then replica slots."""
    slot_pos: torch.Tensor
    """[n] flat index t*K + k of each routed slot, in send order (destination rank, then token-major)."""
    send_slot_splits: list[int]
    """[R] routed slots this rank sends to each rank (= plan.send_counts[rank])."""
    uniq_token: torch.Tensor
    """[U] token of each unique (token, destination) row, in send order."""
    send_uniq_splits: list[int]
    """[R] unique rows this rank sends to each rank."""
    recv_slot_row: torch.Tensor
    """[n_recv] row in the [nvs] view of each received slot, in receive order (source rank, then send order)."""
    recv_slot_uniq: torch.Tensor
    """[n_recv] index of each received slot's unique row among the received unique rows."""
    recv_slot_splits: list[int]
    """[R] routed slots received from each rank (= plan.send_counts[:, rank])."""
    recv_uniq_splits: list[int]
    """[R] unique rows received from each rank."""
    empty_rows: torch.Tensor
    """[nvs - n_recv] rows of the [nvs] view that hold no routed slot (padding and tail): zero-filled."""

    def __post_init__(self) -> None:
        if sum(self.send_slot_splits) != self.slot_pos.numel():
            raise ValueError("send_slot_splits must sum to the number of routed slots")
        if sum(self.recv_slot_splits) != self.recv_slot_row.numel():
            raise ValueError("recv_slot_splits must sum to the number of received slots")
        if int(self.cu_seqlens[-1]) > self.nvs:
            raise ValueError(f"padded layout {int(self.cu_seqlens[-1])} rows exceeds nvs={self.nvs}")

    @property
    def experts_per_rank(self) -> int:
        """epn."""
        return self.plan.experts_per_rank

    @property
    def real_rows(self) -> int:
        """routed rows this rank computes (= plan.caps[rank])."""
        return int(self.plan.caps[self.rank])


@dataclass(frozen=True)
class SendLayout:
    """Send side of one rank (pure function of the plan and its topk_idx)."""

    slot_pos: np.ndarray
    """[n] flat slot index t*K + k in send order."""
    dest_row: np.ndarray
    """[n] row on the destination, in send order."""
    uniq_local: np.ndarray
    """[n] index of the slot's unique row within its destination's chunk."""
    uniq_token: np.ndarray
    """[U] token of each unique row in send order."""
    slot_splits: np.ndarray
    """[R] slots per destination."""
    uniq_splits: np.ndarray
    """[R] unique rows per destination."""


def nvs_rows(total_tokens: int, K: int, R: int, epn: int, tp: int) -> int:
    """Static receive rows: align_up(ceil(total*K/R) + (tp-1)*2*epn, tp) (>= any plan's padded layout)."""
    rows = -(-total_tokens * K // R) + (tp - 1) * 2 * epn
    return -(-rows // tp) * tp


def send_layout(plan: planner.Plan, rank: int, topk_idx: np.ndarray) -> SendLayout:
    """Order this rank's routed slots by destination and find the unique (token, destination) rows.

    topk_idx: [s, K] int expert ids, -1 = no expert (masked out before routing).
    """
    s, K = topk_idx.shape
    flat = topk_idx.reshape(-1)
    valid = np.nonzero(flat >= 0)[0]
    # route() wants a histogram-exact id list in token-major order: the valid ids in flat order keep it
    dest_rank, dest_row = plan.route(rank, flat[valid].reshape(-1, 1))
    dest_rank, dest_row = dest_rank.reshape(-1), dest_row.reshape(-1)
    order = np.argsort(dest_rank, kind="stable")  # by destination, token-major inside
    pos, d, row = valid[order], dest_rank[order], dest_row[order]
    tok = pos // K
    first = np.ones(pos.size, bool)
    first[1:] = (d[1:] != d[:-1]) | (tok[1:] != tok[:-1])  # a new (destination, token) pair
    uniq_global = np.cumsum(first) - 1
    R = plan.num_ranks
    uniq_splits = np.bincount(d[first], minlength=R)
    uniq_before = np.concatenate(([0], np.cumsum(uniq_splits)[:-1]))
    slot_splits = np.bincount(d, minlength=R)
    if not np.array_equal(slot_splits, plan.send_counts[rank]):
        raise AssertionError(f"rank {rank}: routed slots per destination {slot_splits.tolist()} differ from "
                             f"the plan's send_counts {plan.send_counts[rank].tolist()}")
    return SendLayout(pos, row, uniq_global - uniq_before[d], tok[first], slot_splits, uniq_splits)


def recv_layout(meta: np.ndarray, splits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Receive side from the per-slot side table.

    meta: [n_recv, 2] int (destination row, unique index within the source's chunk), chunks by source rank.
    Returns (row [n_recv], global unique index [n_recv], unique rows per source [R]).
    """
    src = np.repeat(np.arange(splits.size), splits)
    uniq_local = meta[:, 1]
    uniq_splits = np.zeros(splits.size, np.int64)
    if uniq_local.size:
        np.maximum.at(uniq_splits, src, uniq_local + 1)  # indices 0..u-1 all occur in a chunk
    before = np.concatenate(([0], np.cumsum(uniq_splits)[:-1]))
    return meta[:, 0], uniq_local + before[src], uniq_splits


def empty_rows(rows: np.ndarray, nvs: int) -> np.ndarray:
    """Rows of [0, nvs) not in ``rows`` (padding and tail)."""
    mask = np.ones(nvs, bool)
    mask[rows] = False
    return np.nonzero(mask)[0]
