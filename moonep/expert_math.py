"""The grouped gated MLP of the expert step, as pure compute on the dispatch layout (no communication).

Axes: ``n`` rows, ``H`` hidden, ``F`` expert FFN size, ``G`` groups. Per group g on its rows x:
``y = act(x @ gate_g, x @ up_g) @ down_g``. ``act`` is any gated activation ``act(gate [n, F], up [n, F]) -> h``
(``SWIGLU`` by default, with its closed-form derivative; K3 passes SiTU-GLU with its betas). Two weight layouts,
both read through per-group views (no copies):

- ``"fused"`` (in x out, moonep.MoE): ``w13 [G, H, 2F]`` (gate and up side by side), ``w2 [G, F, H]``;
- ``"linear"`` (nn.Linear style, HF / K3): ``w1 [G, F, H]`` (gate), ``w3 [G, F, H]`` (up), ``w2 [G, H, F]``.

``moonep.experts`` runs this between the step's collectives; the classic baseline runs it on its own layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as Fn

from moonep.comm_plan import segments_of


def segments(cu: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
    """(group, start, end) of the non-empty segments of cu_seqlens [G] (reads cu: for callers without a
    CommPlan, whose ``segments`` came with the step's one host read)."""
    return segments_of(cu.tolist())


# ----------------------------------------------------------------------------------------- gated activations
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""act(gate [n, F], up [n, F]) -> h [n, F], elementwise."""


@dataclass(frozen=True)
class GatedActivation:
    """A gated activation ``h = fn(gate, up)`` on [n, F] tensors, with an optional explicit derivative."""

    fn: Activation
    """(gate [n, F], up [n, F]) -> h [n, F], elementwise."""
    grad: Callable | None = None
    """(gate, up, dh, out [n, 2F]) -> h, writing (dgate, dup) into out's two halves; None: autograd through
    ``fn`` (elementwise, small)."""

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.fn(gate, up)

    def value_and_grad(self, gate, up, dh):
        """(h, dgate, dup) at (gate, up) for the upstream grad dh [n, F]."""
        F = gate.shape[1]
        out = gate.new_empty(gate.shape[0], 2 * F)
        return self.grad_into(gate, up, dh, out), out[:, :F], out[:, F:]

    def grad_into(self, gate, up, dh, out: torch.Tensor) -> torch.Tensor:
        """h at (gate, up), with (dgate, dup) written side by side into ``out`` [n, 2F]: the backward's
        weight-grad GEMM reads them as one matrix."""
        if self.grad is not None:
            return self.grad(gate, up, dh, out)
        g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
        with torch.enable_grad():
            h = self.fn(g, u)
            dgate, dup = torch.autograd.grad(h, (g, u), dh)
        torch.cat((dgate, dup), dim=1, out=out)
        return h.detach()


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


def as_activation(act: GatedActivation | Activation | None) -> GatedActivation:
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
    want = [(epn, H, 2 * F), (epn, F, H)] if layout == "fused" else [(epn, F, H), (epn, F, H), (epn, H, F)]
    got = [tuple(t.shape) for t in weights]
    if got != want:
        raise ValueError(f"{layout} weights {names} must be {want} for hidden size {H}, got {got}")


# --------------------------------------------------------------------------------------------- grouped math
def _project_in(layout: str, ws, g: int, F: int, xs: torch.Tensor, out: torch.Tensor) -> None:
    """out [rows, 2F] = (gate, up) pre-activations of group g on xs [rows, H]."""
    for w, cols in _in_blocks(layout, ws, g, F):
        torch.mm(xs, w, out=out[:, cols])


@dataclass(frozen=True)
class GroupHook:
    """A call the grouped math makes at a group boundary (the math itself knows nothing of what it does).

    ``gated_forward`` calls ``fn`` just before the first segment of any group in ``groups`` (the EP step waits
    there for the replica weights still in flight, computing its own experts meanwhile); ``gated_backward``
    calls it once every group in ``groups`` has its weight grads written (the step starts sending the replica
    grads home there, and computes its own experts' backward meanwhile)."""

    groups: frozenset
    """the group indices the hook is about."""
    fn: Callable[[], None]
    """called once, with no arguments."""


def gated_forward(
    x, ws, segs, layout: str = "fused", act: GatedActivation = SWIGLU, keep: bool = True, hook: GroupHook | None = None
):
    """Grouped gated MLP. x [n, H]; ws: the layout's weights, each a [G, ...] tensor or a list of G views;
    segs: (group, start, end) of the non-empty segments -> (y [n, H], pre-activations [n, 2F] (gate, up) for
    the backward, or None when ``keep`` is False: the backward then recomputes them). hook: ``GroupHook``.

    Rows past the last segment (padding) give 0. A loop over segments on CPU writing straight into the outputs
    (no zero-fill of rows that are computed anyway); one grouped GEMM call on GPU would do.
    """
    F, n = _width(layout, ws), x.shape[0]
    y = x.new_empty(n, _down(layout, ws, 0).shape[1])
    pre = x.new_empty(n, 2 * F) if keep else None
    end = 0
    for g, a, b in segs:
        if hook is not None and g in hook.groups:
            hook.fn()
            hook = None
        pg = pre[a:b] if pre is not None else x.new_empty(b - a, 2 * F)  # pre is None unless keep
        _project_in(layout, ws, g, F, x[a:b], pg)
        torch.mm(act(pg[:, :F], pg[:, F:]), _down(layout, ws, g), out=y[a:b])
        end = b
    if hook is not None:
        hook.fn()
    y[end:].zero_()
    if pre is not None:
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
    h = act.grad_into(pg[:, :F], pg[:, F:], dm, da)
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
    x,
    ws,
    segs,
    pre,
    dy,
    dws=None,
    layout: str = "fused",
    act: GatedActivation = SWIGLU,
    row_w=None,
    y=None,
    hook: GroupHook | None = None,
    zeroed: frozenset = frozenset(),
):
    """Grads of ``gated_forward``: (dx [n, H], dws, dw [n] or None) with dy [n, H].

    ``pre``: the forward's pre-activations, or None to recompute them per segment. ``row_w`` [n]: when given,
    ``dy`` is the grad of z = y * row_w[:, None] and dw [n] (its grad) is returned too, from ``y`` [n, H] (the
    forward's output) or, when None, from y recomputed per segment (one more down-projection GEMM).
    ``dws``: per-group outputs shaped like ``ws`` to overwrite (tensors or lists of views, any float dtype;
    default new fp32 tensors); groups without rows get 0, except those in ``zeroed`` (the caller keeps them at 0
    already: the EP step's replica slots, zeroed by each reduce). hook: a ``GroupHook``, whose groups' segments
    are computed first (the others after its call).
    """
    F, G = _width(layout, ws), len(ws[0])
    dx = torch.empty_like(x)
    dw_rows = None if row_w is None else torch.zeros(x.shape[0], dtype=row_w.dtype, device=x.device)
    if dws is None:
        dws = [torch.empty(G, *w[0].shape, dtype=torch.float32, device=x.device) for w in ws]
    for g in set(range(G)) - {sg[0] for sg in segs} - zeroed:  # first: a hook may read them
        for dw in dws:
            dw[g].zero_()
    if hook is not None:
        segs = [sg for sg in segs if sg[0] in hook.groups] + [sg for sg in segs if sg[0] not in hook.groups]
    end, left = 0, None if hook is None else {sg[0] for sg in segs} & hook.groups
    for g, a, b in segs:
        if hook is not None and not left:
            hook.fn()
            hook = None
        if pre is None:
            pg = x.new_empty(b - a, 2 * F)
            _project_in(layout, ws, g, F, x[a:b], pg)
        else:
            pg = pre[a:b]
        if row_w is None or dw_rows is None:  # dw_rows exists exactly when row_w is given
            w_g, y_g, dw_g = None, None, None
        else:
            w_g, y_g, dw_g = row_w[a:b], None if y is None else y[a:b], dw_rows[a:b]
        _segment_backward(layout, act, ws, dws, g, x[a:b], pg, dy[a:b], dx[a:b], w_g, y_g, dw_g)
        end = max(end, b)
        if left:
            left.discard(g)
    if hook is not None:
        hook.fn()
    dx[end:].zero_()
    return dx, dws, dw_rows


def swiglu_forward(x, w13, w2, segs):
    """``gated_forward`` with SwiGLU on the fused layout: (y [n, H], a13 [n, 2F])."""
    return gated_forward(x, (w13, w2), segs)


def swiglu_backward(x, w13, w2, segs, a13, dy, dw13=None, dw2=None):
    """Grads of ``swiglu_forward``: (dx [n, H], dw13, dw2); see ``gated_backward``."""
    dx, dws, _ = gated_backward(x, (w13, w2), segs, a13, dy, None if dw13 is None else (dw13, dw2))
    return dx, dws[0], dws[1]
