"""``moonep bench device-planner``: the latency of ``planner.plan`` on tensor counts, where the EP layer calls it.

On CUDA every call is timed with CUDA events around the device kernel's launch (the counts are already on the
GPU, as after the EP layer's all-gather; no host sync inside the timed region but the events'), after a warm-up
that compiles the kernel. On CPU the same call runs the compiled CPU kernel on a zero-copy view, timed with
``perf_counter``. Every shape's plan is also checked against the numpy planner field by field, so a fast wrong
kernel cannot report a good number. The issue's goal: <= 100 us per plan at R = 64, E = 896 on one H200.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from planner.core import plan
from planner.synthetic import router_counts

FIELDS = ("alloc", "donor", "experts_to_copy", "send_counts", "cu_seqlens", "flows")
SHAPES = ((64, 896, 16, 4096), (32, 256, 8, 4096), (8, 64, 8, 1024))
"""(R, E, K, S): K3's expert count and top-k at 64 ranks, a DeepSeek-V3-like group, a small group."""
QUICK_SHAPES = ((4, 16, 2, 64),)
GOAL_US = 100.0


def run(device: str, *, quick: bool = False, iters: int = 50, seed: int = 0) -> dict:
    """Median / p90 microseconds per plan for each shape on ``device`` ("cuda" or "cpu")."""
    import torch  # heavy: torch, only for this benchmark

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch.cuda.is_available() is False (run it where a GPU is visible)")
    rows = []
    for R, E, K, S in QUICK_SHAPES if quick else SHAPES:
        counts = router_counts(R, E, K, S, 1.2, seed)
        T = torch.from_numpy(counts).to(device)
        got = plan(T, defer_errors=True)
        for _ in range(2 if quick else 5):  # warm-up: the first CUDA launch compiles the kernel
            got = plan(T, defer_errors=True)
        times = _times_us(lambda T=T: plan(T, defer_errors=True), device, 3 if quick else iters)
        rows.append(
            {
                "R": R,
                "E": E,
                "K": K,
                "S": S,
                "median_us": statistics.median(times),
                "p90_us": sorted(times)[int(0.9 * (len(times) - 1))],
                "iters": len(times),
                "equal_to_numpy_planner": _same(plan(counts), got.to_plan()),
            }
        )
    return {"device": device, "name": _device_name(device), "goal_us": GOAL_US, "rows": rows}


def _times_us(call, device: str, iters: int) -> list[float]:
    import torch  # heavy: torch, only for this benchmark

    out = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            call()
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def _same(host, dev) -> bool:
    return all(np.array_equal(getattr(host, f), getattr(dev, f)) for f in FIELDS)


def _device_name(device: str) -> str:
    import torch  # heavy: torch, only for this benchmark

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def format_report(report: dict) -> str:
    """A table: one row per shape."""
    lines = [
        f"device planner on {report['name']} (goal <= {report['goal_us']:g} us at R = 64, E = 896)",
        f"{'R':>4} {'E':>5} {'K':>3} {'S':>5} {'median us':>10} {'p90 us':>8}  equal to numpy",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['R']:>4} {r['E']:>5} {r['K']:>3} {r['S']:>5} {r['median_us']:>10.1f} {r['p90_us']:>8.1f}"
            f"  {r['equal_to_numpy_planner']}"
        )
    return "\n".join(lines)
