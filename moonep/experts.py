"""Expert compute on the dispatch layout: shared replica pools and one grouped gated MLP over the [2*epn] groups.

Axes: ``n`` = recv_rows receive rows, ``H`` hidden, ``F`` expert FFN size, ``epn`` experts per rank.
Per expert e on rows x: ``y = act(x @ gate_e, x @ up_e) @ down_e``, then times the routing weight (expert side).
``act`` is any gated activation ``act(gate [n, F], up [n, F]) -> h [n, F]`` (``SWIGLU`` by default; K3 passes
SiTU-GLU with its betas). Two weight layouts, both read through per-group views (no copies):

- ``"fused"`` (in x out, moonep.MoE): ``w13 [epn, H, 2F]`` (gate and up side by side), ``w2 [epn, F, H]``;
- ``"linear"`` (nn.Linear style, HF / K3): ``w1 [epn, F, H]`` (gate), ``w3 [epn, F, H]`` (up), ``w2 [epn, H, F]``.

The receive layout has ``2*epn`` groups: this rank's own experts, then its ``epn`` replica slots. The step reads
group g's weights from a per-group list (``group_view``): the layer's own parameters for g < epn (no staging copy)
and the shared replica pool for the slots.

Pools (memory): one ``ExpertPool`` per (communicator, projection name, shape, dtype), shared by every layer: the
replica slots' weights ``[epn, ...]`` and their fp32 grads. Extra memory is ``epn`` experts per projection (plus
``epn`` fp32 grads), in total, not per layer. Because layers share the slots, the backward re-pushes a layer's
replicas when another layer pushed since its forward (every rank takes the same decision: the pool's owner
evolves identically on all ranks). The step's collectives run in a fixed order: the weight push in forward
(``start_push``: started by the layer beside the token exchange), and in backward the re-push, if any, first,
the grad reduce last; the expert math in between is pure compute (see the autograd nodes below).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

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
        self.pending = None
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


def _claim(pools, key: object, plan: CommPlan) -> None:
    """Mark the pools as (key, plan)'s, after a push still in flight into their slots has landed."""
    for pool in pools:
        pool.wait()
        pool.owner = (key, plan)


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
    if any(p.owner != (key, plan) for p in pools):
        push_replicas(buffer, plan, key, pools, locals_() if callable(locals_) else locals_)


def group_view(own: torch.Tensor, slots: torch.Tensor) -> list[torch.Tensor]:
    """Per-group views ``[2*epn]`` of own ``[epn, ...]`` then slot ``[epn, ...]`` tensors (no copy)."""
    return list(own.unbind(0)) + list(slots.unbind(0))


