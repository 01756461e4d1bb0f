"""Expert compute on the dispatch layout: shared replica pools and a grouped SwiGLU over the [2*epn] groups.

Axes: ``n`` = recv_rows receive rows, ``H`` hidden, ``F`` expert FFN size, ``epn`` experts per rank.
Weights: ``w13 [epn, H, 2F]`` (gate and up side by side), ``w2 [epn, F, H]``; per expert e on rows x:
``y = (silu(x @ w13[:, :F]) * (x @ w13[:, F:])) @ w2``, then times the routing weight (expert side).

The receive layout has ``2*epn`` groups: this rank's own experts, then its ``epn`` replica slots. The grouped
SwiGLU reads group g's weights from a per-group list (``group_view``): the layer's own parameters for
g < epn (no staging copy) and the shared replica pool for the slots.

Pools (memory): one ``ExpertPool`` per (communicator, projection shape, dtype), shared by every layer: the
replica slots' weights ``[epn, ...]`` and their fp32 grads. Extra memory is ``epn`` experts per projection
(plus ``epn`` fp32 grads), in total, not per layer. Because layers share the slots, the backward re-pushes a
layer's replicas when another layer pushed since its forward (every rank takes the same decision: the pool's
owner evolves identically on all ranks).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as Fn

from .buffer import Buffer
from .comm_plan import CommPlan, segments_of

_POOLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class ExpertPool:
    """Replica-slot weight and grad pools of one projection for one EP group (see the module docstring)."""

    def __init__(self, epn: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.epn = epn
        self.weights = torch.zeros(epn, *shape, dtype=dtype, device=device)
        """[epn, ...] replica slots: the experts pushed to this rank for the current plan."""
        self.grads = torch.zeros(epn, *shape, dtype=torch.float32, device=device)
        """[epn, ...] fp32 grads of the replica slots, overwritten by each layer's backward and reduced home."""
        self.owner: object = None
        """(layer key, plan) of the last push; decides whether a backward must re-push."""


