"""Detectors: tables in, findings out. Each finding names a cause, the ranks, the onset step and a what-if.

Every detector follows one recipe, so their behaviour is easy to predict:

1. a per-step *ratio* of a rank's value to the median of its peers (robust: one straggler cannot move the
   median), and a robust z-score ``(x - median) / scale`` with ``scale = max(1.4826 * MAD, rel_floor * median)``
   (the floor, because with 4 near-identical ranks the MAD is ~0 and timing jitter alone would look huge);
2. a step is *raw-flagged* when ratio, z and the absolute excess (a fraction of the step time: a phase too small
   to matter is never blamed) all pass;
3. a *persistence filter*: the rolling median over ``window`` steps must pass for ``min_windows`` consecutive
   steps, so a few noisy steps (a shared core, a GC pause) raise no alarm;
4. the onset is the first raw-flagged step of the window that tripped the filter;
5. the episode must persist: over ``persist_steps`` from the onset, enough steps are raw-flagged and no
   ``window`` steps in a row are not (that is a blip that ended, and whatever comes later is its own episode).

Compute is compared after rescaling routed work to the median load (``Tables.norm_compute_s``), so a rank that is
slow because the router sent it more rows is blamed on routing, not on its hardware.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

from tools.analysis import CallSeries, Tables

KINDS = (
    "slow_compute",
    "slow_link",
    "data_loader",
    "routing_imbalance",
    "pipeline_stage",
    "host_idle",
    "hang",
    "collective_mismatch",
    "late_arrival",
    "step_slowdown",
)


@dataclass(kw_only=True, slots=True)
class Thresholds:
    """Detector knobs; the defaults find a 1.2x slowdown and stay quiet on 100 clean steps (tests/tools)."""

    compute_ratio: float = 1.1
    """Normalised compute over the peer median that counts as slow (half of the 1.2x we must catch)."""
    host_op_ratio: float = 1.25
    """``compute_ratio`` when compute is the wall time of host ops (profiler traces without GPU kernels): it
    includes the scheduler's noise, and two cores of one host drift apart by 10-20% (tools/README.md)."""
    data_ratio: float = 1.3
    """Data-loading time over the peer median that counts as slow."""
    token_ratio: float = 1.25
    """Routed rows over the peer median that counts as a routing hot spot."""
    stage_ratio: float = 1.2
    """A pipeline stage's median compute over the other stages' median that counts as imbalance."""
    z: float = 3.0
    """Robust z-score a flagged step must also reach."""
    rel_floor: float = 0.03
    """Lower bound of the z-score scale, as a fraction of the median (timing jitter on shared cores)."""
    min_excess_frac: float = 0.01
    """Excess seconds must be at least this fraction of the median step time to be blamed."""
    window: int = 5
    """Steps in the rolling median of the persistence filter."""
    min_windows: int = 2
    """Consecutive passing rolling windows needed for a finding."""
    persist_steps: int = 20
    """Persistence is measured over this many steps from the onset..."""
    min_persistence: float = 0.7
    """...and a finding needs at least this fraction of them raw-flagged (shorter blips are noise: on a busy
    shared host a healthy rank's CPU time drifts 20% high for 5-7 steps now and then)."""
    min_evidence_steps: int = 8
    """Steps from the onset needed before a finding is reported (an onset near the end of the trace waits)."""
    shift_factor: float = 3.0
    """An episode whose excess rises to this many times its level so far (after at least ``min_before`` steps)
    is reported from the rise: the onset of the cost that dominates, the milder level before it in the
    finding's evidence (a core a little busier from the start, then a stall)."""
    min_before: int = 3
    """Steps an episode must have run at its milder level before a rise splits it."""
    idle_ratio: float = 1.5
    """Idle time (in no recorded op, or off-CPU inside one) over the peer median that counts as a stalled host."""
    idle_excess_frac: float = 0.05
    """Idle excess must be at least this fraction of the median step time (descheduling on a shared host adds
    a little idle time to every rank, unevenly)."""
    slowdown_ratio: float = 1.75
    """Step time after a change point over the median before it that counts as a slowdown (reported only when
    no rank is blamed and the trace cannot attribute waits: ``Tables.blind``; whole steps are noisier than one
    rank's phases, hence the wider margin)."""
    link_factor: float = 3.0
    """A call's transfer over the group's reference latency that counts as a slow link..."""
    link_min_s: float = 0.005
    """...and by at least this many seconds (gloo on 2 busy cores: ring collectives jitter by a few ms)."""
    ring_factor: float = 10.0
    """``link_factor`` for ring collectives (all_reduce, reduce_scatter): many sequential hops, each waiting for
    a process to be scheduled, make them several times the header exchange on a busy host with healthy links."""
    link_bandwidth_Bps: float = 1e9
    """Payload allowance: bytes at this rate are expected transfer time, not a fault."""

    def __post_init__(self):
        ratios = ("compute_ratio", "host_op_ratio", "data_ratio", "token_ratio", "stage_ratio", "idle_ratio")
        for name in (*ratios, "slowdown_ratio", "shift_factor"):
            if not getattr(self, name) > 1.0:
                raise ValueError(f"{name} must be > 1, got {getattr(self, name)}")
        if not 0 <= self.min_persistence <= 1 or not 1 <= self.min_evidence_steps <= self.persist_steps:
            raise ValueError("min_persistence must be in [0, 1] and 1 <= min_evidence_steps <= persist_steps")
        if self.window < 1 or self.min_windows < 1:
            raise ValueError(f"window and min_windows must be >= 1, got {self.window}, {self.min_windows}")
        if not (self.z > 0 and self.rel_floor > 0 and self.link_factor > 1 and self.link_bandwidth_Bps > 0):
            raise ValueError("z, rel_floor and link_bandwidth_Bps must be > 0 and link_factor > 1")


