"""``diagnose``: run every detector over the tables and return the findings plus the per-rank scores.

Order of reasoning (why): routing load is explained first (a hot expert's rank is slow by design, and blaming
its GPU would send someone to swap healthy hardware), then pipeline stages (a long last stage is a partitioning
issue), then individual ranks' compute and data loading against peers of the same stage, then links from
transfer time, which excludes waiting for late arrivers by construction.
"""

from __future__ import annotations

import warnings

import numpy as np

from tools.analysis import Tables
from tools.detect import (
    Finding,
    Thresholds,
    _rolling,
    confidence,
    episode,
    from_the_rise,
    link_reference,
    outliers,
    series_flags,
    what_if,
)


def stage_groups(t: Tables) -> list[list[int]]:
    """Row indices of ranks that are peers (same pipeline stage; all ranks when stages are unknown)."""
    groups: dict[int | None, list[int]] = {}
    for i, r in enumerate(t.ranks):
        groups.setdefault(t.stages.get(r), []).append(i)
    return list(groups.values())


def _median_step(t: Tables) -> float:
    finite = t.step_time_s[np.isfinite(t.step_time_s)]
    return float(np.median(finite)) if finite.size else 0.0


def _per_rank(
    t: Tables,
    x: np.ndarray,
    kind: str,
    thr: float,
    th: Thresholds,
    what: str,
    abs_floor: float = 0.0,
    min_excess: float | None = None,
    excess_of: np.ndarray | None = None,
) -> list[Finding]:
    min_excess = th.min_excess_frac * _median_step(t) if min_excess is None else min_excess
    ratio, raw, rolled, excess = outliers(x, stage_groups(t), thr, min_excess, th, abs_floor)
    if excess_of is not None:  # the seconds the cause adds may differ from the detection signal (routing)
        excess = np.clip(np.nan_to_num(excess_of - np.nanmedian(excess_of, axis=0)), 0.0, None)
    out = []
    for i, rank in enumerate(t.ranks):
        ep = episode(ratio[i], raw[i], rolled[i], th)
        if ep is None:
            continue
        evidence, before = from_the_rise(ep, ratio[i], raw[i], excess[i], th, t.steps)
        extra = float(np.median(excess[i, ep.onset :]))
        out.append(
            Finding(
                kind=kind,
                ranks=[rank],
                onset_step=t.steps[ep.onset],
                confidence=confidence(ep, thr),
                what_if_step_time_s=what_if(t.step_time_s, excess[i], ep.onset),
                detail=f"rank {rank}: {what} {ep.ratio:.2f}x its peers' median from step "
                f"{t.steps[ep.onset]} (+{extra * 1e3:.1f} ms/step{before})",
                evidence={"ratio": round(ep.ratio, 3), "excess_s": extra, "persistence": round(ep.persistence, 3)}
                | evidence,
            )
        )
    return out


def _stages(t: Tables, th: Thresholds) -> list[Finding]:
    stages = sorted({s for s in t.stages.values() if s is not None})
    if len(stages) < 2:
        return []
    rows = {s: [i for i, r in enumerate(t.ranks) if t.stages[r] == s] for s in stages}
    with np.errstate(all="ignore"):
        per_stage = np.vstack([np.nanmedian(t.compute_s[rows[s]], axis=0) for s in stages])  # [stages, S]
    # each stage against the median of the *other* stages: with two stages the overall median is their mean
    others = np.vstack([np.nanmedian(np.delete(per_stage, k, axis=0), axis=0) for k in range(len(stages))])
    ratio = per_stage / others
    excess = np.nan_to_num(per_stage - others)
    min_excess = th.min_excess_frac * _median_step(t)
    raw = (np.nan_to_num(ratio) >= th.stage_ratio) & (excess >= min_excess)
    rolled = np.nan_to_num(_rolling(ratio, th.window)) >= th.stage_ratio
    out = []
    for k, s in enumerate(stages):
        ep = episode(ratio[k], raw[k], rolled[k], th)
        if ep is not None:
            out.append(
                Finding(
                    kind="pipeline_stage",
                    ranks=[t.ranks[i] for i in rows[s]],
                    onset_step=t.steps[ep.onset],
                    confidence=confidence(ep, th.stage_ratio),
                    what_if_step_time_s=what_if(t.step_time_s, excess[k], ep.onset),
                    detail=f"pipeline stage {s} computes {ep.ratio:.2f}x the other stages' median: "
                    f"stage partitioning, not one slow GPU",
                    evidence={"stage": s, "ratio": round(ep.ratio, 3)},
                )
            )
    return out


