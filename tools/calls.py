"""Collective calls matched across the ranks of their group: by sequence number when every call carries one
(profiler ``Seq``, Flight Recorder ids), else by occurrence (``collectives`` requires every member of a group to
call in the same order)."""

from __future__ import annotations

from collections import defaultdict

from tools.traces import RankTrace


def match_calls(traces: dict[int, RankTrace]) -> dict[tuple, list[dict[int, object]]]:
    """``{group: [ {rank: Collective} per call ]}`` with calls matched by sequence number when every call has one,
    else by occurrence within the group."""
    per_rank: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for rank, trace in traces.items():
        for call in trace.collectives:
            per_rank[call.group][rank].append(call)
    matched = {}
    for group, by_rank in per_rank.items():
        present = [r for r in group if r in by_rank]
        if len(present) < 2:
            continue  # one member alone says nothing about waiting or transfer
        if all(c.seq is not None for r in present for c in by_rank[r]):  # numbered calls: match by number
            numbered = {r: {c.seq: c for c in by_rank[r]} for r in present}
            common = sorted(set.intersection(*(set(n) for n in numbered.values())))
            matched[group] = [{r: numbered[r][k] for r in present} for k in common]
            continue
        n = min(len(by_rank[r]) for r in present)  # a truncated file ends early: keep the common prefix
        matched[group] = [{r: by_rank[r][k] for r in present} for k in range(n)]
    return matched