def segments(cu: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
    """(group, start, end) of the non-empty segments of cu_seqlens [G] (reads cu: for callers without a
    CommPlan, whose ``segments`` came with the step's one host read)."""
    return segments_of(cu.tolist())


# ----------------------------------------------------------------------------------------- gated activations
@dataclass(frozen=True)
class GatedActivation:
    """A gated activation ``h = fn(gate, up)`` on [n, F] tensors, with an optional explicit derivative."""

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(gate [n, F], up [n, F]) -> h [n, F], elementwise."""
    grad: Callable | None = None
    """(gate, up, dh, out [n, 2F]) -> h, writing (dgate, dup) into out's two halves; None: autograd through
    ``fn`` (elementwise, small)."""

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.fn(gate, up)

    def value_and_grad(self, gate, up, dh, out=None):
        """(h, dgate, dup) at (gate, up) for the upstream grad dh [n, F]. dgate and dup are the two halves of
        ``out`` [n, 2F] (new when None): the backward's weight-grad GEMM reads them as one matrix, uncopied."""
        n, F = gate.shape
        out = gate.new_empty(n, 2 * F) if out is None else out
        if self.grad is not None:
            return self.grad(gate, up, dh, out), out[:, :F], out[:, F:]
        g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
        with torch.enable_grad():
            h = self.fn(g, u)
            dgate, dup = torch.autograd.grad(h, (g, u), dh)
        out[:, :F].copy_(dgate)
        out[:, F:].copy_(dup)
        return h.detach(), out[:, :F], out[:, F:]


def _swiglu_grad(gate, up, dh, out):
    # three [n, F] temporaries, the rest in place: on CPU each fresh tensor costs as much as the pass itself
    F = gate.shape[1]
    sg = torch.sigmoid(gate)
    act = gate * sg
    dsilu = torch.rsub(sg, 1).mul_(gate).add_(1).mul_(sg)  # d silu(g) / dg = s(g) (1 + g (1 - s(g)))
    torch.mul(dh, up, out=out[:, :F]).mul_(dsilu)
    torch.mul(dh, act, out=out[:, F:])
    return act.mul_(up)


SWIGLU = GatedActivation(lambda gate, up: Fn.silu(gate) * up, _swiglu_grad)
"""silu(gate) * up with its closed-form derivative (moonep.MoE's experts)."""


def as_activation(act) -> GatedActivation:
    """``act`` as a GatedActivation (a plain callable gets the autograd derivative); None means SwiGLU."""
    if act is None:
        return SWIGLU
    if isinstance(act, GatedActivation):
        return act
    if not callable(act):
        raise TypeError(f"activation must be a callable act(gate, up) -> h, got {type(act).__name__}")
    return GatedActivation(act)


# ------------------------------------------------------------------------------------------------ layouts
LAYOUTS = {"fused": ("w13", "w2"), "linear": ("w1", "w3", "w2")}
"""Weight names per layout (also the pool names): fused in x out, or nn.Linear style out x in."""


def _in_blocks(layout: str, ws, g: int, F: int) -> list[tuple[torch.Tensor, slice]]:
    """Group g's input projections as (in x out view, its columns of the [n, 2F] pre-activations)."""
    if layout == "fused":
        return [(ws[0][g], slice(None))]
    return [(ws[0][g].t(), slice(0, F)), (ws[1][g].t(), slice(F, 2 * F))]


def _down(layout: str, ws, g: int) -> torch.Tensor:
    """Group g's down projection as an [F, H] (in x out) view."""
    return ws[1][g] if layout == "fused" else ws[2][g].t()


def _width(layout: str, ws) -> int:
    return ws[1][0].shape[0] if layout == "fused" else ws[0][0].shape[0]


def check_weights(layout: str, weights, epn: int, H: int) -> None:
    """One-line errors for a wrong layout name, weight count or shape (metadata only, no data read)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    names = LAYOUTS[layout]
    if len(weights) != len(names):
        raise ValueError(f"layout {layout!r} takes {len(names)} weights {names}, got {len(weights)}")
    if any(t.dim() != 3 or t.shape[0] != epn for t in weights):
        raise ValueError(f"expert weights must be [epn={epn}, ., .], got {[tuple(t.shape) for t in weights]}")
    F = _width(layout, [t.unbind(0) for t in weights])
    if layout == "fused":
        want = [(epn, H, 2 * F), (epn, F, H)]
    else:
        want = [(epn, F, H), (epn, F, H), (epn, H, F)]
    got = [tuple(t.shape) for t in weights]
    if got != want:
        raise ValueError(f"{layout} weights {names} must be {want} for hidden size {H}, got {got}")


# --------------------------------------------------------------------------------------------- grouped math
def _project_in(layout: str, ws, g: int, F: int, xs: torch.Tensor, out: torch.Tensor) -> None:
    """out [rows, 2F] = (gate, up) pre-activations of group g on xs [rows, H]."""
    for w, cols in _in_blocks(layout, ws, g, F):
        torch.mm(xs, w, out=out[:, cols])


def gated_forward(x, ws, segs, layout: str = "fused", act: GatedActivation = SWIGLU, keep: bool = True):
    """Grouped gated MLP. x [n, H]; ws: the layout's weights, each a [G, ...] tensor or a list of G views;
    segs: (group, start, end) of the non-empty segments -> (y [n, H], pre-activations [n, 2F] (gate, up) for
    the backward, or None when ``keep`` is False: the backward then recomputes them).

    Rows past the last segment (padding) give 0. A loop over segments on CPU writing straight into the outputs
    (no zero-fill of rows that are computed anyway); one grouped GEMM call on GPU would do.
    """
    F, n = _width(layout, ws), x.shape[0]
    y = x.new_empty(n, _down(layout, ws, 0).shape[1])
    pre = x.new_empty(n, 2 * F) if keep else None
    end = 0
    for g, a, b in segs:
        pg = pre[a:b] if keep else x.new_empty(b - a, 2 * F)
        _project_in(layout, ws, g, F, x[a:b], pg)
        torch.mm(act(pg[:, :F], pg[:, F:]), _down(layout, ws, g), out=y[a:b])
        end = b
    y[end:].zero_()
    if keep:
        pre[end:].zero_()
    return y, pre


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b, the GEMM writing into ``out`` (a group's grad slot) rather than into a temporary then
    copied: on CPU the copy into a fresh grad tensor cost as much as a third of the weight-grad GEMM."""
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    else:  # grads kept in another dtype (fp32 grads of bf16 weights)
        out.copy_(a @ b)


def _segment_backward(layout, act, ws, dws, g, xs, pg, dy, dx, row_w, ys, dw_rows) -> None:
    """Backward of one segment (see ``gated_backward``): writes dws[.][g], dx and (if row_w) dw_rows."""
    F = pg.shape[1] // 2
    down = _down(layout, ws, g)
    dz = dy
    if row_w is not None:  # dy is the grad of z = y * w
        dy = dz * row_w[:, None].to(dz.dtype)
    dm = dy @ down.t()
    da = pg.new_empty(pg.shape)  # [rows, 2F]: (dgate, dup) side by side, as the pre-activations
    h, _, _ = act.value_and_grad(pg[:, :F], pg[:, F:], dm, out=da)
    if row_w is not None:  # dw = <dz, y>; y recomputed from h when the forward did not keep it
        dw_rows.copy_((dz * (h @ down if ys is None else ys)).sum(1))
    _mm_into(_down(layout, dws, g), h.t(), dy)
    for i, ((w, cols), (dw, _)) in enumerate(zip(_in_blocks(layout, ws, g, F), _in_blocks(layout, dws, g, F))):
        _mm_into(dw, xs.t(), da[:, cols])
        if i == 0:
            torch.mm(da[:, cols], w.t(), out=dx)
        else:
            dx.addmm_(da[:, cols], w.t())


def gated_backward(
    x, ws, segs, pre, dy, dws=None, layout: str = "fused", act: GatedActivation = SWIGLU, row_w=None, y=None
):
    """Grads of ``gated_forward``: (dx [n, H], dws, dw [n] or None) with dy [n, H].

    ``pre``: the forward's pre-activations, or None to recompute them per segment. ``row_w`` [n]: when given,
    ``dy`` is the grad of z = y * row_w[:, None] and dw [n] (its grad) is returned too, from ``y`` [n, H] (the
    forward's output) or, when None, from y recomputed per segment (one more down-projection GEMM).
    ``dws``: per-group outputs shaped like ``ws`` to overwrite (tensors or lists of views, any float dtype;
    default new fp32 tensors); groups without rows get 0.
    """
    F, G = _width(layout, ws), len(ws[0])
    dx = torch.empty_like(x)
    dw_rows = None if row_w is None else torch.zeros(x.shape[0], dtype=row_w.dtype, device=x.device)
    if dws is None:
        dws = [torch.empty(G, *w[0].shape, dtype=torch.float32, device=x.device) for w in ws]
    used, end = set(), 0
    for g, a, b in segs:
        if pre is None:
            pg = x.new_empty(b - a, 2 * F)
            _project_in(layout, ws, g, F, x[a:b], pg)
        else:
            pg = pre[a:b]
        w_g, y_g, dw_g = (None,) * 3 if row_w is None else (row_w[a:b], None if y is None else y[a:b], dw_rows[a:b])
        _segment_backward(layout, act, ws, dws, g, x[a:b], pg, dy[a:b], dx[a:b], w_g, y_g, dw_g)
        used.add(g)
        end = b
    dx[end:].zero_()
    for g in set(range(G)) - used:
        for dw in dws:
            dw[g].zero_()
    return dx, dws, dw_rows


def swiglu_forward(x, w13, w2, segs):
    """``gated_forward`` with SwiGLU on the fused layout: (y [n, H], a13 [n, 2F])."""
    return gated_forward(x, (w13, w2), segs)


def swiglu_backward(x, w13, w2, segs, a13, dy, dw13=None, dw2=None):
    """Grads of ``swiglu_forward``: (dx [n, H], dw13, dw2); see ``gated_backward``."""
    dx, dws, _ = gated_backward(x, (w13, w2), segs, a13, dy, None if dw13 is None else (dw13, dw2))
    return dx, dws[0], dws[1]


# ------------------------------------------------------------------------------------- the step's autograd ops
# The step is three nodes, so that its communication sits at the layer's boundaries, in a fixed order on every
# rank, and the expert math between them is pure compute: forward = (push, already done or started beside the
# token exchange) -> _ReplicaGradsHome (identity) -> _GatedCompute -> _RepushGuard (identity); the backward runs
# them in reverse: re-push if another layer used the pools since (before the compute reads them), the compute
# (slot grads into the pool), then the slot grads reduced home. Autograd runs a later-created node first among
# the ready ones, so _ReplicaGradsHome (made after dispatch) reduces before dispatch's backward moves on.


class _ReplicaGradsHome(torch.autograd.Function):
    """Identity on this rank's expert weights; backward: their replica slots' grads summed home (reduce_grad)."""

    @staticmethod
    def forward(ctx, buffer: Buffer, plan: CommPlan, pools, *weights):
        ctx.buffer, ctx.plan, ctx.pools, ctx.dtypes = buffer, plan, pools, [t.dtype for t in weights]
        return tuple(t.view_as(t) for t in weights)

    @staticmethod
    def backward(ctx, *grads):
        pools = ctx.pools
        if not ctx.plan.num_replicas:  # no replica anywhere: nothing to bring home (every rank skips alike)
            return (None, None, None) + grads
        # the incoming grads are _GatedCompute's fresh fp32 tensors, consumed only here: reduce into them in place
        own = [
            torch.zeros(p.weights.shape, dtype=torch.float32, device=p.weights.device)
            if g is None
            else g
            if g.dtype == torch.float32 and g.is_contiguous()
            else g.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            for g, p in zip(grads, pools)
        ]
        ctx.buffer.reduce_grad(ctx.plan, own, [p.grads for p in pools])
        return (None, None, None) + tuple(o.to(dt) for o, dt in zip(own, ctx.dtypes))


class _GatedCompute(torch.autograd.Function):
    """z [n, H] = gated MLP(recv rows) * recv_weights[:, None] over own weights then the pools' replica slots.
    Pure compute: the pools hold this plan's replicas (the guard nodes see to it); slot grads go into the pools."""

    @staticmethod
    def forward(ctx, plan: CommPlan, pools, layout: str, act, recompute: bool, x, w, *weights):
        views = [group_view(t.detach(), p.weights) for t, p in zip(weights, pools)]
        y, pre = gated_forward(x, views, plan.segments, layout, act, keep=not recompute)
        ctx.plan, ctx.pools, ctx.layout, ctx.act, ctx.recompute = plan, pools, layout, act, recompute
        ctx.save_for_backward(x, w, *(() if recompute else (pre, y)), *weights)
        return y * w[:, None].to(y.dtype)

    @staticmethod
    def backward(ctx, dz):
        pools = ctx.pools
        x, w, *rest = ctx.saved_tensors
        pre, y, weights = (None, None, rest) if ctx.recompute else (rest[0], rest[1], rest[2:])
        own = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in weights]
        views = [group_view(t.detach(), p.weights) for t, p in zip(weights, pools)]
        grads = [group_view(o, p.grads) for o, p in zip(own, pools)]
        dx, _, dw = gated_backward(
            x, views, ctx.plan.segments, pre, dz.contiguous(), grads, ctx.layout, ctx.act, row_w=w, y=y
        )
        return (None,) * 5 + (dx, dw) + tuple(o.to(t.dtype) for o, t in zip(own, weights))


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