def _links(t: Tables, th: Thresholds) -> list[Finding]:
    refs = link_reference(t)
    best: dict[tuple, Finding] = {}
    total: dict[tuple, np.ndarray] = {}  # per group: seconds per step lost in all its slow series
    min_excess = th.min_excess_frac * _median_step(t)
    for s in t.series:
        if s.op == "validate" or len(s.group) < 2:
            continue
        ratio, raw, excess = series_flags(s, t, refs[s.group], th)
        raw &= excess >= min_excess
        # rolling *minimum*: a slow link delays every call, while jitter on a shared host only delays some,
        # so the minimum over a window keeps the link and drops the jitter (same reasoning as the probe)
        rolled = np.nan_to_num(_rolling(np.where(np.isfinite(ratio), ratio, np.nan), th.window, np.nanmin)) >= 1.0
        ep = episode(np.nan_to_num(ratio), raw, rolled, th)
        if ep is None:
            continue
        total[s.group] = total.get(s.group, 0.0) + np.where(np.arange(len(excess)) >= ep.onset, excess, 0.0)
        extra = float(np.median(excess[ep.onset :]))
        f = Finding(
            kind="slow_link",
            ranks=sorted(s.group),
            onset_step=t.steps[ep.onset],
            confidence=0.5 * confidence(ep, 2.0),  # half: the pair inside the group is not localised
            what_if_step_time_s=None,
            detail=f"{s.op} on ranks {list(s.group)}: transfer {extra * 1e3:.1f} ms over the group's "
            f"{refs[s.group] * 1e3:.2f} ms reference latency with no late arriver; a link in this "
            f"group is slow (run `moonep probe` to name the pair)",
            evidence={"op": s.op, "excess_s": extra, "reference_s": refs[s.group]},
        )
        if s.group not in best or extra > best[s.group].evidence["excess_s"]:
            best[s.group] = f
    for g, f in best.items():
        f.what_if_step_time_s = what_if(t.step_time_s, total[g], t.steps.index(f.onset_step))
    # a slow link shows in every group that crosses it: keep the smallest slow groups (the intersection idea)
    groups = sorted(best, key=len)
    kept = [g for g in groups if not any(set(h) < set(g) for h in groups)]
    return [best[g] for g in kept]


