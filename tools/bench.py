"""``moonep bench telemetry``: step time with and without telemetry sampling, in the same run.

The workload alternates blocks of steps with the sampler off and on (``telemetry_blocks``); each on-block is
compared with the off-block just before it (median step time on / off), and the reported ``ratio`` is the median
of those pair ratios, so slow drift of a shared machine cancels within a pair. Because that ratio is noisy on a
busy host, the report also gives the sampler's *duty*: the CPU seconds the sampling thread used divided by the
wall time it ran, an upper bound on what it can take from the training thread.
"""

from __future__ import annotations

import statistics
import tempfile
import time

from tools.telemetry import Sampler
from tools.workload import WorkloadConfig, run_local


def sampler_duty(interval_s: float, seconds: float = 1.0, prefer: str = "auto") -> dict:
    """Run a sampler alone for ``seconds``; its thread's CPU share and per-sample cost."""
    with tempfile.TemporaryDirectory() as tmp:
        s = Sampler(0, tmp, interval_s, prefer=prefer)
        s.start()
        time.sleep(seconds)
        s.stop()
        s.close()
        return {
            "source": s.source,
            "samples": s.samples,
            "thread_cpu_s": s.cpu_s,
            "duty": s.cpu_s / seconds,
            "cost_per_sample_s": s.cpu_s / max(1, s.samples),
        }


def bench_telemetry(world_size: int = 1, steps: int = 200, blocks: int = 20, interval_s: float = 0.05) -> dict:
    """The benchmark JSON: ``ratio`` (on/off step time, goal <= 1.02), medians, duty, settings."""
    if blocks < 2 or steps < 2 * blocks:
        raise ValueError(f"need blocks >= 2 and steps >= 2 * blocks, got steps={steps}, blocks={blocks}")
    cfg = WorkloadConfig(steps=steps, telemetry_interval_s=interval_s, telemetry_blocks=blocks)
    with tempfile.TemporaryDirectory() as tmp:
        res = run_local(cfg, world_size, tmp)
    size = max(1, steps // blocks)  # the workload's block length
    by_block: dict[int, list[float]] = {}
    for i, t in enumerate(res["step_s"][1:], 1):  # step 0 carries one-off warm-up
        by_block.setdefault(i // size, []).append(t)
    pairs = [
        statistics.median(by_block[b + 1]) / statistics.median(by_block[b])
        for b in range(0, max(by_block), 2)
        if b in by_block and b + 1 in by_block
    ]
    on = [t for t, s in zip(res["step_s"][1:], res["sampling"][1:]) if s]
    off = [t for t, s in zip(res["step_s"][1:], res["sampling"][1:]) if not s]
    duty = sampler_duty(interval_s)
    return {
        "benchmark": "telemetry",
        "world_size": world_size,
        "steps": steps,
        "blocks": blocks,
        "interval_s": interval_s,
        "median_step_off_s": statistics.median(off),
        "median_step_on_s": statistics.median(on),
        "ratio": statistics.median(pairs),
        "pair_ratios": pairs,
        "goal_ratio": 1.02,
        "source": duty["source"],
        "sampler_duty": duty["duty"],
        "sampler_cost_per_sample_s": duty["cost_per_sample_s"],
    }