def pool_for(buffer: Buffer, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> ExpertPool:
    """The process-wide pool of ``buffer``'s communicator for one projection (created on first use)."""
    pools = _POOLS.setdefault(buffer.comm, {})
    key = (name, tuple(shape), dtype, buffer.epn, buffer.device)
    if key not in pools:
        pools[key] = ExpertPool(buffer.epn, tuple(shape), dtype, buffer.device)
    return pools[key]


def push_replicas(buffer: Buffer, plan: CommPlan, key: object, pools, locals_) -> None:
    """Push the replicated experts' weights into the pools' slots (collective) and mark the pools as ours."""
    for pool in pools:
        pool.owner = (key, plan)
    buffer.prefetch_weight(plan, [w.detach() for w in locals_], [p.weights for p in pools])


def group_view(own: torch.Tensor, slots: torch.Tensor) -> list[torch.Tensor]:
    """Per-group views ``[2*epn]`` of own ``[epn, ...]`` then slot ``[epn, ...]`` tensors (no copy)."""
    return list(own.unbind(0)) + list(slots.unbind(0))


def segments(cu: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
    """(group, start, end) of the non-empty segments of cu_seqlens [G] (reads cu: for callers without a
    CommPlan, whose ``segments`` came with the step's one host read)."""
    return segments_of(cu.tolist())


def swiglu_forward(x, w13, w2, segs):
    """Grouped SwiGLU. x [n, H], w13 / w2: per-group weights ([G, H, 2F] / [G, F, H] tensors or lists of G
    views), segs: (group, start, end) of the non-empty segments -> (y [n, H], saved activations a13 [n, 2F]).

    Rows past the last segment (padding) give 0. A loop over segments on CPU writing straight into the outputs
    (no zero-fill of rows that are computed anyway); one grouped GEMM call on GPU would do.
    """
    F, n = w2[0].shape[0], x.shape[0]
    y = x.new_empty(n, w2[0].shape[1])
    a13 = x.new_empty(n, 2 * F)
    end = 0
    for g, a, b in segs:
        torch.mm(x[a:b], w13[g], out=a13[a:b])
        torch.mm(Fn.silu(a13[a:b, :F]) * a13[a:b, F:], w2[g], out=y[a:b])
        end = b
    y[end:].zero_()
    a13[end:].zero_()
    return y, a13


def swiglu_backward(x, w13, w2, segs, a13, dy, dw13=None, dw2=None):
    """Grads of ``swiglu_forward``: (dx [n, H], dw13, dw2) with dy [n, H].

    ``dw13`` / ``dw2``: per-group outputs to overwrite (tensors or lists of views, any float dtype; default new
    fp32 tensors shaped like the weights); groups without rows get 0.
    """
    F, G = w2[0].shape[0], len(w13)
    dx = torch.empty_like(x)
    if dw13 is None:
        dw13 = torch.empty(G, *w13[0].shape, dtype=torch.float32, device=x.device)
        dw2 = torch.empty(G, *w2[0].shape, dtype=torch.float32, device=x.device)
    used, end = set(), 0
    for g, a, b in segs:
        gate, up = a13[a:b, :F], a13[a:b, F:]
        sg = torch.sigmoid(gate)
        act = gate * sg
        dw2[g].copy_((act * up).t() @ dy[a:b])
        dm = dy[a:b] @ w2[g].t()
        dgate = dm * up * (sg * (1 + gate * (1 - sg)))  # d silu(g) / dg = s(g) (1 + g (1 - s(g)))
        da13 = torch.cat((dgate, dm * act), dim=1)
        dw13[g].copy_(x[a:b].t() @ da13)
        torch.mm(da13, w13[g].t(), out=dx[a:b])
        used.add(g)
        end = b
    dx[end:].zero_()
    for g in set(range(G)) - used:
        dw13[g].zero_()
        dw2[g].zero_()
    return dx, dw13, dw2


class GroupedExperts(torch.autograd.Function):
    """z [n, H] = swiglu(recv_hidden) * recv_weights[:, None] over the [2*epn] groups; grads to local weights."""

    @staticmethod
    def forward(ctx, buffer: Buffer, plan: CommPlan, key: object, x, w, w13, w2):
        pools = (
            pool_for(buffer, "w13", tuple(w13.shape[1:]), w13.dtype),
            pool_for(buffer, "w2", tuple(w2.shape[1:]), w2.dtype),
        )
        push_replicas(buffer, plan, key, pools, (w13, w2))
        y, a13 = swiglu_forward(
            x, group_view(w13.detach(), pools[0].weights), group_view(w2.detach(), pools[1].weights), plan.segments
        )
        ctx.buffer, ctx.plan, ctx.key, ctx.pools = buffer, plan, key, pools
        ctx.save_for_backward(x, w, w13, w2, a13, y)
        return y * w[:, None].to(y.dtype)

    @staticmethod
    def backward(ctx, dz):
        buffer, plan, pools = ctx.buffer, ctx.plan, ctx.pools
        x, w, w13, w2, a13, y = ctx.saved_tensors
        if any(p.owner != (ctx.key, plan) for p in pools):  # another layer used the shared slots since
            push_replicas(buffer, plan, ctx.key, pools, (w13, w2))
        dw = (dz * y).sum(1).to(w.dtype)
        dy = dz * w[:, None].to(dz.dtype)
        own13 = torch.empty(w13.shape, dtype=torch.float32, device=w13.device)
        own2 = torch.empty(w2.shape, dtype=torch.float32, device=w2.device)
        dx, _, _ = swiglu_backward(
            x,
            group_view(w13, pools[0].weights),
            group_view(w2, pools[1].weights),
            plan.segments,
            a13,
            dy,
            group_view(own13, pools[0].grads),
            group_view(own2, pools[1].grads),
        )
        buffer.reduce_grad(plan, [own13, own2], [pools[0].grads, pools[1].grads])
        return None, None, None, dx, dw, own13.to(w13.dtype), own2.to(w2.dtype)
