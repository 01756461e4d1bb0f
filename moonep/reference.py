"""Naive twins of the EP layer's fast paths, for the tests: the host (numpy) layout the device layout replaced.

``send_layout`` / ``recv_layout`` build the same row maps as ``moonep.layout`` from a numpy ``planner.Plan``
with numpy sorts and ``Plan.route``; the device versions must give identical tables on the routed slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import planner


@dataclass(frozen=True)
class HostSendLayout:
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


def send_layout(plan: planner.Plan, rank: int, topk_idx: np.ndarray) -> HostSendLayout:
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
    return HostSendLayout(pos, row, uniq_global - uniq_before[d], tok[first], slot_splits, uniq_splits)


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
