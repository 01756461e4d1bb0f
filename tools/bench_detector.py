"""``moonep bench detector``: a training-like loop with and without ``StragglerDetector``, in the same run.

The loop's step is busy CPU work of about ``step_ms`` (small matmuls, calibrated once), split into four sections
as a user would time them. Blocks of steps alternate detector off / on; each on-block is compared with the
off-block before it (median step time on / off) and ``ratio`` is the median of those pair ratios, so the host's
slow drift cancels within a pair. The detector's own seconds (its timing calls per step, and each gather with
rank 0's diagnosis) are also counted directly: ``overhead_ms_per_step`` is the figure the goal is set on (under
1% of a 50 ms step), ``ratio`` the end-to-end check. One process, no process group (a gather is then the
diagnosis alone; across ranks add one gather of a few kB every ``every`` steps).
"""

from __future__ import annotations

import statistics
import time

import torch

from moonep_base import MAX_SECONDS, seconds_problem
from tools.detector import StragglerDetector


def _work(n: int, a: torch.Tensor) -> torch.Tensor:
    for _ in range(n):
        a = (a @ a).tanh_()
    return a


def _calibrate(step_ms: float) -> int:
    """Matmuls per step for about ``step_ms``."""
    a = torch.randn(128, 128)
    _work(20, a)
    start = time.perf_counter()
    _work(200, a)
    n = max(4, round(step_ms / 1e3 / ((time.perf_counter() - start) / 200)))
    took = statistics.median(_step(None, n, a) for _ in range(5))  # a whole step runs colder than a tight loop
    return max(4, round(n * step_ms / 1e3 / took))


def _step(det: StragglerDetector | None, n: int, a: torch.Tensor) -> float:
    start = time.perf_counter()
    if det is None:
        for _ in range(4):
            _work(n // 4, a)
    else:
        with det.step():
            for name in ("data", "forward", "backward", "optimizer"):
                with det.section(name, kind="data" if name == "data" else "compute"):
                    _work(n // 4, a)
    return time.perf_counter() - start


def bench_detector(steps: int = 400, blocks: int = 10, step_ms: float = 50.0, every: int = 50) -> dict:
    """The benchmark JSON (module docstring); ``steps`` split into ``blocks`` alternating off / on blocks."""
    if blocks < 2 or blocks % 2 or steps < 2 * blocks or seconds_problem(step_ms / 1e3) or every < 1:
        raise ValueError(  # step_ms inf was an OverflowError in the calibration's round()
            f"need an even blocks >= 2, steps >= 2 * blocks, step_ms in (0, {MAX_SECONDS * 1000}] and every >= 1; "
            f"got steps={steps}, blocks={blocks}, step_ms={step_ms}, every={every}"
        )
    n = _calibrate(step_ms)
    a = torch.randn(128, 128)
    det = StragglerDetector(every=every, window=max(every, 100))
    size = steps // blocks
    times: dict[int, list[float]] = {}
    for b in range(blocks):
        on = b % 2 == 1
        times[b] = [_step(det if on else None, n, a) for _ in range(size)]
    det.close()
    pairs = [statistics.median(times[b + 1]) / statistics.median(times[b]) for b in range(0, blocks, 2)]
    on_steps = size * (blocks // 2)
    overhead = (det.cost_s + det.gather_s) / on_steps
    off = statistics.median(t for b in range(0, blocks, 2) for t in times[b])
    return {
        "benchmark": "detector",
        "steps": steps,
        "blocks": blocks,
        "every": every,
        "median_step_off_s": off,
        "median_step_on_s": statistics.median(t for b in range(1, blocks, 2) for t in times[b]),
        "ratio": statistics.median(pairs),
        "pair_ratios": pairs,
        "overhead_ms_per_step": overhead * 1e3,
        "overhead_fraction": overhead / off,
        "timing_ms_per_step": det.cost_s / on_steps * 1e3,
        "gather_ms_each": det.gather_s / max(1, det.gathers) * 1e3,
        "goal_fraction": 0.01,
        "passed": overhead / off < 0.01,
    }
