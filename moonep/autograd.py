"""``moonep.dispatch`` / ``moonep.combine``: differentiable dispatch and combine.

Backward of dispatch = combine of the gradients (a token's K copies' grads are summed home; the routing
weights' grads are gathered per slot). Backward of combine = re-dispatch of the output grad with the saved
plan (no planning, no side table). Gradients flow to ``hidden`` and ``topk_weights``; ``topk_idx`` is an
integer input and has none.
"""

from __future__ import annotations

import torch

from moonep.buffer import Buffer
from moonep.comm_plan import CommPlan


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, buffer: Buffer, holder: list, hidden, topk_weights, topk_idx, slots_per_expert, total_num_tokens, layout
    ):
        recv, recv_w, cu, plan = buffer.dispatch(
            hidden,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            slots_per_expert=slots_per_expert,
            total_num_tokens=total_num_tokens,
            layout=layout,
        )
        holder.append(plan)  # the plan is not a tensor: hand it out through the holder
        ctx.buffer, ctx.plan, ctx.has_w = buffer, plan, topk_weights is not None
        ctx.mark_non_differentiable(cu)
        return recv, recv_w, cu

    @staticmethod
    def backward(ctx, grad_recv, grad_w, _grad_cu):
        buf, plan = ctx.buffer, ctx.plan
        if grad_recv is None:
            grad_recv = torch.zeros(plan.recv_rows, buf.H, dtype=buf.dtype, device=buf.device)
        gw = None
        if ctx.has_w:
            gw = grad_w if grad_w is not None else torch.zeros(plan.recv_rows, device=buf.device)
        # the backward runs after later dispatches of a shared Buffer (other layers, micro-batches)
        grad_x, grad_tw = buf.combine(plan, grad_recv.contiguous(), gw, any_step=True)
        return None, None, grad_x, grad_tw, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer: Buffer, plan: CommPlan, expert_out):
        out, _ = buffer.combine(plan, expert_out)
        ctx.buffer, ctx.plan = buffer, plan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_rows, _, _, _ = ctx.buffer.redispatch(ctx.plan, grad_out.contiguous(), any_step=True)
        return None, None, grad_rows


def dispatch(
    buffer: Buffer,
    hidden: torch.Tensor,
    *,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None = None,
    slots_per_expert: torch.Tensor | None = None,
    total_num_tokens: int | None = None,
    layout=None,
):
    """Differentiable ``Buffer.dispatch`` (``layout``: this call's ``Buffer.get_dispatch_layout``, or None).

    hidden [s, H]; keyword-only, in DeepEP's order: topk_idx [s, K] (-1 = no expert), topk_weights [s, K]
    (or None).
    Returns (recv_hidden [recv_rows, H], recv_weights [recv_rows] | None, cu_seqlens [2*epn], plan).
    """
    holder: list = []
    recv, recv_w, cu = _Dispatch.apply(
        buffer, holder, hidden, topk_weights, topk_idx, slots_per_expert, total_num_tokens, layout
    )
    return recv, recv_w, cu, holder[0]


def combine(buffer: Buffer, plan: CommPlan, expert_out: torch.Tensor) -> torch.Tensor:
    """Differentiable ``Buffer.combine``: expert_out [recv_rows, H] -> out [s, H], the UNWEIGHTED sum of K copies."""
    return _Combine.apply(buffer, plan, expert_out)
