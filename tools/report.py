"""The report: stable JSON (``moonep diagnose --json``) and a text summary (pictures: ``tools.plots``).

JSON (``schema_version`` 1; keys are only ever added):

- ``findings``: list of ``{kind, ranks, onset_step, confidence, what_if_step_time_s, detail, evidence}``,
  ``kind`` in ``slow_compute | slow_link | data_loader | routing_imbalance | pipeline_stage | host_idle | hang |
  collective_mismatch | late_arrival`` (``tools.detect.KINDS``); ``[]`` when nothing is wrong. The first five
  keys are the contract; ``detail`` is prose, ``evidence`` may grow.
- ``ranks``, ``steps`` (``{first, last, count}``), ``step_time_s`` (median), ``rank_scores`` (per rank: ``score``
  1 = best, ``compute_s``, ``data_s``, ``tokens``, ``stage``), ``wait_matrix_s`` (``{ranks, seconds[R][R]}``: row
  waited for column), ``collectives`` (per group and op: calls, median transfer and wait), ``probe`` (or null),
  ``warnings`` (skipped files and lines), ``coverage`` (``tools.traces.Coverage``: ``expected_ranks`` and where
  that came from, ``ranks``, ``missing_ranks``, ``steps``, ``ranks_missing_steps``, ``lines_dropped``, ``dropped``
  (``file:line: why``), ``complete``), ``format`` (``jsonl | kineto | flight_recorder | none``: what the tables
  were read from) and, with Flight Recorder dumps in the folder, ``flight_recorder`` (its summary). Every number
  in the JSON is finite (NaN/inf records are dropped on read).
"""

from __future__ import annotations

import os
import warnings

import numpy as np

from tools.analysis import Tables, build_tables
from tools.detect import Finding, Thresholds
from tools.findings import diagnose, rank_scores
from tools.sources import load_folder

SCHEMA_VERSION = 1


def apply_probe(findings: list[Finding], probe: dict, factor: float = 3.0) -> list[Finding]:
    """Name the pair of a group-level ``slow_link`` with the probe's slowest pair (``probe.slow_pairs``).

    A slow pair the trace did not flag becomes its own ``slow_link`` finding (onset unknown: None).
    """
    pairs = [tuple(p["ranks"]) for p in probe.get("slow_pairs", [])]
    used = set()
    for f in findings:
        if f.kind != "slow_link":
            continue
        inside = [p for p in pairs if set(p) <= set(f.ranks)]
        if inside:
            used.add(inside[0])
            f.ranks = sorted(inside[0])
            f.confidence = min(1.0, 2 * f.confidence)  # trace + probe agree
            f.detail += f"; the probe names ranks {f.ranks}"
            f.evidence["probe_pair"] = list(inside[0])
    for p, info in zip(pairs, probe.get("slow_pairs", [])):
        if p not in used:
            findings.append(
                Finding(
                    kind="slow_link",
                    ranks=sorted(p),
                    onset_step=None,
                    confidence=0.6,
                    what_if_step_time_s=None,
                    detail=f"probe: ranks {sorted(p)} round trip {info['seconds'] * 1e3:.1f} ms, "
                    f"{info['ratio']:.1f}x the median pair",
                    evidence={"probe_seconds": info["seconds"], "probe_ratio": info["ratio"]},
                )
            )
    return findings


def build_report(
    t: Tables,
    findings: list[Finding],
    *,
    trace_dir: str = "",
    probe: dict | None = None,
    notes: list[str] | None = None,
) -> dict:
    finite = t.step_time_s[np.isfinite(t.step_time_s)]
    return {
        "schema_version": SCHEMA_VERSION,
        "trace_dir": trace_dir,
        "findings": [f.to_json() for f in findings],
        "ranks": list(t.ranks),
        "steps": {
            "first": t.steps[0] if t.steps else None,
            "last": t.steps[-1] if t.steps else None,
            "count": len(t.steps),
        },
        "step_time_s": float(np.median(finite)) if finite.size else None,
        "rank_scores": rank_scores(t),
        "wait_matrix_s": {"ranks": list(t.ranks), "seconds": np.round(t.wait_matrix_s, 6).tolist()},
        "clock_offsets_s": {str(r): round(o, 6) for r, o in t.clock_offsets.items()},
        "collectives": [
            {
                "group": list(s.group),
                "op": s.op,
                "calls": len(s.transfer_s),
                "median_transfer_s": float(np.median(s.transfer_s)) if s.transfer_s else None,
                "median_max_wait_s": float(np.median(s.max_wait_s)) if s.max_wait_s else None,
            }
            for s in t.series
        ],
        "probe": probe,
        "warnings": list(notes or []),
    }


