"""The EP step: the one implementation of push -> dispatch -> grouped expert step -> combine -> grad reduce.

Axes: ``T`` tokens on this rank (s), ``H`` the rows' width, ``K`` top-k, ``N`` = recv_rows receive rows,
``epn`` experts per rank; local tensors carry them as suffixes (``x_TH``, ``z_NH``).

``routed_experts`` runs a whole MoE layer's routed part: every caller with the whole step in one place
(``moonep.MoE``, k3's ``LatentMoE``, the Hugging Face integration) calls it. Frameworks that put their own code
between the phases (torchtitan's ``RoutedExperts`` = token dispatcher + inner experts; Megatron's token-dispatcher
protocol) call the phases, in this order, and nothing else:

1. ``ep_dispatch``: the layout step (``Buffer.get_dispatch_layout``: the plan and the one host read), the
   rows moved along it, then the replica weight push started when the caller passes its weights
   (``start_push``); returns ``EPRows``;
2. ``ep_experts``: the grouped expert step on the receive layout: this rank's own experts first, while the
   replica weights are in flight, then the replica slots (it pushes the replicas itself when the dispatch did
   not); its backward re-pushes them if another layer used the shared pools since, computes the replica slots
   first and sends their grads home while it computes its own experts' backward;
3. ``ep_combine``: the rows home, a token's K copies summed (the routing weights were applied on the expert
   side).

All three are differentiable and collective: every rank of the EP group calls them in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moonep.autograd import combine, dispatch
from moonep.buffer import Buffer
from moonep.comm_plan import CommPlan
from moonep.experts import grouped_experts, start_push


@dataclass(frozen=True)
class EPRows:
    """What one call's dispatch delivered on this rank: the receive rows and the plan that laid them out."""

    buffer: Buffer
    """the EP group's Buffer that dispatched them."""
    plan: CommPlan
    """the step's plan (combine, the expert step and the backward reuse it)."""
    rows: torch.Tensor
    """[N, H] received rows, grouped by (own expert, then replica slot), padded per segment."""
    weights: torch.Tensor | None
    """[N] fp32 routing weight of each received row (0 on padding); None when dispatched without weights."""
    cu_seqlens: torch.Tensor
    """[2*epn] int64 padded segment ends (``plan.cu_host`` holds the host copy)."""


def ep_dispatch(
    buffer: Buffer,
    x: torch.Tensor,
    *,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None = None,
    weights=None,
    layout: str = "fused",
    key=None,
    total_num_tokens: int | None = None,
) -> EPRows:
    """Phase 1 of the EP step: plan the dispatch (its one host read), move the rows, start the replica push.

    Args:
        buffer: the EP group's ``Buffer``.
        x: [T, H] activations in the Buffer's dtype, on its device.
        topk_idx: [T, K] integer expert ids in [0, E), -1 = no expert.
        topk_weights: [T, K] float routing weights, or None.
        weights: this rank's experts in ``layout`` ([epn, ...] tensors), to start the replica push once the
            token rows landed, so that it flies while the expert step computes this rank's own experts
            (measured: rows first pays more than the push first on the op timer: the rows are what the expert
            step needs first); None: ``ep_experts`` pushes them when it needs them.
        layout: ``"fused"`` or ``"linear"`` (``routed_experts``).
        key: the layer's owner key for the shared replica pools.
        total_num_tokens: sum of T over the ranks (None: inferred).

    Returns:
        ``EPRows``: rows [N, H] (Buffer dtype), weights [N] fp32 or None, cu_seqlens [2*epn] int64, the plan.
    """
    planned = buffer.get_dispatch_layout(
        x, topk_idx=topk_idx, topk_weights=topk_weights, total_num_tokens=total_num_tokens
    )
    recv, recv_w, cu, plan = dispatch(buffer, x, topk_idx=topk_idx, topk_weights=topk_weights, layout=planned)
    if weights is not None:  # the replica weights travel while the expert step computes this rank's own experts
        start_push(buffer, plan, tuple(weights), layout=layout, key=key)
    return EPRows(buffer, plan, recv, recv_w, cu)


def ep_experts(
    rows: EPRows,
    weights,
    *,
    x: torch.Tensor | None = None,
    layout: str = "fused",
    activation=None,
    key=None,
    recompute: bool = False,
) -> torch.Tensor:
    """Phase 2 of the EP step: the grouped expert step on ``rows`` (``moonep.grouped_experts``).

    Args:
        rows: ``ep_dispatch``'s result.
        weights: this rank's experts in ``layout`` ([epn, ...] tensors, see ``routed_experts``).
        x: [N, H] the received rows as a framework hands them to its experts (default ``rows.rows``).
        layout, activation, key, recompute: as ``routed_experts``.

    Returns:
        z: [N, H] = expert(rows) * row weight, in the rows' dtype (padding rows 0).
    """
    if rows.weights is None:  # the expert side applies the routing weights: it needs them
        raise ValueError("ep_experts: the rows were dispatched without topk_weights; pass them to ep_dispatch")
    return grouped_experts(
        rows.buffer,
        rows.plan,
        rows.rows if x is None else x,
        rows.weights,
        tuple(weights),
        layout=layout,
        activation=activation,
        key=key,
        recompute=recompute,
    )


def ep_combine(rows: EPRows, z: torch.Tensor) -> torch.Tensor:
    """Phase 3 of the EP step: the rows home, each token's K copies summed.

    Args:
        rows: ``ep_dispatch``'s result.
        z: [N, H] expert output in ``rows``' layout, already weighted.

    Returns:
        y: [T, H] in the Buffer's dtype.
    """
    return combine(rows.buffer, rows.plan, z)


def routed_experts(
    buffer: Buffer,
    x: torch.Tensor,
    *,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights,
    layout: str = "fused",
    activation=None,
    key=None,
    recompute: bool = False,
    total_num_tokens: int | None = None,
) -> tuple[torch.Tensor, CommPlan]:
    """One MoE layer's routed experts, expert-parallel (differentiable; collective: every rank calls it).

    Args:
        buffer: the EP group's ``Buffer``.
        x: [T, H] activations in the Buffer's dtype, on its device.
        topk_idx: [T, K] integer expert ids in [0, E), -1 = no expert.
        topk_weights: [T, K] float routing weights (fp32 recommended).
        weights: this rank's experts in ``layout``: ``"fused"``: w13 [epn, H, 2F], w2 [epn, F, H];
            ``"linear"``: w1 [epn, F, H], w3 [epn, F, H], w2 [epn, H, F].
        layout: ``"fused"`` or ``"linear"``.
        activation: act(gate, up) -> h on [N, F] (a ``GatedActivation`` or any callable; default SwiGLU).
        key: the layer's owner key for the shared replica pools (default: the weights' identities).
        recompute: save only the rows for the expert backward (recompute the rest there).
        total_num_tokens: sum of T over the ranks (None: inferred).

    Returns:
        ``(y, plan)``: y [T, H] in the Buffer's dtype = sum over k of topk_weights[:, k] *
        expert_{topk_idx[:, k]}(x); plan: the step's ``CommPlan``.
    """
    weights = tuple(weights)
    rows = ep_dispatch(
        buffer,
        x,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        weights=weights,
        layout=layout,
        key=key,
        total_num_tokens=total_num_tokens,
    )
    z_NH = ep_experts(rows, weights, layout=layout, activation=activation, key=key, recompute=recompute)
    return ep_combine(rows, z_NH), rows.plan


__all__ = ["EPRows", "ep_combine", "ep_dispatch", "ep_experts", "routed_experts"]
