"""The classic all-to-all EP dispatcher: the benchmark baseline and a second twin for the MoE numerics.

permute slots by expert -> exchange per-(rank, expert) counts (host sync) -> all_to_all_single of the rows ->
sort by local expert -> grouped SwiGLU over the epn local experts (the same GEMM code as MoonEP) -> reverse.
Rows per rank follow the routing (a hot expert's home rank computes all of its slots).
Axes as in moonep.buffer: s tokens, H hidden, K top-k, E experts, R ranks, epn = E / R.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from collectives.base import Communicator
from moonep.expert_math import segments, swiglu_backward, swiglu_forward


class _AllToAll(torch.autograd.Function):
    """Differentiable all_to_all_single; backward = the reverse exchange."""

    @staticmethod
    def forward(ctx, comm: Communicator, x, out_splits: list[int], in_splits: list[int]):
        ctx.comm, ctx.splits = comm, (out_splits, in_splits)
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, validate=False, splits_agreed=True)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        back = g.new_empty(sum(in_splits), *g.shape[1:])
        ctx.comm.all_to_all_single(back, g.contiguous(), in_splits, out_splits, validate=False, splits_agreed=True)
        return None, back, None, None


class _LocalExperts(torch.autograd.Function):
    """SwiGLU over the epn local experts only (segments = cu [epn])."""

    @staticmethod
    def forward(ctx, x, w13, w2, cu):
        y, a13 = swiglu_forward(x, w13, w2, segments(cu))
        ctx.save_for_backward(x, w13, w2, cu, a13)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w13, w2, cu, a13 = ctx.saved_tensors
        dx, dw13, dw2 = swiglu_backward(x, w13, w2, segments(cu), a13, dy.contiguous())
        return dx, dw13.to(w13.dtype), dw2.to(w2.dtype), None


@dataclass
class ClassicRoute:
    """What the classic combine needs to undo the dispatch (host-side splits: the count exchange synced)."""

    tok: torch.Tensor
    """[s*K] source token of each sent row (slots in expert order)."""
    by_expert: torch.Tensor
    """[n] received rows sorted by local expert (n = rows received)."""
    in_splits: list[int]
    """Rows sent to each rank."""
    out_splits: list[int]
    """Rows received from each rank."""
    token_bytes: int
    """Bytes of token rows this rank sent."""


def classic_dispatch(comm: Communicator, x, *, topk_idx, topk_weights, E: int):
    """Permute, exchange counts, all-to-all, sort by local expert.

    x [s, H], topk_idx [s, K] (no -1), topk_weights [s, K] -> (rows [n, H], weights [n], cu [epn], route).
    """
    R, K = comm.world_size, topk_idx.shape[1]
    epn = E // R
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # permute: slots grouped by expert (hence by rank)
    tok = order // K
    rows = x.index_select(0, tok)
    w = topk_weights.reshape(-1).index_select(0, order)
    counts = torch.bincount(flat, minlength=E)
    got_counts = torch.empty_like(counts)
    comm.all_to_all_single(got_counts, counts, validate=False)  # [R * epn]: source q's counts of my experts
    got = got_counts.view(R, epn)
    in_splits = counts.view(R, epn).sum(1).tolist()  # host sync: the classic dispatcher needs the splits
    out_splits = got.sum(1).tolist()
    recv = _AllToAll.apply(comm, rows, out_splits, in_splits)
    recv_w = _AllToAll.apply(comm, w[:, None], out_splits, in_splits)[:, 0]
    # sort by local expert: inside each source chunk rows are already in expert order
    local_e = torch.repeat_interleave(torch.arange(epn).repeat(R), got.reshape(-1))
    by_expert = torch.argsort(local_e, stable=True)
    cu = torch.cumsum(torch.bincount(local_e, minlength=epn), 0)
    route = ClassicRoute(tok, by_expert, in_splits, out_splits, int(rows.numel() * rows.element_size()))
    return recv.index_select(0, by_expert), recv_w.index_select(0, by_expert), cu, route


def classic_experts(rows, weights, cu, w13, w2):
    """Weighted SwiGLU over the epn local experts: rows [n, H], weights [n], cu [epn] -> [n, H]."""
    return _LocalExperts.apply(rows, w13, w2, cu) * weights[:, None]


def classic_combine(comm: Communicator, z, route: ClassicRoute, x):
    """Reverse the local sort, all-to-all back, sum each token's K copies: z [n, H] -> [s, H] (like x)."""
    unsorted = torch.zeros_like(z).index_add(0, route.by_expert, z)
    back = _AllToAll.apply(comm, unsorted, route.in_splits, route.out_splits)
    return torch.zeros_like(x).index_add(0, route.tok, back)


def classic_moe(comm: Communicator, x, *, topk_idx, topk_weights, w13, w2, E: int, stats: dict | None = None):
    """x [s, H], topk_idx [s, K] (no -1), topk_weights [s, K], w13 [epn, H, 2F], w2 [epn, F, H] -> [s, H]."""
    rows, weights, cu, route = classic_dispatch(comm, x, topk_idx=topk_idx, topk_weights=topk_weights, E=E)
    out = classic_combine(comm, classic_experts(rows, weights, cu, w13, w2), route, x)
    if stats is not None:
        stats["rows"] = int(rows.shape[0])
        stats["token_bytes"] = route.token_bytes
    return out
