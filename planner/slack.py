"""Bounded-slack and cost-aware plans: replicate only as much as a row bound, or the predicted layer time, needs.

Axes: ``R`` ranks, ``E`` experts, ``epn = E / R``; ``g [R]`` the routed slots of each rank's own experts (its
home-group load), ``total = sum(g)``.

A slack ``σ`` allows every rank ``U = ceil((1 + σ) * total / R)`` rows (σ as the rational ``num / SLACK_DEN``,
rounded down, so the bound never exceeds the real one). The *slack pass* makes the pairs before the balanced
kernel runs: each rank with ``g[h] > U`` (a donor) keeps U rows and hands its excess ``g[h] - U`` to receivers,
ranks with room ``U - g[u] > 0``, each receiver fed by ONE donor. Donors go largest excess first; a donor first
looks at the ranks it fed last step (sticky), then at the rest; among those it takes the smallest room that
holds its whole remaining excess (one pair finishes it, least room wasted), else the largest room (filled
completely). Ranks with ``g <= U`` and no gift keep their own rows: no replicas when the routing already fits.
The pass yields caps (``U`` for donors, ``g + gift`` for receivers, ``g`` otherwise) and the pairs; the balanced
kernel then runs with those caps and the pairs as its sticky hint, so its sticky pass reproduces exactly these
pairs and stages C-E are unchanged (README: the theorem with slack). When the rooms are too fragmented for
one-donor pairs, the pass fails and the plan is the exact one (rows <= ceil(total / R) <= U, still in bound).

The functions with a leading underscore are written in the subset of Python that both numba's CPU ``njit`` and
numba-cuda's ``cuda.jit(device=True)`` compile (no allocation), so the CPU kernel and the device kernel run the
same source. ``CostModel`` prices a plan: ``max_d(rows_d * row_seconds + copies_d * copy_seconds)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner._jit import njit

SLACK_DEN = 1 << 16
"""σ is applied as num / SLACK_DEN (num = floor(σ * SLACK_DEN)): integer arithmetic, same on host and device."""
MAX_SLACK = 64.0
"""largest σ accepted (keeps total * (SLACK_DEN + num) inside int64 for any int32 counts)."""


def slack_num(slack: float, name: str = "slack") -> int:
    """``floor(slack * SLACK_DEN)`` for a finite ``0 <= slack <= MAX_SLACK``, or ValueError naming ``name``."""
    if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not math.isfinite(slack):
        raise ValueError(f"{name} must be a finite number in [0, {MAX_SLACK:g}], got {slack!r}")
    if not 0 <= slack <= MAX_SLACK:
        raise ValueError(f"{name} must be in [0, {MAX_SLACK:g}], got {slack!r}")
    return int(math.floor(slack * SLACK_DEN))


def row_bound(total: int, R: int, slack: float) -> int:
    """``U = ceil((1 + σ) * total / R)`` with σ as the planner applies it (``slack_num``): rows per rank allowed."""
    num = slack_num(slack)
    return -(-int(total) * (SLACK_DEN + num) // (SLACK_DEN * R))


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Predicted seconds of one layer step on a rank: ``rows * row_seconds + copies * copy_seconds``.

    ``copies`` counts the expert copies a rank takes part in: replicas it receives plus replicas it pushes as a
    donor (each copy is a weight push forward and a gradient reduce backward at both ends).
    """

    row_seconds: float
    """seconds to compute one routed row, forward and backward (the grouped GEMMs)."""
    copy_seconds: float
    """seconds one expert copy costs a rank: weight push plus gradient reduce."""
    max_slack: float = 0.5
    """largest σ the plan may choose (the EP layer sizes its static receive buffers for it)."""
    candidates: int = 8
    """σ values tried per step, evenly spaced in rows from the exact plan to max_slack (or to no replicas)."""

    def __post_init__(self) -> None:
        for name in ("row_seconds", "copy_seconds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {v!r}")
        slack_num(self.max_slack, "CostModel.max_slack")
        if isinstance(self.candidates, bool) or not isinstance(self.candidates, int) or self.candidates < 2:
            raise ValueError(f"CostModel.candidates must be an int >= 2, got {self.candidates!r}")

    @classmethod
    def from_shape(cls, *, H: int, F: int, weight_bytes: int, flops: float, bandwidth: float, **kwargs) -> CostModel:
        """A gated MLP expert (three H x F projections): a row costs 18*H*F flops forward and backward; a copy
        moves its weights (``weight_bytes`` each) forward and fp32 grads back at ``bandwidth`` bytes/s."""
        if min(H, F, weight_bytes) < 1 or not flops > 0 or not bandwidth > 0:
            raise ValueError("CostModel.from_shape needs positive H, F, weight_bytes, flops and bandwidth")
        return cls(
            row_seconds=18.0 * H * F / flops,
            copy_seconds=3.0 * H * F * (weight_bytes + 4) / bandwidth,
            **kwargs,
        )

    def rank_seconds(self, rows: np.ndarray, donor: np.ndarray, experts_to_copy: np.ndarray) -> np.ndarray:
        """[R] predicted seconds per rank of a numpy plan's tables (rows [R] padded, donor [R], copy [R, slots])."""
        return rows * self.row_seconds + copies_per_rank(donor, experts_to_copy) * self.copy_seconds