def analyse(
    trace_dir: str | os.PathLike,
    thresholds: Thresholds | None = None,
    probe: dict | None = None,
    world_size: int | None = None,
    rank_from: str | None = None,
) -> tuple[dict, Tables]:
    """Read ``trace_dir`` in whatever format it holds (``tools.sources``), diagnose, and return ``(report JSON,
    tables)``.

    Dropped lines and skipped files are warned about (``TraceWarning``, naming ``file:line``) and listed in
    ``report["warnings"]``; ``report["coverage"]`` says what the folder holds against ``world_size`` (default:
    the trace's own header). Raises ``TraceFormatError`` for a folder no diagnosis can stand on.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder = load_folder(trace_dir, world_size=world_size, rank_from=rank_from)
        tables = build_tables(folder.traces)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    th = thresholds or Thresholds()
    findings = diagnose(tables, th) + folder.findings
    if probe:
        findings = apply_probe(findings, probe)
    notes = [str(w.message) for w in caught] + folder.notes + tables.notes
    report = build_report(tables, findings, trace_dir=os.fspath(trace_dir), probe=probe, notes=notes)
    report["steps"]["needed"] = th.min_evidence_steps  # a slowdown must last this long to be told from a blip
    report["coverage"] = folder.coverage.to_json()
    report["format"] = folder.format
    report.update(folder.extra)
    return report, tables


def too_short(report: dict) -> str:
    """Why the trace is too short for a verdict ("" when it is long enough): a per-step finding needs
    ``steps.needed`` steps from its onset, so fewer steps than that rule nothing out."""
    steps = report["steps"]
    if not 0 < steps["count"] < steps.get("needed", 0):
        return ""
    return (
        f"{steps['count']} step{'s' * (steps['count'] != 1)} are too few (a slowdown must last "
        f"{steps['needed']} steps to be told from noise); trace more steps"
    )


def format_report(report: dict) -> str:
    """A few lines for a terminal."""
    step = report["step_time_s"]
    lines = [
        f"trace {report['trace_dir']}: {len(report['ranks'])} ranks, {report['steps']['count']} steps, "
        f"median step {step * 1e3:.1f} ms"
        if step
        else f"trace {report['trace_dir']}: no steps"
    ]
    lines += [f"warning: {w}" for w in report["warnings"]]
    cov = report.get("coverage")
    if cov is not None:
        lines.append(_coverage_line(cov))
    empty = cov is not None and (not cov["ranks"] or not cov["steps"])
    if not report["findings"] and not empty:
        complete = cov is None or cov["complete"]
        found = "no straggler found" if complete else "no straggler found in what this PARTIAL trace holds"
        short = too_short(report)
        lines.append(f"no verdict: {short}" if short else found)
    for f in report["findings"]:
        wi = f["what_if_step_time_s"]
        gain = f", step {wi * 1e3:.1f} ms without it" if wi is not None else ""
        lines.append(
            f"{f['kind']:<18} ranks {f['ranks']} from step {f['onset_step']} "
            f"(confidence {f['confidence']:.2f}{gain}): {f['detail']}"
        )
    return "\n".join(lines)


def _coverage_line(cov: dict) -> str:
    want = "?" if cov["expected_ranks"] is None else cov["expected_ranks"]
    line = f"coverage: {len(cov['ranks'])}/{want} ranks (expected from {cov['expected_from']}), {cov['steps']} steps"
    line += f", {cov['lines_dropped']} lines dropped"
    if cov["missing_ranks"]:
        line += f", missing ranks {cov['missing_ranks']}"
    if cov["ranks_missing_steps"]:
        line += f", ranks short of steps {cov['ranks_missing_steps']}"
    return line