def start_push(buffer: Buffer, plan: CommPlan, weights, *, layout: str = "fused", key=None) -> None:
    """Start pushing this plan's replicas into the shared pools (asynchronous: ``Buffer.prefetch_weight_start``)
    and mark the pools as the layer's; ``grouped_experts`` waits for it. The layer calls it from
    ``moonep.dispatch(..., during=...)`` so that the weights travel while the token rows do."""
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
    x,
    recv_weights,
    weights,
    *,
    layout: str = "fused",
    activation=None,
    key=None,
    recompute: bool = False,
) -> torch.Tensor:
    """The EP expert step on a dispatch's receive layout (differentiable; collective: call it on every rank).

    x [recv_rows, H] and recv_weights [recv_rows] from ``moonep.dispatch``; ``weights``: this rank's experts in
    ``layout`` (module docstring); ``activation``: act(gate, up) -> h (a ``GatedActivation`` or any callable;
    default SwiGLU). ``key``: the layer's owner key for the shared pools (default: the weights' identities,
    which are alive until this step's backward). ``recompute``: keep only x for the backward and recompute the
    [n, 2F] pre-activations and y there (the forward GEMMs once more, for n*(2F+H) fewer saved elements).
    Returns z [recv_rows, H] = expert(x) * recv_weights[:, None], ready for ``moonep.combine``.
    The replicas' weights come from ``start_push`` (started beside the token exchange) or, if the layer did not
    start it, are pushed here; the backward re-pushes them if another layer used the pools since, and reduces
    their grads home (the three autograd nodes above).
    """
    weights = tuple(weights)
    check_weights(layout, weights, buffer.epn, x.shape[-1])
    key = _key(key, weights)
    pools = pools_of(buffer, weights, layout)
    ensure_replicas(buffer, plan, key, pools, weights)
    for pool in pools:
        pool.wait()
    own = _ReplicaGradsHome.apply(buffer, plan, pools, *weights)
    z = _GatedCompute.apply(plan, pools, layout, as_activation(activation), recompute, x, recv_weights, *own)
    return _RepushGuard.apply(buffer, plan, key, pools, weights, z)


class GroupedExperts:
    """moonep.MoE's call: ``apply(buffer, plan, key, x, w, w13, w2)`` is ``grouped_experts`` (fused, SwiGLU)."""

    @staticmethod
    def apply(buffer: Buffer, plan: CommPlan, key: object, x, w, w13, w2) -> torch.Tensor:
        return grouped_experts(buffer, plan, x, w, (w13, w2), key=key)