def rank_scores(t: Tables) -> list[dict]:
    """Per rank: the NVRx-style score (1 best; peer median over this rank's normalised compute, median over
    steps) and the median compute, data and routed tokens per step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step no rank computed in (Flight Recorder dumps): NaN
        med = np.nan_to_num(np.nanmedian(t.norm_compute_s, axis=0)) if t.ranks else np.zeros(0)
    out = []
    for i, r in enumerate(t.ranks):
        with np.errstate(all="ignore"):
            score = (
                np.nanmedian(np.minimum(1.0, med / t.norm_compute_s[i]))
                if np.isfinite(t.norm_compute_s[i]).any()
                else float("nan")
            )
        out.append(
            {
                "rank": r,
                "score": None if not np.isfinite(score) else round(float(score), 4),
                "compute_s": _nanmed(t.compute_s[i]),
                "data_s": _nanmed(t.data_s[i]),
                "tokens": _nanmed(t.tokens[i]),
                "stage": t.stages.get(r),
            }
        )
    return out


def _nanmed(a: np.ndarray) -> float | None:
    a = a[np.isfinite(a)]
    return float(np.median(a)) if a.size else None


def _skipped_collectives(t: Tables) -> list[Finding]:
    """A rank whose collective count in a step differs from its own usual count while every other rank issues
    its usual count: it skipped (or added) collectives, so every later call is paired with a peer's call of
    another step: the prelude of a hang or of silently wrong results. Each rank's last step is left out (a
    trace cut mid-step is short there), and so is a rank whose file lost lines (a dropped record is no skip)."""
    if t.calls is None or len(t.ranks) < 2 or len(t.steps) < 3 or not t.calls.any():
        return []
    usual = np.median(t.calls, axis=1)
    seen = np.isfinite(t.compute_s) | (t.calls > 0)
    last = [max((j for j in range(len(t.steps)) if seen[i, j]), default=-1) for i in range(len(t.ranks))]
    for j, step in enumerate(t.steps):
        odd = [i for i in range(len(t.ranks)) if t.calls[i, j] != usual[i] and j < last[i]]
        if not odd or len(odd) == len(t.ranks) or any(t.ranks[i] in t.damaged for i in odd):
            continue
        blamed = [t.ranks[i] for i in odd]
        others = [t.ranks[i] for i in range(len(t.ranks)) if i not in odd]
        got, want = int(t.calls[odd[0], j]), int(usual[odd[0]])
        return [
            Finding(
                kind="collective_mismatch",
                ranks=blamed,
                onset_step=step,
                confidence=0.9,
                what_if_step_time_s=None,
                detail=f"ranks {blamed} issued {got} collectives in step {step} where they usually issue {want} "
                f"and ranks {others} issued their usual count: from there on each call is paired with a peer's "
                f"call of another step (a hang, or silently wrong results, follows)",
                evidence={"calls": got, "usual": want, "step": step},
            )
        ]
    return []


def _unattributed(t: Tables, th: Thresholds) -> list[Finding]:
    """The job got slower but no rank is to blame from this trace: said as a finding on every rank, never
    "no straggler found". A change point of the step time: the first step ``k`` from which the median of the
    ``persist_steps`` steps reaches ``slowdown_ratio`` times the median step before it (the first two steps,
    warm-up, left out), step ``k`` and ``min_persistence`` of those steps being slower than that median by half
    the margin."""
    st, warm = t.step_time_s, 2
    if not t.blind or len(t.steps) < warm + th.window + th.min_evidence_steps:
        return []
    found = None
    for k in range(warm + th.window, len(st) - th.min_evidence_steps + 1):
        before = st[warm:k][np.isfinite(st[warm:k])]
        base = float(np.median(before)) if before.size else 0.0
        after = st[k : k + th.persist_steps]
        after = after[np.isfinite(after)]
        slow = base * (1 + (th.slowdown_ratio - 1) / 2)
        if base > 0 and after.size and st[k] >= slow and np.median(after) / base >= th.slowdown_ratio:
            persistence = float(np.mean(after >= slow))
            if persistence >= th.min_persistence:
                found = (float(np.median(after) / base), k, float(base), persistence)
                break  # the earliest step from which the run stays slower
    if found is None:
        return []
    ratio, k, base, persistence = found
    hidden = ", ".join(repr(op) for op in t.hidden) or "every phase (no collective is recorded)"
    return [
        Finding(
            kind="step_slowdown",
            ranks=list(t.ranks),
            onset_step=t.steps[k],
            confidence=0.5 * min(1.0, persistence),
            what_if_step_time_s=base,
            detail=f"steps take {ratio:.2f}x their earlier level from step {t.steps[k]}, but this trace cannot "
            f"tell which rank: waits for a late peer hide inside {hidden}, and a rank slowed off-CPU (a "
            f"contended core, sleep, I/O) before that sync looks like the peers that waited for it. A trace that "
            f"records the collectives as spans of their own (a PyTorch profiler trace, collectives tracing) can",
            evidence={"ratio": round(ratio, 3), "persistence": round(persistence, 3)},
        )
    ]


def _drop_secondary(findings: list[Finding], share: float = 0.1) -> list[Finding]:
    """Drop a rank's compute or idle finding that adds under ``share`` of the seconds its main cause adds: a
    core that slept 30 ms a step also runs its 2 ms of ops a little slower afterwards (cold caches, a lower
    clock), a consequence of the cause rather than a second one."""
    own = ("slow_compute", "host_idle", "data_loader")
    main: dict[int, float] = {}
    for f in findings:
        if f.kind in own and len(f.ranks) == 1:
            main[f.ranks[0]] = max(main.get(f.ranks[0], 0.0), float(f.evidence.get("excess_s", 0.0)))
    return [
        f
        for f in findings
        if not (f.kind in own and len(f.ranks) == 1 and f.evidence.get("excess_s", 0.0) < share * main[f.ranks[0]])
    ]


def diagnose(t: Tables, th: Thresholds | None = None) -> list[Finding]:
    """All findings, most costly first (lowest what-if step time); an empty list when nothing is wrong."""
    th = th or Thresholds()
    if not t.ranks or not t.steps:
        return []
    findings = []
    if t.tokens.any():
        findings += _per_rank(
            t, t.tokens, "routing_imbalance", th.token_ratio, th, "routed rows", min_excess=0.5, excess_of=t.compute_s
        )
    findings += _stages(t, th)
    findings += _per_rank(
        t,
        t.norm_compute_s,
        "slow_compute",
        th.host_op_ratio if t.host_op_compute else th.compute_ratio,
        th,
        "compute (op wall time on the host)" if t.host_op_compute else "compute (routing load factored out)",
    )
    findings += _per_rank(t, t.data_s, "data_loader", th.data_ratio, th, "data loading", abs_floor=1e-4)
    if t.idle_s is not None:
        findings += _per_rank(
            t,
            t.idle_s,
            "host_idle",
            th.idle_ratio,
            th,
            "time outside any recorded op or off-CPU (sleep, I/O, a contended core, a host stall)",
            abs_floor=1e-3,
            min_excess=max(1e-3, th.idle_excess_frac * _median_step(t)),
        )
    findings += _links(t, th)
    skipped = _skipped_collectives(t)
    if skipped:  # from there on each rank's step k is paired with another step of its peers: not comparable
        findings = [f for f in findings if f.onset_step is None or f.onset_step < skipped[0].onset_step] + skipped
    findings = _drop_secondary(findings)
    if not findings:
        findings = _unattributed(t, th)
    base = _median_step(t)
    return sorted(findings, key=lambda f: f.what_if_step_time_s if f.what_if_step_time_s is not None else base)
