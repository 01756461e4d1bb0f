"""``moonep bench planner``: plan latency vs the EPLB-compatible baseline, sticky copies, inter-node bytes, slack.

Every number is measured in the same run on the same loads; the JSON (stable keys) is the record, the
printed tables are for people. Latency = median of many runs on one thread (numba kernels are serial).
"""

from __future__ import annotations

import os
import platform
import time
from collections import deque
from collections.abc import Callable

import numpy as np
from tqdm import tqdm

from planner import _kernel
from planner.core import plan
from planner.eplb import gpu_loads, rebalance_experts
from planner.metrics import EXPERT_BYTES, ROW_BYTES, balance, internode, internode_bound, load_balance, new_copies
from planner.slack import CostModel
from planner.synthetic import SYNTHETIC_LOADS, drifting_trace, router_counts, zipf_counts
from planner.verify import verify

FULL_CASES = ((8, 256), (64, 896), (256, 4096), (1024, 16384))
QUICK_CASES = ((8, 256), (64, 896))


def median_us(
    fn: Callable[[], object], budget_s: float, min_runs: int = 5, max_runs: int = 500
) -> tuple[float, float, int]:
    """(median, min microseconds, runs) of ``fn`` after one warm-up, running until budget_s or max_runs."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or (len(times) < max_runs and time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e6), float(min(times) * 1e6), len(times)


def latency_case(R: int, E: int, K: int, S: int, skew: float, seed: int, quick: bool) -> dict:
    """One (R, E) row: plan vs rebalance_experts on the same zipf load, with balance after each."""
    T = zipf_counts(R, E, K, S, skew, seed)
    epn = E // R
    p = plan(T)
    verify(p, T, routes=False)
    # a training loop keeps each layer's plan for the backward; holding the last few plans alive the same
    # way keeps glibc from trimming and re-faulting the heap on every call (a 3-4x swing at (64, 896))
    recent: deque = deque(maxlen=4 if R * E <= 1 << 20 else 2)  # big plans hold [E, R] arrays: keep two
    plan_us, plan_min, plan_runs = median_us(lambda: recent.append(plan(T)), 0.3 if quick else 2.0)
    load = T.sum(0)[None, :]
    # same spare memory as the planner: every GPU holds epn own + epn replica slots, one node
    eplb = lambda: rebalance_experts(load, E + R * epn, R, 1, R)  # noqa: E731
    eplb_us, eplb_min, eplb_runs = median_us(eplb, 0.3 if quick else 3.0, min_runs=1 if quick else 3, max_runs=50)
    phy2log, _, logcnt = eplb()
    loads = gpu_loads(load, np.asarray(phy2log), np.asarray(logcnt), R)[0]  # numpy in: numpy out
    return {
        "R": R,
        "E": E,
        "K": K,
        "S": S,
        "plan_us": round(plan_us, 2),
        "eplb_us": round(eplb_us, 2),
        "speedup_vs_eplb": round(eplb_us / plan_us, 2),
        "balance": balance(p),
        "eplb_balance": round(load_balance(loads), 6),
        "replicas": p.num_replicas,
        "migrated_rows": p.migrated,
        "plan_us_min": round(plan_min, 2),
        "eplb_us_min": round(eplb_min, 2),
        "plan_runs": plan_runs,
        "eplb_runs": eplb_runs,
    }


def sticky_section(quick: bool, seed: int) -> dict:
    """Expert copies per step on a drifting-routing trace: plain plan vs sticky plan (previous=last plan)."""
    R, E, K, S, steps = (16, 128, 8, 256, 10) if quick else (64, 896, 8, 4096, 50)
    plain = sticky = None
    copies_plain = copies_sticky = replicas_plain = replicas_sticky = 0
    worst_balance = 1.0
    for T in drifting_trace(R, E, K, S, steps, skew=1.2, drift=0.05, seed=seed):
        p, s = plan(T), plan(T, previous=sticky)
        verify(s, T, routes=False)
        worst_balance = max(worst_balance, balance(s))
        copies_plain += new_copies(plain, p)
        copies_sticky += new_copies(sticky, s)
        replicas_plain += p.num_replicas
        replicas_sticky += s.num_replicas
        plain, sticky = p, s
    return {
        "R": R,
        "E": E,
        "K": K,
        "S": S,
        "steps": steps,
        "skew": 1.2,
        "drift": 0.05,
        "copies_per_step_plain": copies_plain / steps,
        "copies_per_step_sticky": copies_sticky / steps,
        "copies_ratio": round(copies_sticky / max(copies_plain, 1), 4),
        "replicas_per_step_plain": replicas_plain / steps,
        "replicas_per_step_sticky": replicas_sticky / steps,
        "balance": worst_balance,
    }


def topology_grid(quick: bool) -> list[tuple[str, int, int, int, int]]:
    """(load, R, E, K, S) rows of the topology section, 8 ranks per node; E = 896, K = 16 is K3's layer."""
    if quick:
        return [("zipf", 16, 128, 8, 256), ("router", 16, 128, 8, 256)]
    shapes = [(16, 128, 8), (32, 256, 8), (64, 512, 8)]
    rows = [(load, R, E, K, S) for load in SYNTHETIC_LOADS for S in (256, 1024, 4096) for R, E, K in shapes]
    return rows + [("router", 64, 896, 16, S) for S in (256, 1024, 4096)]


