"""Training steps from a trace that does not mark them: the iteration's repeating structure.

Many jobs are profiled without a schedule (no ``ProfilerStep#N`` spans), and a Flight Recorder dump lists
collectives only. An iteration repeats, so its events repeat: the sequence of labels (an op name, a collective
with its sizes and call site) becomes periodic once warm-up is over. ``anchor`` finds the shortest period of the
steady tail and the label that occurs exactly once per period (the *anchor*: an optimizer step, a gradient
all-reduce); ``steps_from_anchor`` numbers the events so that step ``k`` ends with the ``k``-th anchor, which
keeps the user's numbering (step 0 is the first iteration, warm-up one-offs included).

    labels = ["init", "ar", "bc", "ar", "ar", "ar", "ar"]
    a = anchor(labels)                 # "ar": period 1 over the steady tail
    steps_from_anchor(labels, a)       # [0, 0, 1, 1, 2, 3, 4]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

MIN_REPEATS = 3
"""A tail must repeat its period this many times before it counts as the iteration (two could be chance)."""


def steady_period(labels: Sequence[Hashable]) -> tuple[int, int] | None:
    """``(period, start)``: the shortest period ``p`` whose periodic tail ``labels[start:]`` covers at least
    ``MIN_REPEATS`` periods and the most events (ties: the shorter period); None when nothing repeats."""
    n = len(labels)
    best: tuple[int, int] | None = None
    for p in range(1, n // MIN_REPEATS + 1):
        start = n - p  # extend the periodic tail backwards while labels[i] == labels[i + p]
        while start > 0 and labels[start - 1] == labels[start - 1 + p]:
            start -= 1
        if n - start >= MIN_REPEATS * p and (best is None or start < best[1]):
            best = (p, start)
        if best is not None and best[1] == 0:
            break
    return best


RARE = 4
"""A label seen under 1/``RARE`` as often as the most frequent one is an occasional event (a gather every N
steps, a checkpoint barrier), not part of the iteration's pattern."""


def once_per_period(labels: Sequence[Hashable]) -> list[Hashable]:
    """Labels that occur exactly once in each period of the steady tail, in the period's order ([] when the
    sequence has no steady tail). When occasional events break the pattern, it is looked for again without
    them (``RARE``)."""
    found = steady_period(labels)
    if found is None:
        counts = Counter(labels)
        top = max(counts.values(), default=0)
        common = [x for x in labels if counts[x] * RARE >= top]
        if len(common) == len(labels):
            return []
        labels = common
        found = steady_period(labels)
    if found is None:
        return []
    p, start = found
    period = list(labels[start : start + p])
    counts = Counter(period)
    return [label for label in period if counts[label] == 1]


def anchor(labels: Sequence[Hashable]) -> Hashable | None:
    """The label that occurs exactly once in each period of the steady tail (the last such in the period: the
    end of an iteration), or None when the sequence has no steady tail."""
    once = once_per_period(labels)
    return once[-1] if once else None


def steps_from_anchor(labels: Sequence[Hashable], mark: Hashable, *, ends: bool = True) -> list[int]:
    """Step of each event: with ``ends`` the ``k``-th occurrence of ``mark`` closes step ``k`` (events after the
    last one are step ``count``); otherwise it opens step ``k`` (events before the first are step 0)."""
    out, step, seen = [], 0, False
    for label in labels:
        if not ends and label == mark:
            step += seen  # the first mark opens step 0
            seen = True
        out.append(step)
        if ends and label == mark:
            step += 1
    return out
