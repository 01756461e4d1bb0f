"""``moonep.dispatch`` / ``moonep.combine``: differentiable dispatch and combine.

Backward of dispatch = combine of the gradients (a token's K copies' grads are summed home; the routing
weights' grads are gathered per slot). Backward of combine = re-dispatch of the output grad with the saved
plan (no planning, no side table). Gradients flow to ``hidden`` and ``topk_weights``; ``topk_idx`` is an
integer input and has none.
"""

from __future__ import annotations

import torch

from moonep.buffer import Buffer
from moonep.comm_plan import CommPlan, DispatchLayout


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
    layout: DispatchLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, CommPlan]:
    """Differentiable ``Buffer.dispatch``: its backward combines the rows' grads home (a token's K copies
    summed) and gathers the routing weights' grads per slot. Collective: every rank of the EP group calls it.

    Args:
        buffer: the EP group's ``Buffer``.
        hidden: [T, H] activations in the Buffer's dtype (bf16/fp32/...), on its device.
        topk_idx: [T, K] integer expert ids in [0, E), -1 = no expert (no gradient).
        topk_weights: [T, K] float routing weights, or None (then recv_weights is None).
        slots_per_expert: [E] integer histogram of topk_idx (optional; checked against it).
        total_num_tokens: sum of T over the ranks (None: inferred).
        layout: this call's ``Buffer.get_dispatch_layout`` of the same arguments, or None (planned here).

    Returns:
        ``(recv_hidden, recv_weights, cu_seqlens, plan)``: recv_hidden [N, H] (Buffer dtype, N =
        ``plan.recv_rows``) grouped by (own expert, then replica slot) and padded per segment; recv_weights [N]
        fp32 or None; cu_seqlens [2*epn] int64 segment ends (not differentiable); plan: the step's ``CommPlan``.
    """
    holder: list = []
    recv, recv_w, cu = _Dispatch.apply(
        buffer, holder, hidden, topk_weights, topk_idx, slots_per_expert, total_num_tokens, layout
    )
    return recv, recv_w, cu, holder[0]


def combine(buffer: Buffer, plan: CommPlan, expert_out: torch.Tensor) -> torch.Tensor:
    """Differentiable ``Buffer.combine``: every row home, a token's K copies summed UNWEIGHTED (the expert side
    applied the routing weights); its backward re-dispatches the output grad along the saved plan.

    Args:
        buffer: the Buffer that dispatched the rows.
        plan: that dispatch's ``CommPlan``.
        expert_out: [N, H] rows in the dispatch layout (N = ``plan.recv_rows``), in the Buffer's dtype.

    Returns:
        out: [T, H] in the Buffer's dtype, T = ``plan.num_tokens``.
    """
    return _Combine.apply(buffer, plan, expert_out)
