"""The EP layout on the device: the row maps of one rank for one MoE layer's step (held by a ``CommPlan``).

Axes: ``s`` tokens on this rank, ``K`` top-k, ``N = s*K`` slots, ``R`` ranks, ``E`` experts, ``epn = E / R``,
``slots`` replica slots per rank, ``recv_rows`` receive rows (MoonEP's NvS), ``n`` this rank's routed (valid)
slots, ``U`` unique (token, destination rank) pairs, ``n_recv`` slots this rank receives.

Wire dedup: the planner counts routed (token, expert) *slots* (``send_counts``); a token routed to several
experts on one destination crosses the wire once. The sender ships one row per (token, destination) and a
small per-slot side table (destination row, index of its unique row, routing weight) whose row counts are the
plan's exact ``send_counts``; the receiver expands the unique rows into the slots (the "epilogue") and, in
combine, sums a token's slots on that rank back into one row before it travels home (the "prologue").

Every function here is tensor ops on the plan's device with output shapes that depend on (s, K, E, R, slots)
only: no numpy, no ``.tolist()``, no ``nonzero`` / ``unique`` / boolean-mask indexing. Selections whose size
depends on the routing ("the valid slots", "the occupied replica slots") are stable sorts that move the chosen
entries to the front; the caller cuts the front with a count from the one host read of the step
(``Buffer.dispatch``). The numpy twin the tests compare against is ``moonep.reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import planner
from planner import row_bound


def num_recv_rows(total_tokens: int, K: int, R: int, epn: int, token_padding: int, slack: float = 0.0) -> int:
    """Receive rows of a step (MoonEP's NvS): align_up(U + (pad-1)*2*epn, pad) with pad = token_padding and
    U = ceil((1 + slack) * total*K / R) (``planner.row_bound``; slack 0: exact balance); >= any plan's padded
    layout of that many tokens whose rows per rank are bounded by that slack."""
    rows = row_bound(total_tokens * K, R, slack) + (token_padding - 1) * 2 * epn
    return -(-rows // token_padding) * token_padding


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _front(mask: torch.Tensor) -> torch.Tensor:
    """Indices [len(mask)] with the True entries first, each part in index order (a stable compaction)."""
    return torch.argsort((~mask).to(torch.int8), stable=True)


def route_slots(plan: planner.TensorPlan, rank: int, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Destination (rank, row) of every slot of ``rank``: the device twin of ``planner.Plan.route``.

    topk_idx: [s, K] expert ids (-1 = no expert). Returns (dest [N], row [N]) int64, flat t*K + k order;
    masked slots get dest = R, row = 0. A slot's key in the global slot sequence is its expert's base, plus
    the expert's slots on lower ranks, plus its occurrence among this rank's slots of that expert (token-major);
    the plan's pieces (runs of that sequence, sorted) give its destination.
    """
    R, E = plan.num_ranks, plan.num_experts
    flat = topk_idx.reshape(-1).long()
    valid = flat >= 0
    e = torch.where(valid, flat, E)
    order = torch.argsort(e, stable=True)
    ranked = e[order]
    occurrence = torch.empty_like(flat)
    occurrence.scatter_(0, order, torch.arange(flat.numel(), device=flat.device) - torch.searchsorted(ranked, ranked))
    load = plan.alloc.sum(1, dtype=torch.int64)
    below = plan.slots_per_expert[:rank].sum(0, dtype=torch.int64)
    ec = e.clamp(max=E - 1)
    key = (_exclusive_cumsum(load) + below)[ec] + occurrence
    pieces = plan.pieces
    piece = torch.searchsorted(pieces[:, 0].contiguous(), key, right=True).clamp_(max=pieces.shape[0] - 1)
    dest = torch.where(valid, pieces[piece, 2], R)
    row = torch.where(valid, pieces[piece, 3] + key - pieces[piece, 1], 0)
    return dest, row


@dataclass(frozen=True)
class SendLayout:
    """Send side of one rank: [N] tables in send order (the first n entries are the routed slots)."""

    slot_pos: torch.Tensor
    """[N] flat slot index t*K + k, by destination rank, token-major inside."""
    dest_row: torch.Tensor
    """[N] row on the destination."""
    uniq_local: torch.Tensor
    """[N] index of the slot's unique row within its destination's chunk."""
    uniq_token: torch.Tensor
    """[N] token of each unique row in send order (the first U entries are real)."""
    slot_splits: torch.Tensor
    """[R] routed slots per destination."""
    uniq_splits: torch.Tensor
    """[R] unique rows per destination."""


def send_layout(plan: planner.TensorPlan, rank: int, topk_idx: torch.Tensor) -> SendLayout:
    """Order this rank's slots by destination and find the unique (token, destination) rows.

    topk_idx: [s, K] int expert ids, -1 = no expert (masked out before routing).
    """
    R, K = plan.num_ranks, topk_idx.shape[1]
    dest, row = route_slots(plan, rank, topk_idx)
    pos = torch.argsort(dest, stable=True)  # by destination, token-major inside; masked slots last (dest = R)
    d = dest[pos]
    tok = pos // K
    first = torch.ones_like(d, dtype=torch.bool)
    first[1:] = (d[1:] != d[:-1]) | (tok[1:] != tok[:-1])  # a new (destination, token) pair
    uniq_global = torch.cumsum(first, 0) - 1
    counts = torch.zeros(2, R + 1, dtype=torch.int64, device=d.device)
    counts[0].scatter_add_(0, d, torch.ones_like(d))
    counts[1].scatter_add_(0, d, first.long())
    slot_splits, uniq_splits = counts[0, :R], counts[1, :R]
    uniq_local = uniq_global - _exclusive_cumsum(uniq_splits)[d.clamp(max=R - 1)]
    N = d.numel()
    uniq_token = torch.zeros(N + 1, dtype=torch.int64, device=d.device)  # the last entry takes masked slots
    uniq_token.scatter_(0, torch.where(first & (d < R), uniq_global, N), tok)
    return SendLayout(pos, row[pos], uniq_local, uniq_token[:N], slot_splits, uniq_splits)


def recv_layout(
    dest_row: torch.Tensor, uniq_local: torch.Tensor, slot_splits: torch.Tensor, uniq_splits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Receive side from the received side table, chunks by source rank.

    dest_row, uniq_local: [n_recv] (row in this rank's receive view, unique index within the source's chunk);
    slot_splits / uniq_splits: [R] slots / unique rows received from each source. Returns (row [n_recv],
    index of the slot's unique row among all received unique rows [n_recv]).
    """
    n = dest_row.numel()
    src = torch.searchsorted(torch.cumsum(slot_splits, 0), torch.arange(n, device=dest_row.device), right=True)
    before = _exclusive_cumsum(uniq_splits)
    return dest_row.long(), uniq_local.long() + before[src.clamp_(max=before.numel() - 1)]


def row_sources(row: torch.Tensor, uniq: torch.Tensor, recv_rows: int) -> torch.Tensor:
    """[recv_rows] 1 + the received unique row each receive row is copied from; 0 for rows no slot fills (padding
    and tail): they read, or in combine sum into, a zero row kept in front of the received unique rows.

    row, uniq: [n_recv] from ``recv_layout``. One gather (dispatch) and one scatter-add (combine) over the
    [recv_rows] rows then move each row once, with no separate zero-fill of the unfilled ones.
    """
    return torch.zeros(recv_rows, dtype=torch.int64, device=row.device).scatter_(0, row, uniq + 1)


def replica_maps(plan: planner.TensorPlan, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which weights move for the replicas, as static index tables.

    Returns (push_rows [R*slots]: local expert rows this rank sends, receivers in rank order, slot order
    inside — the first sum(pushed) are real; my_slots [slots]: this rank's occupied replica slots first).
    """
    epn = plan.experts_per_rank
    copy = plan.experts_to_copy
    mine = (plan.donor == rank)[:, None] & (copy >= 0)
    flat = copy.reshape(-1)
    push_rows = (flat[_front(mine.reshape(-1))] - rank * epn).clamp_(0, epn - 1)
    return push_rows, _front(copy[rank] >= 0)