@dataclass(kw_only=True, slots=True)
class Finding:
    """One diagnosed cause. ``to_json`` gives the stable schema (the first five keys never change)."""

    kind: str
    """One of ``KINDS``."""
    ranks: list[int]
    """Blamed global ranks: one rank, a rank pair (link), or a group/stage's ranks."""
    onset_step: int | None
    """First step that shows it (None: present from before the trace or found by the probe only)."""
    confidence: float
    """0..1: persistence after onset times how far past the threshold it is."""
    what_if_step_time_s: float | None
    """Estimated median step time without this cause (from the trace; None when unknown)."""
    detail: str = ""
    """One human sentence with the evidence."""
    evidence: dict = field(default_factory=dict)
    """Numbers behind it (ratio, excess seconds, ...); keys may grow."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not 0.0 <= self.confidence <= 1.0:
            raise ValueError(f"confidence must be in [0, 1], got {self.confidence}")

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "ranks": [int(r) for r in self.ranks],
            "onset_step": None if self.onset_step is None else int(self.onset_step),
            "confidence": round(float(self.confidence), 3),
            "what_if_step_time_s": None if self.what_if_step_time_s is None else float(self.what_if_step_time_s),
            "detail": self.detail,
            "evidence": self.evidence,
        }


@dataclass(slots=True)
class Episode:
    onset: int
    """Column index of the onset step."""
    ratio: float
    """Median ratio over raw-flagged steps from the onset."""
    persistence: float
    """Fraction of the ``persist_steps`` steps from the onset that are raw-flagged."""


def _rolling(a: np.ndarray, w: int, fn=np.nanmedian) -> np.ndarray:
    """Trailing rolling ``fn`` (nan-median by default) along the last axis (shorter windows at the start; NaN
    where a window holds no finite value). One vectorised call: the in-loop detector runs this every gather."""
    a = np.asarray(a, dtype=float)
    pad = np.full(a.shape[:-1] + (w - 1,), np.nan)
    windows = np.lib.stride_tricks.sliding_window_view(np.concatenate([pad, a], axis=-1), w, axis=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a rank without data in a window stays NaN, silently
        return fn(windows, axis=-1)


def _rolling_loop(a: np.ndarray, w: int, fn=np.nanmedian) -> np.ndarray:
    """Naive twin of ``_rolling`` (tests/tools/test_detectors.py checks one against the other)."""
    out = np.full(a.shape, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for s in range(a.shape[-1]):
            chunk = a[..., max(0, s - w + 1) : s + 1]
            if np.isfinite(chunk).any():
                out[..., s] = fn(chunk, axis=-1)
    return out


def _walk_back(ratio: np.ndarray, raw: np.ndarray, start: int, th: Thresholds) -> int:
    """The onset of an episode whose rolling windows pass from ``start``: walk back through the run of raw-flagged
    steps, across holes of one step (a step in which the peers were slow too: the hog that starts on one core
    delays both) but not two (an isolated noisy step a few steps earlier is not the start of the fault), and only
    through steps at least halfway up to the episode's level (the median ratio of its flagged steps from
    ``start``): a step that host noise pushed just past the threshold before a stronger fault is not its start."""
    lo = max(0, start - th.window + 1)
    ahead = ratio[start : start + th.persist_steps][raw[start : start + th.persist_steps]]
    ahead = ahead[np.isfinite(ahead)]
    half = 1.0 + (float(np.median(ahead)) - 1.0) / 2 if ahead.size else 1.0
    # only the steps the walk can reach (``lo`` to ``start``): the in-loop detector runs this on a growing window
    part = raw[lo : start + 1] & (np.nan_to_num(ratio[lo : start + 1]) >= half)
    onset = start - lo
    while onset > 0 and not part[onset]:
        onset -= 1
    while onset > 0 and (part[onset - 1] or (onset >= 2 and part[onset - 2])):
        onset -= 1 if part[onset - 1] else 2
    return lo + onset if part[onset] else start


def episode(ratio: np.ndarray, raw: np.ndarray, rolled_ok: np.ndarray, th: Thresholds) -> Episode | None:
    """First persistent episode of one rank's ``[S]`` flags, or None."""
    run = 0
    for s, ok in enumerate(rolled_ok):
        run = run + 1 if ok else 0
        if run >= th.min_windows:
            start = s - run + 1
            onset = _walk_back(ratio, raw, start, th)
            after = raw[onset : onset + th.persist_steps]
            if after.size < th.min_evidence_steps:
                return None  # too recent to tell from a blip; --follow will see it again next poll
            if after.mean() < th.min_persistence or _longest_false_run(after) >= th.window:
                run = 0  # a blip (or one that ended before the fault began): keep looking later on
                continue
            flagged = ratio[onset:][raw[onset:]]
            return Episode(
                onset, float(np.median(flagged)) if flagged.size else float(ratio[start]), float(after.mean())
            )
    return None


