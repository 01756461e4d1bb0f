"""``moonep bench train``: training throughput and peak memory of a preset at EP = 1, 2, 4 (local CPU ranks).

Per world size: build the trainer, run one warm-up step, time ``steps`` steps (fwd + bwd + sync + optimizer +
balancing; the slowest rank's time per step), report global tokens/s from the median step and each rank's peak
resident memory (``ru_maxrss``, the whole process: torch, buffers and activations; torch has no CPU allocator
statistics). JSON: ``{"config", "results": [{"world_size", "tokens_per_s", "step_s", "peak_rss_mb"}]}``.
"""
from __future__ import annotations

import dataclasses
import resource
import statistics
import tempfile
import time

import torch


def timed_steps(comm, trainer, first: int, steps: int) -> list[float]:
    """Seconds of ``trainer.step(first)`` ... ``trainer.step(first + steps - 1)``, each started after a barrier,
    the slowest rank's time per step (the same list on every rank)."""
    times = []
    for step in range(first, first + steps):
        comm.barrier()
        t0 = time.perf_counter()
        trainer.step(step)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if comm.world_size > 1:
            comm.all_reduce(dt, op="max")
        times.append(float(dt))
    return times


def bench_rank(comm, train: dict, steps: int) -> dict:
    from .train import Trainer, TrainConfig

    torch.set_num_threads(1)
    tc = TrainConfig(**train)
    trainer = Trainer(comm, tc)
    trainer.step(0)  # warm-up: allocations, first plan
    times = timed_steps(comm, trainer, 1, steps)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    if comm.world_size > 1:
        comm.all_reduce(rss, op="max")
    step_s = statistics.median(times)
    return {"world_size": comm.world_size, "tokens_per_s": tc.global_batch * tc.seq_len / step_s,
            "step_s": step_s, "peak_rss_mb": float(rss)}


def run_bench(preset: str = "tiny", world_sizes=(1, 2, 4), steps: int = 5, max_data_bytes: int = 1 << 20) -> dict:
    from collectives import launch

    from .train import TrainConfig

    results = []
    with tempfile.TemporaryDirectory(prefix="k3-bench-") as tmp:
        for ws in world_sizes:
            tc = TrainConfig(preset=preset, world_size=ws, steps=steps + 1, progress=False, run_dir=tmp,
                             max_data_bytes=max_data_bytes)
            results.append(launch(bench_rank, ws, timeout=300, train=dataclasses.asdict(tc), steps=steps))
    return {"config": {"preset": preset, "steps": steps, "threads_per_rank": 1,
                       "global_batch": tc.global_batch, "seq_len": tc.seq_len}, "results": results}


__all__ = ["run_bench", "bench_rank", "timed_steps"]
