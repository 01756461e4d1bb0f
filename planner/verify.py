"""``verify``: re-derive every guarantee of a plan from the counts alone, and raise on any breach.

Independent of how the plan was built: it recomputes loads, donors, slots, layout and the routing bijection
with plain numpy, so it also checks plans that were edited, deserialised or produced by another planner.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from planner._inputs import as_counts
from planner.slack import row_bound
from planner.tables import Plan


class PlanVerificationError(AssertionError):
    """A plan breaks one of the planner's guarantees (the message names which one)."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise PlanVerificationError(message)


def _check_loads(plan: Plan, T: np.ndarray) -> None:
    """Exact caps and per-expert conservation."""
    R, E = T.shape
    total = int(T.sum())
    _require(plan.alloc.shape == (E, R), f"alloc has shape {plan.alloc.shape}, expected [E, R]={(E, R)}")
    _require(np.array_equal(plan.slots_per_expert, T), "plan was built from other counts")
    _require(plan.caps.shape == (R,) and int(plan.caps.sum()) == total, "caps do not sum to the total")
    _require(bool((plan.alloc >= 0).all()), "alloc has a negative entry")
    _require(np.array_equal(plan.alloc.sum(1), T.sum(0)), "conservation: alloc row sums != per-expert load")
    bad = np.nonzero(plan.alloc.sum(0) != plan.caps)[0]
    _require(bad.size == 0, f"balance: rank(s) {bad[:8].tolist()} do not compute exactly caps rows")
    _require(np.array_equal(plan.recv_counts, plan.caps), "recv_counts != caps")


def _check_donors(plan: Plan) -> np.ndarray:
    """At most one donor per receiver, slots hold exactly the remote experts. Returns remote mask [E, R]."""
    E, R = plan.alloc.shape
    epn = E // R
    home = np.arange(E) // epn
    remote = (plan.alloc > 0) & (home[:, None] != np.arange(R)[None, :])
    for d in np.nonzero(remote.any(0))[0]:
        homes = np.unique(home[remote[:, d]])
        _require(
            homes.size == 1, f"one donor: rank {d} computes experts of {homes.size} home ranks {homes[:8].tolist()}"
        )
        _require(
            int(plan.donor[d]) == int(homes[0]),
            f"donor[{d}]={int(plan.donor[d])} but it computes experts of rank {int(homes[0])}",
        )
    quiet = ~remote.any(0)
    _require(bool((plan.donor[quiet] == -1).all()), "a rank without replicas has a donor")
    copy = plan.experts_to_copy
    _require(bool(((copy >= -1) & (copy < E)).all()), "experts_to_copy has ids outside {-1} or [0, E)")
    for d in range(R):
        held = copy[d][copy[d] >= 0]
        _require(np.unique(held).size == held.size, f"rank {d} holds a replica twice")
        _require(held.size <= epn, f"rank {d} holds {held.size} replicas > epn={epn}")
        _require(
            set(held.tolist()) == set(np.nonzero(remote[:, d])[0].tolist()),
            f"experts_to_copy[{d}] differs from the experts rank {d} computes remotely",
        )
    return remote