def level_shift(excess: np.ndarray, onset: int, th: Thresholds) -> int | None:
    """The column where an episode's ``[S]`` excess seconds rise to ``shift_factor`` times its median level since
    ``onset``, or None. The split point is the one that best separates two levels (the largest
    ``k * (n - k) / n * (mean after - mean before) ** 2``, with ``min_evidence_steps`` after it); it needs
    ``min_before`` steps before it, and the medians of both sides must differ by the factor."""
    e = np.clip(np.nan_to_num(excess[onset : onset + 2 * th.persist_steps]), 0.0, None)
    n = e.size
    ks = np.arange(1, n - th.min_evidence_steps + 1)
    if ks.size == 0:
        return None
    csum = np.concatenate([[0.0], np.cumsum(e)])
    before, after = csum[ks] / ks, (csum[n] - csum[ks]) / (n - ks)
    k = int(ks[np.argmax(ks * (n - ks) / n * (after - before) ** 2)])
    if k < th.min_before:  # the best split leaves too short a milder level: one episode
        return None
    low, high = float(np.median(e[:k])), float(np.median(e[k:]))
    return onset + k if high > 0 and high >= th.shift_factor * low else None


def from_the_rise(ep: Episode, ratio: np.ndarray, raw: np.ndarray, excess: np.ndarray, th: Thresholds, steps: list):
    """Move ``ep``'s onset to a rise of its ``[S]`` excess (``level_shift``) and its ratio to the flagged steps
    from there; returns ``(evidence, detail suffix)`` naming the milder level before it ({} and "" when none)."""
    rise = level_shift(excess, ep.onset, th)
    if rise is None:
        return {}, ""
    low = float(np.median(excess[ep.onset : rise]))
    evidence = {"earlier_onset_step": steps[ep.onset], "earlier_excess_s": low}
    suffix = f"; +{low * 1e3:.1f} ms/step already from step {steps[ep.onset]}"
    flagged = ratio[rise:][raw[rise:]]
    ep.onset, ep.ratio = rise, float(np.median(flagged)) if flagged.size else ep.ratio
    return evidence, suffix


def _longest_false_run(flags: np.ndarray) -> int:
    longest = run = 0
    for f in flags:
        run = 0 if f else run + 1
        longest = max(longest, run)
    return longest


