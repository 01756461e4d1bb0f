"""Naive twins of the EP layer's fast paths, kept beside them for the tests.

- ``send_layout`` / ``recv_layout``: the host (numpy) layout the device layout (``moonep.layout``) replaced,
  from a numpy ``planner.Plan`` with numpy sorts and ``Plan.route``; the device tables must be identical on the
  routed slots.
- ``naive_experts`` / ``dense_moe``: a single-process MoE holding ALL experts, a loop over experts, against
  which the distributed layer's outputs and every gradient are compared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as Fn
from torch import nn

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


def naive_experts(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Dense single-process twin: loop over ALL experts, weighted sum of each token's K outputs.

    x [s, H], topk_idx [s, K] (-1 = none), topk_weights [s, K], w13 [E, H, 2F], w2 [E, F, H] -> [s, H].
    """
    F = w2.shape[1]
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, k = torch.nonzero(topk_idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w13[e]
        y = (Fn.silu(h[:, :F]) * h[:, F:]) @ w2[e]
        out = out.index_add(0, tok, y * topk_weights[tok, k][:, None])
    return out


def dense_moe(
    x: torch.Tensor, router: Callable, w13_all: torch.Tensor, w2_all: torch.Tensor, shared: nn.Module | None = None
) -> torch.Tensor:
    """Single-process reference holding ALL experts: x [s, H], w13_all [E, H, 2F], w2_all [E, F, H] -> [s, H]."""
    topk_idx, topk_weights = router(x)
    y = naive_experts(x, topk_idx, topk_weights, w13_all, w2_all)
    return y if shared is None else y + shared(x)