def _check_layout(plan: Plan) -> None:
    """Padded segment layout: recomputed ends, tile multiples, the padding bound and the static recv_rows."""
    E, R = plan.alloc.shape
    epn, slots, pad = E // R, plan.slots_per_rank, plan.token_padding
    _require(plan.cu_seqlens.shape == (R, epn + slots), f"cu_seqlens has shape {plan.cu_seqlens.shape}")
    own = plan.alloc[np.arange(E), np.arange(E) // epn].reshape(R, epn)
    copy = plan.experts_to_copy
    held = np.where(copy >= 0, plan.alloc[np.maximum(copy, 0), np.arange(R)[:, None]], 0)
    sizes = np.concatenate((own, held), axis=1).astype(np.int64)  # alloc is int32: padding may pass 2**31
    padded = -(-sizes // pad) * pad
    _require(np.array_equal(np.cumsum(padded, axis=1), plan.cu_seqlens), "cu_seqlens do not match alloc")
    segments = (sizes > 0).sum(1)
    _require(bool((segments <= 2 * epn).all()), "a rank has more than 2*epn non-empty segments")
    rows = plan.cu_seqlens[:, -1]
    _require(bool((rows <= plan.caps + (pad - 1) * segments).all()), "padding exceeds (pad-1) per segment")
    _require(bool((rows <= plan.recv_rows).all()), "padded rows exceed the plan's static recv_rows")


def _check_routes(plan: Plan, T: np.ndarray) -> None:
    """Routing is a bijection from routed slots onto the real rows of the right expert segments."""
    R, E = T.shape
    epn = E // R
    seg_start = np.concatenate((np.zeros((R, 1), np.int64), plan.cu_seqlens[:, :-1]), axis=1)
    seen = []
    rng = np.random.default_rng(0)  # a shuffled top-k order exercises the per-expert occurrence ranks
    for r in range(R):
        flat = rng.permutation(np.repeat(np.arange(E), T[r]))
        dest, row = plan.route(r, flat)
        _require(
            np.array_equal(np.bincount(dest, minlength=R), plan.send_counts[r]),
            f"send_counts[{r}] does not match the routed slots of rank {r}",
        )
        own = flat // epn == dest
        slot = np.argmax(plan.experts_to_copy[dest] == flat[:, None], axis=1) if plan.slots_per_rank else 0
        ok_slot = own | (plan.experts_to_copy[dest, slot] == flat)
        _require(bool(ok_slot.all()), f"rank {r} routes a slot to a rank that holds no copy of its expert")
        group = np.where(own, flat - dest * epn, epn + slot)
        lo = seg_start[dest, group]
        _require(
            bool(((row >= lo) & (row < lo + plan.alloc[flat, dest])).all()),
            f"rank {r} routes a slot outside the real rows of its expert segment",
        )
        seen.append(dest * plan.recv_rows + row)
    keys = np.concatenate(seen) if seen else np.zeros(0, np.int64)
    _require(np.unique(keys).size == keys.size, "two routed slots land on the same row")


def verify(plan: Plan, slots_per_expert: Any, *, routes: bool = True, slack: float | None = None) -> None:
    """Raise PlanVerificationError unless ``plan`` keeps every guarantee for ``slots_per_expert`` [R, E].

    Checks: exact caps and conservation; one donor per receiver, <= epn replicas, slots = remote experts;
    layout and padding bound; send matrix margins; and (``routes=True``, O(total slots)) that routing every
    slot through ``plan.route`` is a bijection onto the real rows, consistent with ``send_counts``.
    ``slack=σ`` (a plan made with ``slack=σ``, or with a ``CostModel`` whose max_slack is σ) also checks the
    row bound: every rank computes at most ``row_bound(total, R, σ)`` rows.
    """
    if not isinstance(plan, Plan):
        raise PlanVerificationError(f"expected a Plan, got {type(plan).__name__}")
    T = as_counts(slots_per_expert, "slots_per_expert", 2)
    if slack is not None:
        bound = row_bound(int(T.sum()), T.shape[0], slack)
        worst = int(plan.caps.max()) if plan.caps.size else 0
        _require(worst <= bound, f"slack {slack}: a rank computes {worst} rows > the bound {bound}")
    _check_loads(plan, T)
    _check_donors(plan)
    _check_layout(plan)
    send = plan.send_counts
    _require(bool((send >= 0).all()), "send_counts has a negative entry")
    _require(np.array_equal(send.sum(1), T.sum(1)), "send_counts rows != each rank's routed slots")
    _require(np.array_equal(send.sum(0), plan.caps), "send_counts columns != caps")
    if routes:
        _check_routes(plan, T)
