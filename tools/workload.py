"""A small synthetic MoE-like training step on real ranks, for demos and accuracy tests of the detectors.

Per step, each rank: loads data (random rows; an injected delay on one rank), runs a dense compute phase (a
matmul loop), routes its rows to ranks (uniform, or ``skew`` of them to ``hot_rank``: routing imbalance),
exchanges counts and dispatches rows with ``all_to_all_single`` (routing-dependent uneven splits), runs the
"expert" matmuls on the rows it received, combines them back, and all-reduces a small gradient. Compute and
data phases are recorded with ``comm.tracer.record_event`` (``kind`` and ``tokens`` fields, see
``tools/traces.py``) and ``comm.tracer.step`` stamps every record with the step.

Injected compute slowdowns are *time-based*: the phase is timed and then extended by ``(factor - 1)`` x that time
of extra matmuls (an extra GEMM stream), so a factor means the same on any machine.

    python -m tools straggler-demo --world-size 4 --steps 40 --inject-slowdown rank=2,factor=1.3,from_step=10
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from collectives import launch
from collectives.faults import DataDelay, LinkDelay, Slowdown, check_fault_ranks, faults_at
from moonep_base import seconds_problem
from tools.telemetry import Sampler


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadConfig:
    """Shape and faults of the synthetic run."""

    steps: int = 30
    """Training steps."""
    hidden: int = 128
    """Row width H of the matmuls ([rows, H] x [H, H])."""
    tokens: int = 64
    """Rows each rank loads and routes per step."""
    compute_iters: int = 120
    """Matmuls in the dense phase per step (its cost)."""
    expert_iters: int = 60
    """Matmuls over the received rows per step (cost grows with the routed rows)."""
    skew: float = 0.0
    """Fraction of every rank's rows sent to ``hot_rank`` (0 = uniform router)."""
    hot_rank: int = 0
    """Rank that receives the skewed rows."""
    slowdowns: tuple[Slowdown, ...] = ()
    """Injected compute slowdowns."""
    data_delays: tuple[DataDelay, ...] = ()
    """Injected data-loading delays."""
    link_delays: tuple[LinkDelay, ...] = ()
    """Injected link delays (applied with ``comm.inject_link_delay`` when their step starts)."""
    seed: int = 0
    """Routing seed (per rank and step)."""
    telemetry_interval_s: float = 0.0
    """Sample telemetry every this many seconds next to the trace (0 = off)."""
    telemetry_blocks: int = 0
    """Benchmark mode: alternate telemetry off/on in this many blocks of steps (0 = not a benchmark)."""

    def __post_init__(self):
        for name in ("steps", "hidden", "tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.compute_iters < 0 or self.expert_iters < 0:
            raise ValueError("compute_iters and expert_iters must be >= 0")
        if not 0.0 <= self.skew <= 1.0:
            raise ValueError(f"skew must be in [0, 1], got {self.skew}")
        if self.hot_rank < 0 or self.telemetry_blocks < 0:
            raise ValueError("hot_rank and telemetry_blocks must be >= 0")
        if self.telemetry_interval_s != 0 and (problem := seconds_problem(self.telemetry_interval_s)):  # 0: no sampling
            raise ValueError(f"telemetry_interval_s {problem} (or 0: off)")


def _matmuls(x, w, n: int):
    for _ in range(n):
        x = (x @ w).tanh_()  # tanh keeps values bounded over many iterations
    return x


def _compute(comm, name: str, x, w, n: int, factor: float, **fields):
    """One compute phase, stretched by ``factor`` with extra matmuls, recorded as a trace event."""
    t0, c0 = time.time(), time.thread_time()
    y = _matmuls(x, w, n)
    if factor > 1.0:  # stretch in CPU time, so the factor is the same whether or not the core was shared
        end = c0 + (time.thread_time() - c0) * factor
        while time.thread_time() < end:
            _matmuls(x, w, 1)
    if comm.tracer is not None:
        comm.tracer.record_event(name, t0, time.time(), kind="compute", cpu_s=time.thread_time() - c0, **fields)
    return y


def _route(cfg: WorkloadConfig, world: int, rank: int, step: int):
    """Destination rank of each of this rank's rows, ``[T]`` int64, and the per-destination counts ``[R]``."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + rank)
    dest = torch.randint(0, world, (cfg.tokens,), generator=g)
    if cfg.skew > 0:
        hot = torch.rand(cfg.tokens, generator=g) < cfg.skew
        dest[hot] = cfg.hot_rank % world
    dest, _ = torch.sort(dest)
    return dest, torch.bincount(dest, minlength=world)


def _step(comm, cfg: WorkloadConfig, step: int, w) -> None:
    world, rank = comm.world_size, comm.rank
    factor, delay, _ = faults_at(cfg, rank, step)
    t0 = time.time()
    x = torch.randn(cfg.tokens, cfg.hidden, generator=torch.Generator().manual_seed(step))
    if delay:
        time.sleep(delay / 1000.0)
    if comm.tracer is not None:
        comm.tracer.record_event("data_load", t0, time.time(), kind="data")
    x = _compute(comm, "forward", x, w, cfg.compute_iters, factor)
    _, counts = _route(cfg, world, rank, step)
    recv_counts = torch.empty_like(counts)
    # only the dispatch keeps the argument-header check: its header exchange is the detectors' reference latency,
    # and on loopback every extra collective costs as much as the compute we want to see
    comm.all_to_all_single(recv_counts, counts, validate=False)  # one count per peer: everyone learns its incoming rows
    send, recv = counts.tolist(), recv_counts.tolist()
    received = torch.empty(sum(recv), cfg.hidden)
    comm.all_to_all_single(received, x, recv, send)  # dispatch
    y = _compute(comm, "expert_compute", received, w, cfg.expert_iters, factor, tokens=sum(recv))
    back = torch.empty(cfg.tokens, cfg.hidden)
    comm.all_to_all_single(back, y.contiguous(), send, recv, validate=False, splits_agreed=True)  # combine
    grad = back.sum(0)
    comm.all_reduce(grad, validate=False)


def run_workload(comm, cfg: WorkloadConfig, out_dir: str | None = None) -> dict:
    """Run on every rank (``collectives.launch(run_workload, R, trace_dir=d, cfg=cfg, out_dir=d)``).

    ``out_dir`` is where telemetry goes (default: the trace folder).

    Returns ``{"step_s": [...], "sampling": [...]}``: this rank's wall time per step and whether telemetry
    sampling was on during it (benchmark mode alternates it in ``telemetry_blocks`` blocks).
    """
    w = torch.randn(cfg.hidden, cfg.hidden, generator=torch.Generator().manual_seed(1)) / cfg.hidden**0.5
    sampler = None
    out_dir = out_dir or (os.path.dirname(comm.tracer.path) if comm.tracer is not None else None)
    if cfg.telemetry_interval_s > 0:
        sampler = Sampler(rank=comm.global_rank, out_dir=out_dir, interval_s=cfg.telemetry_interval_s)
    step_s, sampling = [], []
    block = max(1, cfg.steps // cfg.telemetry_blocks) if cfg.telemetry_blocks else 0
    try:
        for step in range(cfg.steps):
            for d in cfg.link_delays:
                if d.from_step == step:
                    comm.inject_link_delay(d.src, d.dst, d.ms)
            on = sampler is not None and (not block or (step // block) % 2 == 1)
            if sampler is not None:
                sampler.start() if on else sampler.stop()
            if comm.tracer is not None:
                comm.tracer.step = step
            t0 = time.perf_counter()
            _step(comm, cfg, step, w)
            step_s.append(time.perf_counter() - t0)
            sampling.append(on)
            if comm.tracer is not None:
                comm.tracer.flush()  # one append per step, so `diagnose --follow` sees each step as it ends
    finally:
        if sampler is not None:
            sampler.stop()
        if comm.tracer is not None:
            comm.tracer.flush()
    return {"step_s": step_s, "sampling": sampling}


def run_local(
    cfg: WorkloadConfig,
    world_size: int,
    trace_dir: str | None,
    *,
    timeout: float = 60.0,
    job_timeout: float | None = 300.0,
) -> dict:
    """Launch ``world_size`` local gloo ranks running the workload; rank 0's result."""
    check_fault_ranks(world_size, cfg.slowdowns, cfg.data_delays, cfg.link_delays)
    if cfg.skew > 0 and cfg.hot_rank >= world_size:  # a rank that does not exist would wrap to another one
        raise ValueError(f"hot_rank {cfg.hot_rank} is not a rank of a {world_size}-rank job (0..{world_size - 1})")
    return launch(
        run_workload,
        world_size,
        timeout=timeout,
        trace_dir=trace_dir,
        job_timeout=job_timeout,
        cfg=cfg,
        out_dir=trace_dir,
    )
