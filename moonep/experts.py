"""Expert compute on the dispatch layout: shared replica pools and one grouped gated MLP over the [2*epn] groups.

Axes: ``N`` = recv_rows receive rows, ``H`` hidden, ``F`` expert FFN size, ``epn`` experts per rank. The math
(gated activations, the ``"fused"`` and ``"linear"`` weight layouts, the grouped forward and backward) is
``moonep.expert_math``; this module runs it between the step's collectives and applies the routing weights on
the expert side.

The receive layout has ``2*epn`` groups: this rank's own experts, then its ``epn`` replica slots. The step reads
group g's weights from a per-group list (``group_view``): the layer's own parameters for g < epn (no staging copy)
and the shared replica pool for the slots.

Pools (memory): one ``ExpertPool`` per (communicator, projection name, shape, dtype), shared by every layer: the
replica slots' weights ``[epn, ...]`` and their fp32 grads. Extra memory is ``epn`` experts per projection (plus
``epn`` fp32 grads), in total, not per layer. Because layers share the slots, the backward re-pushes a layer's
replicas when another layer pushed since its forward (every rank takes the same decision: the pool's owner
evolves identically on all ranks). The step's collectives run in a fixed order: the weight push in forward
(``start_push``: started by the layer once the token rows landed), and in backward the re-push, if any, first,
the grad reduce last; the expert math in between is pure compute (see the autograd nodes below).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from collectives import Pending
from moonep.buffer import Buffer
from moonep.comm_plan import CommPlan
from moonep.expert_math import (
    LAYOUTS,
    Activation,
    GatedActivation,
    GroupHook,
    as_activation,
    check_weights,
    gated_backward,
    gated_forward,
)

_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
        self.pending: Pending | None = None
        """the push in flight into ``weights`` (``start_push``), or None."""

    def wait(self) -> None:
        """Finish the push in flight, if any (the slots hold the owner's replicas afterwards)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()


def pool_for(buffer: Buffer, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> ExpertPool:
    """The process-wide pool of ``buffer``'s communicator for one projection (created on first use)."""
    pools = _POOLS.setdefault(buffer.comm, {})
    key = (name, tuple(shape), dtype, buffer.epn, buffer.device)
    if key not in pools:
        pools[key] = ExpertPool(buffer.epn, tuple(shape), dtype, buffer.device)
    return pools[key]


def _step_of(plan) -> object:
    """The step a plan belongs to: its dispatch's layout (a push started from the layout, before the rows moved,
    is this plan's push); a layout is its own step."""
    return plan.layout if isinstance(plan, CommPlan) else plan


def _claim(pools, key: object, plan) -> None:
    """Mark the pools as (key, step)'s, after a push still in flight into their slots has landed."""
    for pool in pools:
        pool.wait()
        pool.owner = (key, _step_of(plan))


def push_replicas(buffer: Buffer, plan: CommPlan, key: object, pools, locals_) -> None:
    """Push the replicated experts' weights into the pools' slots (collective) and mark the pools as ours."""
    _claim(pools, key, plan)
    # through .data: autograd graphs that saved slot views (torch.func expert modules) must not see a version
    # bump; the re-push guard restores a layer's replicas before its backward reads them
    buffer.prefetch_weight(plan, [w.detach() for w in locals_], [p.weights.data for p in pools])


def ensure_replicas(buffer: Buffer, plan: CommPlan, key: object, pools, locals_) -> None:
    """``push_replicas`` unless the pools already hold this layer's replicas of this plan (collective: every
    rank decides alike, the owners evolve the same everywhere). ``locals_``: [epn, ...] tensors, or a callable
    making them, called only when a push is needed."""
    if any(p.owner != (key, _step_of(plan)) for p in pools):
        push_replicas(buffer, plan, key, pools, locals_() if callable(locals_) else locals_)


def group_view(own: torch.Tensor, slots: torch.Tensor) -> list[torch.Tensor]:
    """Per-group views ``[2*epn]`` of own ``[epn, ...]`` then slot ``[epn, ...]`` tensors (no copy)."""
    return list(own.unbind(0)) + list(slots.unbind(0))


# ------------------------------------------------------------------------------------- the step's autograd ops
# The step is three nodes, so that its communication sits at the layer's boundaries, in a fixed order on every
# rank: forward = (push, started after the token exchange) -> _ReplicaGradsHome (identity) -> _GatedCompute ->
# _RepushGuard (identity); the backward runs them in reverse: re-push if another layer used the pools since
# (before the compute reads them), the compute, then the slot grads brought home. Inside _GatedCompute the
# exchanges overlap the expert math: the forward computes this rank's own experts while the replica weights are
# still in flight and waits for them only before the first replica slot; the backward computes the replica slots
# first, starts sending their grads home, and computes its own experts meanwhile. Autograd runs a later-created
# node first among the ready ones, so _ReplicaGradsHome (made after dispatch) lands the grads (the started
# exchange's wait) before dispatch's backward starts another exchange.


class _GradsHome:
    """The link between the two backward nodes: the replica grads _GatedCompute started sending home."""

    def __init__(self) -> None:
        self.in_flight = None


class _ReplicaGradsHome(torch.autograd.Function):
    """Identity on this rank's expert weights; backward: their replica slots' grads added home (the exchange
    _GatedCompute's backward started)."""

    @staticmethod
    def forward(ctx, link: _GradsHome, plan: CommPlan, pools, *weights):
        ctx.link, ctx.plan, ctx.pools, ctx.dtypes = link, plan, pools, [t.dtype for t in weights]
        return tuple(t.view_as(t) for t in weights)

    @staticmethod
    def backward(ctx, *grads):
        pools = ctx.pools
        in_flight, ctx.link.in_flight = ctx.link.in_flight, None
        if not ctx.plan.num_replicas:  # no replica anywhere: nothing to bring home (every rank skips alike)
            return (None, None, None) + grads
        if in_flight is None:  # the expert backward always starts them: dropping them would be silent garbage
            raise RuntimeError("moonep: replica grads never sent home (the expert backward did not run)")
        # the incoming grads are _GatedCompute's fresh fp32 tensors, consumed only here: add into them in place
        own = [
            torch.zeros(p.weights.shape, dtype=torch.float32, device=p.weights.device)
            if g is None
            else g
            if g.dtype == torch.float32 and g.is_contiguous()
            else g.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            for g, p in zip(grads, pools)
        ]
        in_flight.finish(pools[0].epn, own)
        return (None, None, None) + tuple(o.to(dt) for o, dt in zip(own, ctx.dtypes))


# Shape suffixes of the step's tensors (as torchtitan's models/common/moe.py): N receive rows (recv_rows),
# H hidden, F expert FFN size; the weights are [epn, ...] per projection (their layout in ``expert_math``).


class _GatedCompute(torch.autograd.Function):
    """z [N, H] = gated MLP(recv rows) * recv_weights[:, None] over own weights then the pools' replica slots;
    slot grads go into the pools. The replica weights land, and their grads leave, at group boundaries."""

    @staticmethod
    def forward(
        ctx, buffer: Buffer, link: _GradsHome, plan: CommPlan, pools, layout: str, act, recompute, x_NH, w_N, *ws
    ):
        views = [group_view(t.detach(), p.weights) for t, p in zip(ws, pools)]
        slots = frozenset(range(buffer.epn, 2 * buffer.epn))

        def land() -> None:  # the push in flight, if any
            for p in pools:
                p.wait()

        hook = GroupHook(slots, land)
        y_NH, pre_N2F = gated_forward(x_NH, views, plan.segments, layout, act, keep=not recompute, hook=hook)
        ctx.buffer, ctx.link, ctx.plan, ctx.pools, ctx.slots = buffer, link, plan, pools, slots
        ctx.layout, ctx.act, ctx.recompute = layout, act, recompute
        ctx.save_for_backward(x_NH, w_N, *(() if recompute else (pre_N2F, y_NH)), *ws)
        return y_NH * w_N[:, None].to(y_NH.dtype)

    @staticmethod
    def backward(ctx, dz_NH):
        pools, plan = ctx.pools, ctx.plan
        x_NH, w_N, *rest = ctx.saved_tensors
        pre_N2F, y_NH, weights = (None, None, rest) if ctx.recompute else (rest[0], rest[1], rest[2:])
        own = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in weights]
        views = [group_view(t.detach(), p.weights) for t, p in zip(weights, pools)]
        grads = [group_view(o, p.grads) for o, p in zip(own, pools)]

        def send_home() -> None:
            if plan.num_replicas:
                ctx.link.in_flight = ctx.buffer.reduce_grad_start(plan, [p.grads for p in pools])

        hook = GroupHook(ctx.slots, send_home)
        # the slot grads stay 0 between steps (created 0, each reduce zeroes what it sent, and only occupied slots
        # get rows): an empty slot needs no zeroing (7 of 8 slots here: 1.3 ms a step on the bench's layer)
        dx_NH, _, dw_N = gated_backward(
            x_NH, views, plan.segments, pre_N2F, dz_NH.contiguous(), grads, ctx.layout, ctx.act, row_w=w_N, y=y_NH,
            hook=hook, zeroed=ctx.slots,
        )  # fmt: skip
        return (None,) * 7 + (dx_NH, dw_N) + tuple(o.to(t.dtype) for o, t in zip(own, weights))


class _RepushGuard(torch.autograd.Function):
    """Identity on the step's output; backward (first of the step's): re-push the replicas if another layer
    pushed into the shared pools since this step's forward (every rank decides alike)."""

    @staticmethod
    def forward(ctx, buffer: Buffer, plan: CommPlan, key, pools, local_weights, z):
        """local_weights: the layer's [epn, ...] experts per projection, or a callable that makes them."""
        ctx.buffer, ctx.plan, ctx.key, ctx.pools, ctx.local_weights = buffer, plan, key, pools, local_weights
        return z.view_as(z)

    @staticmethod
    def backward(ctx, dz):
        ensure_replicas(ctx.buffer, ctx.plan, ctx.key, ctx.pools, ctx.local_weights)
        return (None,) * 5 + (dz,)


def repush_guard(buffer: Buffer, plan: CommPlan, key, pools, local_weights, out: torch.Tensor) -> torch.Tensor:
    """``out`` unchanged; in the backward, before anything that reads the pools, the layer's replicas are pushed
    again if another layer used the pools since (``local_weights``: [epn, ...] tensors or a callable)."""
    return _RepushGuard.apply(buffer, plan, key, pools, local_weights, out)


def pools_of(buffer: Buffer, weights, layout: str) -> tuple[ExpertPool, ...]:
    """The shared pools for ``weights`` in ``layout`` (one per projection)."""
    return tuple(pool_for(buffer, nm, tuple(t.shape[1:]), t.dtype) for nm, t in zip(LAYOUTS[layout], weights))


def start_push(buffer: Buffer, plan, weights, *, layout: str = "fused", key=None) -> None:
    """Start pushing the replicas of a step (its ``CommPlan``, or its ``DispatchLayout`` before the rows move)
    into the shared pools (asynchronous: ``Buffer.prefetch_weight_start``) and mark the pools as the layer's;
    ``grouped_experts`` waits for it before its first replica slot. ``moonep.ep_step.ep_dispatch(...,
    weights=...)`` starts it once the token rows landed, so that it flies while the own experts compute."""
    weights = tuple(weights)
    key = _key(key, weights)
    pools = pools_of(buffer, weights, layout)
    _claim(pools, key, plan)
    pending = buffer.prefetch_weight_start(plan, [w.detach() for w in weights], [p.weights.data for p in pools])
    for pool in pools:
        pool.pending = pending


def _key(key, weights) -> object:
    return ("weights", *(id(t) for t in weights)) if key is None else key


def grouped_experts(
    buffer: Buffer,
    plan: CommPlan,
    x: torch.Tensor,
    recv_weights: torch.Tensor,
    weights: Sequence[torch.Tensor],
    *,
    layout: str = "fused",
    activation: GatedActivation | Activation | None = None,
    key: object = None,
    recompute: bool = False,
) -> torch.Tensor:
    """The EP expert step on a dispatch's receive layout (differentiable; collective: call it on every rank).

    The replicas' weights come from ``start_push`` (started after the token exchange) or, if the layer did not
    start it, are pushed here; the backward re-pushes them if another layer used the pools since, and reduces
    their grads home (the three autograd nodes above).

    Args:
        buffer: the Buffer that dispatched the rows.
        plan: that dispatch's ``CommPlan``.
        x: [N, H] received rows (N = ``plan.recv_rows``), from ``moonep.dispatch``, in the weights' dtype.
        recv_weights: [N] fp32 routing weight of each row (0 on padding), from ``moonep.dispatch``.
        weights: this rank's experts in ``layout`` (module docstring): ``"fused"``: w13 [epn, H, 2F],
            w2 [epn, F, H]; ``"linear"``: w1 [epn, F, H], w3 [epn, F, H], w2 [epn, H, F].
        layout: ``"fused"`` or ``"linear"``.
        activation: act(gate, up) -> h on [N, F] (a ``GatedActivation`` or any callable; default SwiGLU).
        key: the layer's owner key for the shared pools (default: the weights' identities, which are alive
            until this step's backward).
        recompute: keep only x for the backward and recompute the [N, 2F] pre-activations and y there (the
            forward GEMMs once more, for N*(2F+H) fewer saved elements).

    Returns:
        z: [N, H] = expert(x) * recv_weights[:, None] in x's dtype (padding rows 0), ready for
        ``moonep.combine``.
    """
    x_NH, w_N = x, recv_weights
    weights = tuple(weights)
    check_weights(layout, weights, buffer.epn, x_NH.shape[-1])
    key = _key(key, weights)
    pools = pools_of(buffer, weights, layout)
    ensure_replicas(buffer, plan, key, pools, weights)
    link = _GradsHome()
    own = _ReplicaGradsHome.apply(link, plan, pools, *weights)
    act = as_activation(activation)
    z_NH = _GatedCompute.apply(buffer, link, plan, pools, layout, act, recompute, x_NH, w_N, *own)
    return _RepushGuard.apply(buffer, plan, key, pools, weights, z_NH)
