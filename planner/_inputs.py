"""Input conversion and validation shared by ``plan``, ``verify`` and ``rebalance_experts``.

Accepts numpy arrays, nested lists and torch tensors (CPU or CUDA). torch is never imported here: a tensor is
recognised by its ``detach``/``cpu``/``numpy`` methods, so numpy callers do not pay for the torch import.
"""

from __future__ import annotations

from typing import Any

import numpy as np

INT32_MAX = 2**31 - 1
"""the largest entry of the plan's int32 tables (``slots_per_expert``, ``alloc``)."""


def expert_total_message(expert: int, total: int) -> str:
    """The error of an expert whose routed slots over all ranks overflow the int32 ``alloc`` table: every kernel
    (CPU, device, the reference twin) refuses it before stage B, whose arithmetic on a wrapped entry never ends."""
    return (
        f"expert {expert} has {total} routed slots summed over all ranks: "
        f"more than the planner's int32 tables hold (2**31 - 1)"
    )


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor (recognised without importing torch)."""
    return hasattr(x, "detach") and hasattr(x, "cpu") and hasattr(x, "numpy") and hasattr(x, "device")


def to_numpy(x: Any) -> np.ndarray:
    """Array view of ``x``; torch tensors (any device) are detached and copied to host memory."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu") and hasattr(x, "numpy"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def as_counts(x: Any, name: str, ndim: int, check_sign: bool = True) -> np.ndarray:
    """Validate non-negative integer counts with ``ndim`` dimensions -> C-contiguous int64 array.

    Floating inputs are accepted only when every value is a whole number (e.g. counts summed in float).
    """
    shape = "[R, E]" if ndim == 2 else "[R]"
    try:
        a = to_numpy(x)
    except ValueError:  # numpy's "inhomogeneous shape": nested lists of unequal lengths
        raise ValueError(f"{name} must be {ndim}-D {shape} with rows of equal length") from None
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {shape}, got shape {tuple(a.shape)}")
    if a.dtype == np.bool_ or not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        raise ValueError(f"{name} must hold integer counts, got dtype {a.dtype}")
    floating = np.issubdtype(a.dtype, np.floating)
    if floating and a.size and not (np.all(np.isfinite(a)) and np.all(a == np.floor(a))):
        raise ValueError(f"{name} must hold integer counts, got non-integer values")
    if floating and a.size and np.abs(a).max() >= 2.0**63:  # the int64 cast below would wrap it
        idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(np.abs(a))), a.shape))
        raise ValueError(f"{name} must hold counts below 2**63, got {a[idx]:g} at index {idx}")
    out = np.ascontiguousarray(a, dtype=np.int64)
    if check_sign and out.size and out.min() < 0:
        idx = tuple(int(i) for i in np.unravel_index(int(np.argmin(out)), out.shape))
        raise ValueError(f"{name} must be non-negative, got {int(out[idx])} at index {idx}")
    return out


def check_shape(T: np.ndarray) -> tuple[int, int, int]:
    """(R, E, epn) of a counts matrix; E must be a positive multiple of R."""
    R, E = T.shape
    if R < 1 or E < 1:
        raise ValueError(f"slots_per_expert must have at least one rank and one expert, got shape {(R, E)}")
    if E % R != 0:
        raise ValueError(f"number of experts E={E} must be a multiple of the number of ranks R={R} (E % R != 0)")
    return R, E, E // R


def positive_int(value: Any, name: str) -> int:
    """``value`` as a positive Python int, or ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def default_caps(total: int, R: int) -> list[int]:
    """[R] the planner's default caps: floor/ceil of total / R, the first ``total % R`` ranks one more."""
    return [total // R + (1 if r < total % R else 0) for r in range(R)]


def caps_for(caps: Any, total: int, R: int) -> list[int]:
    """Caller caps checked against the load (shape [R], sum = total), or ``default_caps``; ValueError else."""
    if caps is None:
        return default_caps(total, R)
    caps = [int(c) for c in np.asarray(caps).reshape(-1).tolist()]
    if len(caps) != R:
        raise ValueError(f"caps must have shape [R]=[{R}], got {len(caps)} values")
    if sum(caps) != total:
        raise ValueError(f"caps must sum to the total routed slots: sum(caps)={sum(caps)}, total={total}")
    return caps


TOPOLOGY_CANDIDATES = ((0, True), (0, False), (1, True))
"""Stage B's candidates with a topology, in the order tried: (copy margin, gather first). Margin 0 takes a
cross-node copy when the rows it saves outweigh ``weight_rows``, margin 1 only beyond ``1.25 * weight_rows``
(quarters of ``weight_rows``); the cheapest finished plan at the true price is kept. The fourth pair,
(1, False), is left out: on the bench's 21 topology rows it moved 4 by at most 0.003 of the plain plan's
bytes, for a third more latency (planner/README.md). Read by the kernel and its twin."""

WEIGHT_ROWS = 3 * 2048
"""default cost of one expert weight copy in routed rows: a bf16 gate/up/down FFN (3 x H x H') weighs as
much as 3*H' rows of H bf16 values, whatever H is; H' = 2048 as in the bench's bytes model."""


def topology_nodes(topology: Any, R: int) -> tuple[np.ndarray, int, int]:
    """(node [R], num_nodes, weight_rows) from a topology object or a plain ``ranks_per_node`` int.

    The object only needs ``num_nodes``, ``ranks_per_node`` and ``node_of(rank)`` (duck-typed, so
    ``collectives.Topology`` fits without importing it); an optional ``weight_rows`` (non-negative int)
    overrides the cost of one expert weight copy in routed rows (default ``WEIGHT_ROWS``).
    """
    weight_rows = getattr(topology, "weight_rows", WEIGHT_ROWS)
    if isinstance(weight_rows, bool) or not isinstance(weight_rows, (int, np.integer)) or weight_rows < 0:
        raise ValueError(f"topology.weight_rows must be a non-negative integer, got {weight_rows!r}")
    if isinstance(topology, bool) or not isinstance(topology, (int, np.integer)):
        node, num_nodes = _object_nodes(topology, R)
    else:
        rpn = positive_int(topology, "topology (ranks_per_node)")
        if R % rpn != 0:
            raise ValueError(f"topology: ranks_per_node={rpn} does not divide R={R}")
        node = np.arange(R, dtype=np.int64) // rpn
        num_nodes = R // rpn
    return node, int(num_nodes), int(weight_rows)


def _object_nodes(topology: Any, R: int) -> tuple[np.ndarray, int]:
    """(node [R] int64, num_nodes) of a topology object: num_nodes, ranks_per_node, node_of(rank)."""
    for attr in ("num_nodes", "ranks_per_node", "node_of"):
        if not hasattr(topology, attr):
            raise ValueError(
                f"topology must be an int (ranks_per_node) or have num_nodes, ranks_per_node "
                f"and node_of(rank); {type(topology).__name__} lacks {attr}"
            )
    num_nodes = positive_int(topology.num_nodes, "topology.num_nodes")
    rpn = positive_int(topology.ranks_per_node, "topology.ranks_per_node")
    if num_nodes * rpn != R:
        raise ValueError(
            f"topology has {num_nodes} nodes x {rpn} ranks = {num_nodes * rpn} ranks, but slots_per_expert has R={R}"
        )
    node = np.array([int(topology.node_of(r)) for r in range(R)], dtype=np.int64)
    if node.min() < 0 or node.max() >= num_nodes:
        raise ValueError(f"topology.node_of returned a node outside [0, {num_nodes})")
    return node, num_nodes