def peer_stats(x: np.ndarray, groups: list[list[int]], leave_one_out_max: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """``(median, MAD)``, each ``[R, S]``: per step, over each row's peer group (rows listed in ``groups``).

    In groups of up to ``leave_one_out_max`` ranks a row's own value is left out: with 4 ranks a straggler
    would otherwise pull its own reference (and inflate the MAD) enough to hide a 1.2x slowdown.
    """
    med, mad = np.full(x.shape, np.nan), np.full(x.shape, np.nan)
    for rows in groups:
        if len(rows) < 2:
            continue
        loo = len(rows) <= leave_one_out_max
        for i in rows if loo else [None]:
            sub = x[[j for j in rows if j != i]] if loo else x[rows]
            ok = np.isfinite(sub).any(axis=0)
            m = np.nanmedian(sub[:, ok], axis=0)
            d = np.nanmedian(np.abs(sub[:, ok] - m), axis=0)
            for target in [i] if loo else rows:
                med[target, ok], mad[target, ok] = m, d
    return med, mad


def outliers(
    x: np.ndarray,
    groups: list[list[int]],
    ratio_thr: float,
    min_excess_s: float,
    th: Thresholds,
    abs_floor: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(ratio, raw flags, rolled flags, excess seconds)``, each ``[R, S]``, for values ``x [R, S]``."""
    med, mad = peer_stats(x, groups)
    with np.errstate(all="ignore"):
        scale = np.maximum(np.maximum(1.4826 * mad, th.rel_floor * med), max(abs_floor, 1e-12))
        # peers at ~0 (no data loading at all) and this rank above the floor: a large finite ratio, JSON-safe
        ratio = np.minimum(np.where(med > 0, x / med, np.where(x > abs_floor, 1e6, 1.0)), 1e6)
        z = (x - med) / scale
    excess = np.nan_to_num(x - med, nan=0.0)
    raw = (np.nan_to_num(ratio) >= ratio_thr) & (np.nan_to_num(z) >= th.z) & (excess >= min_excess_s)
    rolled = (
        (np.nan_to_num(_rolling(ratio, th.window)) >= ratio_thr)
        & (np.nan_to_num(_rolling(z, th.window)) >= th.z)
        & (np.nan_to_num(_rolling(excess, th.window)) >= min_excess_s)
    )
    return ratio, raw, rolled, excess


def what_if(step_time: np.ndarray, excess: np.ndarray, onset: int | None) -> float | None:
    """Median over steps from the onset of (step time minus the excess the cause added, never below 0)."""
    lo = 0 if onset is None else onset
    t, e = step_time[lo:], np.clip(np.nan_to_num(excess[lo:]), 0.0, None)
    ok = np.isfinite(t)
    return float(np.median(np.clip(t[ok] - e[ok], 0.0, None))) if ok.any() else None


def confidence(ep: Episode, thr: float) -> float:
    margin = min(1.0, max(0.0, (ep.ratio - 1.0) / (2.0 * (thr - 1.0))))
    return float(min(1.0, ep.persistence) * margin)


def link_reference(t: Tables) -> dict[tuple, float]:
    """Per group: the reference latency, the median transfer of the argument-header exchange (``validate``:
    tiny, and never delayed by injection or payload) or, without one, of the group's cheapest series."""
    by_group: dict[tuple, dict[str, float]] = {}
    for s in t.series:
        if s.transfer_s:
            by_group.setdefault(s.group, {})[s.op] = float(np.median(s.transfer_s))
    return {g: ops.get("validate", min(ops.values())) for g, ops in by_group.items()}


def series_flags(s: CallSeries, t: Tables, ref: float, th: Thresholds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[S]`` transfer ratio over threshold, raw flags and excess seconds of one series, on the step axis."""
    col = {step: j for j, step in enumerate(t.steps)}
    transfer = np.full(len(t.steps), np.nan)
    nbytes = np.zeros(len(t.steps))
    for step, sec, b in zip(s.steps, s.transfer_s, s.nbytes):
        j = col[step]
        transfer[j] = np.nanmin([transfer[j], sec])  # several calls per step: the fastest (jitter only adds)
        nbytes[j] = max(nbytes[j], b)
    factor = th.ring_factor if s.op in ("all_reduce", "reduce_scatter") else th.link_factor
    limit = max(factor * ref, ref + th.link_min_s) + nbytes / th.link_bandwidth_Bps
    return transfer / limit, transfer >= limit, np.nan_to_num(transfer - ref, nan=0.0)