def check_options(slack: Any, cost: Any, caps: Any = None) -> int | None:
    """Check the balancing options together (one-line ValueErrors) -> σ as ``slack_num`` (None: no slack)."""
    if cost is not None and not isinstance(cost, CostModel):
        raise ValueError(f"cost must be a planner.CostModel, got {type(cost).__name__}")
    if cost is not None and slack is not None:
        raise ValueError("pass slack or cost, not both (cost chooses the slack per step)")
    if caps is not None and (slack is not None or cost is not None):
        raise ValueError("caps fix every rank's rows: they cannot be combined with slack or cost")
    return None if slack is None else slack_num(slack)


def copies_per_rank(donor, experts_to_copy):
    """[R] expert copies each rank takes part in: replicas it receives plus replicas it pushes as a donor.
    Tensors (any device, no host read) or numpy arrays; the count ``CostModel`` prices."""
    received = (experts_to_copy >= 0).sum(1)
    if isinstance(received, np.ndarray):
        return received + np.bincount(donor[donor >= 0], weights=received[donor >= 0], minlength=len(donor))
    pushed = received.new_zeros(received.shape).index_add_(0, donor.clamp(min=0), received * (donor >= 0))
    return received + pushed


@njit(cache=True)
def _slack_target(g, num, k, n):
    """Rows per rank allowed for candidate k of n: ``U0 + ceil((hi - U0) * k / (n - 1))`` with ``U0 =
    ceil(total / R)`` and ``hi = min(max(g), ceil((1 + num / SLACK_DEN) * total / R))`` (a fixed slack is
    k = 1 of n = 2: ``min(max(g), U_σ)``, since any U >= max(g) gives the same plan)."""
    R = g.shape[0]
    total = 0
    gmax = 0
    for r in range(R):
        total += g[r]
        if g[r] > gmax:
            gmax = g[r]
    u0 = (total + R - 1) // R
    hi = (total * (SLACK_DEN + num) + SLACK_DEN * R - 1) // (SLACK_DEN * R)
    if gmax < hi:
        hi = gmax
    if hi < u0:
        hi = u0
    return u0 + ((hi - u0) * k + n - 2) // (n - 1)


@njit(cache=True)
def _pick_receiver(h, x, room, hint, prev_donor, sticky, pass_sticky):
    """The receiver donor h (remaining excess x) takes next: the smallest room >= x, else the largest room;
    only ranks it fed last step when ``pass_sticky``; lowest index on ties. -1 when none is left."""
    R = room.shape[0]
    fit = -1
    big = -1
    for u in range(R):
        if room[u] <= 0 or hint[u] >= 0 or (pass_sticky and (not sticky or prev_donor[u] != h)):
            continue
        if room[u] >= x and (fit < 0 or room[u] < room[fit]):
            fit = u
        if big < 0 or room[u] > room[big]:
            big = u
    if fit >= 0:
        return fit
    return big


@njit(cache=True)
def _slack_pairs(g, U, prev_donor, sticky, caps, hint, room):
    """The slack pass (module docstring) for the row bound U. g [R] group loads; prev_donor [R] last step's
    donors (read when sticky). Writes caps [R], hint [R] (the donor of each receiver, -1 = none) and uses room
    [R] as scratch. Returns 1, or 0 when some donor's excess finds no receiver (the caller plans exactly)."""
    R = g.shape[0]
    for r in range(R):
        caps[r] = g[r]
        hint[r] = -1
        room[r] = U - g[r] if g[r] < U else 0
    while True:
        h = -1
        for r in range(R):  # the largest remaining excess first, lowest index on ties
            if caps[r] > U and (h < 0 or caps[r] > caps[h]):
                h = r
        if h < 0:
            return 1
        x = caps[h] - U
        caps[h] = U
        while x > 0:
            u = _pick_receiver(h, x, room, hint, prev_donor, sticky, True)
            if u < 0:
                u = _pick_receiver(h, x, room, hint, prev_donor, sticky, False)
            if u < 0:
                return 0
            t = room[u] if room[u] < x else x
            hint[u] = h
            caps[u] += t
            room[u] = 0
            x -= t


@njit(cache=True)
def slack_caps(g, num, k, n, prev_donor, sticky, caps, hint, room):
    """CPU entry: candidate k of n (or a fixed slack: k=1, n=2). Fills caps [R] and hint [R]; returns 1 when
    the slack pass made the pairs, 0 when it fell back (caps = floor/ceil of total / R, hint = last step's
    donors when sticky, else -1: the exact plan)."""
    U = _slack_target(g, num, k, n)
    if _slack_pairs(g, U, prev_donor, sticky, caps, hint, room):
        return 1
    R = g.shape[0]
    total = 0
    for r in range(R):
        total += g[r]
    for r in range(R):
        caps[r] = total // R + (1 if r < total % R else 0)
        hint[r] = prev_donor[r] if sticky else -1
    return 0
