"""Unions of time intervals: how long a rank was inside some span (the profiler's spans nest and overlap).

Intervals are ``(start, end)`` pairs in seconds; every function takes them in any order.
"""

from __future__ import annotations

from collections.abc import Iterable


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering the same time as ``intervals`` (empty ones dropped)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def clip(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of ``intervals`` inside ``[lo, hi]``, merged."""
    return merge((max(a, lo), min(b, hi)) for a, b in intervals)


def length(intervals: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``intervals``."""
    return sum(b - a for a, b in merge(intervals))


def subtract(keep: Iterable[tuple[float, float]], remove: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The time in ``keep`` that is not in ``remove`` (both merged first)."""
    out, cut = [], merge(remove)
    for a, b in merge(keep):
        for c, d in cut:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out