def topology_section(
    quick: bool, seed: int, timed: bool = True, grid: list[tuple[str, int, int, int, int]] | None = None
) -> list[dict]:
    """Inter-node routed rows and replica weights: plain plan vs topology-aware plan, skewed loads.

    ``bytes_ratio_bound``: ``metrics.internode_bound`` over the same loads, as a ratio of the plain plan's
    bytes; no plan with these caps (any pairing rule) goes below it. timed=False skips the latencies
    (``plan_us_*`` = None) for callers that only want the ratios; grid: rows to run (default
    ``topology_grid(quick)``)."""
    rows = []
    rpn = 8
    for load, R, E, K, S in topology_grid(quick) if grid is None else grid:
        node = np.arange(R) // rpn
        acc = np.zeros(5, np.int64)
        worst = 1.0
        for s in range(2 if quick else 4):
            T = SYNTHETIC_LOADS[load](R, E, K, S, 1.2, seed + s)
            p, q = plan(T), plan(T, topology=rpn)
            verify(q, T, routes=False)
            worst = max(worst, balance(q))
            a, b = internode(p, node), internode(q, node)
            acc += [
                a["routed_rows"],
                b["routed_rows"],
                a["weight_copies"],
                b["weight_copies"],
                internode_bound(T, node, weight_rows=EXPERT_BYTES // ROW_BYTES),
            ]
        bytes_plain = int(acc[0]) * ROW_BYTES + int(acc[2]) * EXPERT_BYTES
        bytes_topo = int(acc[1]) * ROW_BYTES + int(acc[3]) * EXPERT_BYTES
        plain_us = topo_us = None
        if timed:  # latency on the last load: what the topology passes add
            budget = 0.05 if quick else 0.3
            plain_us = round(median_us(lambda T=T: plan(T), budget)[0], 1)
            topo_us = round(median_us(lambda T=T: plan(T, topology=rpn), budget)[0], 1)
        rows.append(
            {
                "load": load,
                "R": R,
                "nodes": R // rpn,
                "E": E,
                "K": K,
                "S": S,
                "skew": 1.2,
                "routed_rows_plain": int(acc[0]),
                "routed_rows_topology": int(acc[1]),
                "weight_copies_plain": int(acc[2]),
                "weight_copies_topology": int(acc[3]),
                "routed_ratio": round(acc[1] / max(acc[0], 1), 4),
                "weight_ratio": round(acc[3] / max(acc[2], 1), 4),
                "bytes_ratio": round(bytes_topo / max(bytes_plain, 1), 4),
                "bytes_ratio_bound": round(int(acc[4]) * ROW_BYTES / max(bytes_plain, 1), 4),
                "plan_us_plain": plain_us,
                "plan_us_topology": topo_us,
                "balance": worst,
            }
        )
    return rows


SLACKS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
K3_COST = {"H": 7168, "F": 2048, "weight_bytes": 2, "flops": 400e12, "bandwidth": 50e9}
"""A K3-like expert (bf16, H=7168, F=2048) on an H200-class GPU: 400 TFLOP/s achieved, 50 GB/s per GPU across
nodes (what an expert copy and its gradient cross). The prices ``CostModel.from_shape`` derives from them."""


def slack_section(quick: bool, seed: int) -> list[dict]:
    """Replicas, busiest rank's rows and predicted layer time vs σ, and the σ the cost model chooses, on router
    loads at K3's layer shape (896 experts, top-16, 64 ranks; quick: 8 ranks, 64 experts)."""
    R, E, K, S = (8, 64, 8, 256) if quick else (64, 896, 16, 4096)
    cost = CostModel.from_shape(**K3_COST, max_slack=max(SLACKS))
    rows = []
    for skew in (0.6, 1.0, 1.2):
        T = router_counts(R, E, K, S, skew, seed)
        entry = {"load": f"router:{skew}", "R": R, "E": E, "K": K, "S": S, "sigma": []}
        for sigma in SLACKS:
            p = plan(T, slack=sigma)
            verify(p, T, slack=sigma, routes=False)
            secs = cost.rank_seconds(p.cu_seqlens[:, -1], p.donor, p.experts_to_copy).max()
            entry["sigma"].append(
                {"slack": sigma, "replicas": p.num_replicas, "max_rows": int(p.caps.max()), "predicted_ms": secs * 1e3}
            )
        chosen = plan(T, cost=cost)
        mean = T.sum() / R
        entry["cost_choice"] = {
            "slack": round(float(chosen.caps.max()) / mean - 1, 4),
            "replicas": chosen.num_replicas,
            "predicted_ms": cost.rank_seconds(chosen.cu_seqlens[:, -1], chosen.donor, chosen.experts_to_copy).max()
            * 1e3,
            "plan_us": median_us(lambda T=T: plan(T, cost=cost), 0.2 if quick else 1.0)[0],
        }
        entry["no_replicas_slack"] = round(float(T.sum(0).reshape(R, -1).sum(1).max()) / mean - 1, 4)
        rows.append(entry)
    return rows


def run(
    quick: bool = False, seed: int = 0, K: int = 16, S: int = 4096, skew: float = 1.2, progress: bool = True
) -> dict:
    """The whole benchmark as one JSON-ready dict (see planner/README.md for the fields)."""
    cases = QUICK_CASES if quick else FULL_CASES
    S = 256 if quick else S
    iterator = cases
    if progress and not quick:
        iterator = tqdm(cases, desc="planner bench", unit="case")
    results = [latency_case(R, E, K, S, skew, seed, quick) for R, E in iterator]
    return {
        "benchmark": "planner",
        "quick": quick,
        "seed": seed,
        "load": f"zipf:{skew}",
        "cases": results,
        "sticky": sticky_section(quick, seed),
        "topology": topology_section(quick, seed),
        "slack": slack_section(quick, seed),
        "cost_model": K3_COST,
        "bytes_model": {"row_bytes": ROW_BYTES, "expert_bytes": EXPERT_BYTES},
        "environment": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "numba": _kernel.HAS_NUMBA,
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
    }


def format_report(result: dict) -> str:
    """Human tables for a bench result."""
    lines = [
        f"{'R':>5} {'E':>6} {'plan us':>10} {'eplb us':>12} {'x faster':>9} {'balance':>8} "
        f"{'eplb bal':>9} {'replicas':>8}"
    ]
    for c in result["cases"]:
        lines.append(
            f"{c['R']:>5} {c['E']:>6} {c['plan_us']:>10.1f} {c['eplb_us']:>12.1f} "
            f"{c['speedup_vs_eplb']:>9.1f} {c['balance']:>8.4f} {c['eplb_balance']:>9.4f} "
            f"{c['replicas']:>8}"
        )
    s = result["sticky"]
    lines.append(
        f"sticky (R={s['R']}, E={s['E']}, {s['steps']} drifting steps): copies/step plain "
        f"{s['copies_per_step_plain']:.1f}, sticky {s['copies_per_step_sticky']:.1f} "
        f"-> ratio {s['copies_ratio']:.3f} (goal <= 0.5), balance {s['balance']:.4f}"
    )
    for t in result["topology"]:
        lines.append(
            f"topology ({t['load']}, R={t['R']}, {t['nodes']} nodes, E={t['E']}, K={t['K']}, S={t['S']}): "
            f"inter-node routed rows x"
            f"{t['routed_ratio']:.3f}, weight copies x{t['weight_ratio']:.3f}, bytes x"
            f"{t['bytes_ratio']:.3f} (goal <= 0.7; no plan below x{t['bytes_ratio_bound']:.3f}), "
            f"balance {t['balance']:.4f}, plan {t['plan_us_plain']:.0f} / {t['plan_us_topology']:.0f} us"
        )
    for t in result.get("slack", []):
        per = ", ".join(
            f"σ={e['slack']:g}: {e['replicas']} copies, {e['max_rows']} rows, {e['predicted_ms']:.2f} ms"
            for e in t["sigma"]
        )
        c = t["cost_choice"]
        lines.append(
            f"slack ({t['load']}, R={t['R']}, E={t['E']}, K={t['K']}, S={t['S']}; no replicas from σ="
            f"{t['no_replicas_slack']:g}): {per}; cost chooses σ={c['slack']:g} ({c['replicas']} copies, "
            f"{c['predicted_ms']:.2f} ms, plan {c['plan_us']:.0f} us)"
        )
    return "\n".join(lines)
