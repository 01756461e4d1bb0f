"""``plan``: the perfectly balanced expert-parallel plan of one MoE layer's step.

Axes: ``R`` ranks, ``E`` experts, ``epn = E / R`` experts owned per rank (rank r owns experts
``[r*epn, (r+1)*epn)``), ``K`` top-k, ``s`` tokens on one rank. The theorem, its assumptions and its proof are in
``planner/README.md``; ``planner.verify`` re-checks every guarantee of a plan independently. Numpy counts give a
``Plan`` (``planner.tables``), tensor counts a ``TensorPlan`` on their device (``planner.device``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, overload

import numpy as np

from planner._inputs import as_counts, check_shape, is_tensor, positive_int, topology_nodes
from planner.device import host_plan, plan_tensor
from planner.slack import CostModel, check_options
from planner.tables import Plan, make_plan, raise_error
from planner.tensor_plan import TensorPlan

if TYPE_CHECKING:
    import torch


@overload
def plan(
    slots_per_expert: torch.Tensor,
    *,
    caps: Any = ...,
    slots_per_rank: int | None = ...,
    token_padding: int = ...,
    previous: Plan | TensorPlan | None = ...,
    topology: None = ...,
    slack: float | None = ...,
    cost: CostModel | None = ...,
    defer_errors: bool = ...,
) -> TensorPlan: ...


@overload
def plan(
    slots_per_expert: Any,
    *,
    caps: Any = ...,
    slots_per_rank: int | None = ...,
    token_padding: int = ...,
    previous: Plan | None = ...,
    topology: Any = ...,
    slack: float | None = ...,
    cost: CostModel | None = ...,
    defer_errors: bool = ...,
) -> Plan: ...


def plan(
    slots_per_expert: Any,
    *,
    caps: Any = None,
    slots_per_rank: int | None = None,
    token_padding: int = 1,
    previous: Plan | TensorPlan | None = None,
    topology: Any = None,
    slack: float | None = None,
    cost: CostModel | None = None,
    defer_errors: bool = False,
) -> Plan | TensorPlan:
    """Plan one MoE layer's step so that every rank computes exactly ``caps[r]`` routed rows.

    slots_per_expert: [R, E] non-negative integer counts (numpy or a list: a ``Plan``; a torch integer tensor
        on any device: a ``planner.device.TensorPlan`` on that device, made without a host copy — on CUDA by
        the numba-cuda kernel); E % R == 0.
    caps: [R] rows per rank summing to the total; default floor/ceil of total / R (first total % R ranks +1).
    slots_per_rank: replica slots per rank, default epn (the bound that makes every plan fit).
    token_padding: segments are padded to multiples of this (the grouped-GEMM tile).
    previous: last step's plan of the same shape: keep its (donor, receiver) pairs and replicas where the
        exact balance allows (sticky plan: fewer expert weights move).
    topology: ``ranks_per_node`` int or an object with num_nodes, ranks_per_node, node_of(rank) (optional
        weight_rows: an expert copy's cost in routed rows, default 3*2048): first each node's deficits
        gathered on few ranks, then the cross-node pairs whose locally fed rows outweigh their weight copies
        (taking only the rows that pay), then pairs inside a node, then a short node's leftover deficits
        gathered, each filled by the donor whose experts its node feeds best; the same without the first
        gathering, and with it again pricing a copy at 1.25 weight_rows, keeping the plan with the fewest
        inter-node bytes; each destination is fed by its own rank's, then its own node's sources first.
        Host planner only: a tensor of counts with a topology is refused.
    slack: σ >= 0: every rank computes at most ``ceil((1 + σ) * total / R)`` rows (``slack.row_bound``), with
        replicas only where that bound needs them (``planner.slack``; the README's theorem with slack).
        None (or 0) is the exact plan, bit for bit. Exclusive with ``caps`` and ``cost``.
    cost: a ``CostModel``: plans ``cost.candidates`` slacks from 0 to ``cost.max_slack`` and keeps the one with
        the least predicted layer time ``max_d(rows_d * row_seconds + copies_d * copy_seconds)`` (the exact plan
        on ties); down to no replicas when the routing is already balanced. Exclusive with ``caps``.
    defer_errors: tensor counts only: leave an invalid plan's error in ``TensorPlan.err`` instead of raising
        (raising reads the device; a caller that reads the plan's tables anyway checks ``err`` in that read).
    """
    num = check_options(slack, cost, caps)
    if is_tensor(slots_per_expert):
        return _plan_tensor(
            slots_per_expert, caps, slots_per_rank, token_padding, previous, topology, defer_errors, num, cost
        )
    T = as_counts(slots_per_expert, "slots_per_expert", 2, check_sign=False)  # the kernel checks signs
    R, E, epn = check_shape(T)
    slots = epn if slots_per_rank is None else positive_int(slots_per_rank, "slots_per_rank")
    pad = positive_int(token_padding, "token_padding")
    caps_in = np.zeros(0, np.int64) if caps is None else as_counts(caps, "caps", 1)
    if caps_in.size and caps_in.shape[0] != R:
        raise ValueError(f"caps must have shape [R]=[{R}], got {tuple(caps_in.shape)}")
    prev_donor, prev_copy = np.zeros(0, np.int64), np.zeros((0, slots), np.int64)
    if previous is not None:
        if not isinstance(previous, Plan):
            raise ValueError(f"previous must be a Plan, got {type(previous).__name__}")
        _check_previous(previous, E, R, slots)
        prev_donor, prev_copy = previous.donor, previous.experts_to_copy
    node, num_nodes, weight_rows = np.zeros(0, np.int64), 0, 0
    if topology is not None:
        node, num_nodes, weight_rows = topology_nodes(topology, R)
    out = host_plan(T, caps_in, slots, pad, prev_donor, prev_copy, node, num_nodes, weight_rows, num, cost)
    counts, caps_out, alloc, donor, copy, cu, send, flows, err = out  # counts: the kernel's copy of T
    raise_error(err, slots)
    return make_plan(counts, caps_out, alloc, donor, copy, send, cu, flows, pad, epn)


def _plan_tensor(T, caps, slots_per_rank, token_padding, previous, topology, defer_errors, num, cost):
    """``plan`` for tensor counts: checks that need no tensor data here, the rest in the kernel's ``err``."""
    if T.dim() != 2:
        raise ValueError(f"slots_per_expert must be 2-D [R, E], got shape {tuple(T.shape)}")
    if T.dtype.is_floating_point or T.dtype.is_complex or str(T.dtype) == "torch.bool":
        raise ValueError(f"slots_per_expert as a tensor must hold integer counts, got dtype {T.dtype}")
    R, E, epn = check_shape(np.empty(tuple(T.shape), np.int8))
    slots = epn if slots_per_rank is None else positive_int(slots_per_rank, "slots_per_rank")
    pad = positive_int(token_padding, "token_padding")
    if topology is not None:
        raise ValueError("topology-aware plans run on the host planner: pass the counts as a numpy array")
    if caps is not None:
        caps = as_counts(caps, "caps", 1)
        if caps.shape[0] != R:
            raise ValueError(f"caps must have shape [R]=[{R}], got {tuple(caps.shape)}")
    if previous is not None:
        _check_previous(previous, E, R, slots)
    return plan_tensor(T, caps, slots, pad, previous, defer_errors, num, cost)


def _check_previous(previous: Plan | TensorPlan, E: int, R: int, slots: int) -> None:
    """A sticky plan's previous plan must have this plan's shape (E experts, R ranks, slots per rank)."""
    if tuple(previous.alloc.shape) != (E, R) or previous.slots_per_rank != slots:
        raise ValueError(
            f"previous plan has shape E={previous.num_experts}, R={previous.num_ranks}, "
            f"slots={previous.slots_per_rank}; this plan needs E={E}, R={R}, slots={slots}"
        )


__all__ = ["CostModel", "Plan", "plan"]
