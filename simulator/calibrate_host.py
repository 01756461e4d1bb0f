"""What bounds a small eager job on CPU, measured for the ``host`` block of a calibrated profile
(``simulator.host`` prices a step with it; ``simulator.calibrate`` runs these on its ranks).

Each cost is the wall time one rank sees while all local ranks do the same work at once (``shared_timer``), or
the CPU time of one rank alone (``solo_timer``): the framework op cost of a reference eager block, the KDA
kernel, the per-call and per-MB wall cost of the collectives, and the effective cores. Imports torch, and
``cp_kda`` inside ``measure_kda`` (a layering exception listed in ``tests/test_layers.py``: it times the real
kernel).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from simulator.calibration_sizes import CalibrationSizes


def timed(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def _reference_block(width: int):
    """A small eager block in the style of model code: RMS norm, tanh/sigmoid gate, softmax mix of two sources
    and a row gather, each an ``nn.Module`` call under autograd."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(width))
            self.bias = nn.Parameter(torch.zeros(width))

        def forward(self, x):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.gain
            h = torch.tanh(h / 4.0) * torch.sigmoid(h + self.bias)
            h = h.index_select(0, torch.arange(x.shape[0])).contiguous()
            v = torch.stack([x, h], 0)
            w = torch.softmax(v.mean(-1), dim=0)
            return (w.unsqueeze(-1) * v).sum(0)

    return nn.Sequential(*(Block() for _ in range(20)))


def _count_ops(fn) -> int:
    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def solo_timer(repeats: int):
    """Seconds per call of ``fn`` on this rank alone: median CPU time of ``repeats`` calls after a warm-up."""
    return lambda fn: timed(fn, repeats, time.process_time)


def _agreed_count(comm, fn, seconds: float, minimum: int) -> int:
    """How many calls of ``fn`` take about ``seconds`` of CPU time on this rank (after a warm-up call); the
    largest over ranks, so that every rank runs the same count."""
    fn()
    t0 = time.process_time()
    fn()
    count = torch.tensor([max(minimum, round(seconds / max(time.process_time() - t0, 1e-6)))], dtype=torch.int64)
    comm.all_reduce(count, op="max", validate=False)
    return int(count)


def _wall_per_call(comm, fn, count: int) -> float:
    """Seconds per call of ``fn`` looped ``count`` times by every rank at once after a barrier: wall time,
    mean over ranks."""
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(count):
        fn()
    wall = torch.tensor([(time.perf_counter() - t0) / count], dtype=torch.float64)
    comm.all_reduce(wall, validate=False)
    return float(wall) / comm.world_size


def shared_timer(comm, seconds: float):
    """Seconds per call of ``fn`` while every rank of ``comm`` runs it: each rank loops ``fn`` for about
    ``seconds`` of CPU time (the same count on all ranks), wall time per call averaged over ranks. That is the
    time one rank of a job sees when all local ranks do this work at once, time sharing included, measured
    directly rather than as a solo cost times a separately measured stretch (whose noises multiply). Ranks that
    finish first free their cores for the rest, so the tail reads slightly less contention than a job sees."""
    return lambda fn: _wall_per_call(comm, fn, _agreed_count(comm, fn, seconds, 3))


def measure_ops(tokens: int, width: int, timer) -> tuple[float, float, float]:
    """Microseconds per framework op of the reference block: (forward, backward, no-grad forward), as
    ``timer`` (``solo_timer`` or ``shared_timer``) measures a call."""
    blocks, x = _reference_block(width), torch.randn(tokens, width, requires_grad=True)

    def fwd():
        return blocks(x)

    y = fwd()
    n_fwd, n_bwd = _count_ops(fwd), _count_ops(lambda: y.sum().backward())
    t_fwd = timer(fwd)
    t_both = timer(lambda: fwd().sum().backward())
    with torch.no_grad():
        t_nograd = timer(fwd)
    return t_fwd / n_fwd * 1e6, max(0.0, t_both - t_fwd) / n_bwd * 1e6, t_nograd / n_fwd * 1e6


def measure_kda(batch: int, seq: int, heads: int, dim: int, timer) -> float:
    """Microseconds of one ``cp_kda`` gate + chunk call, forward and backward, on ``[batch, seq, heads, dim]``."""
    import cp_kda  # layering exception: times the real kernel (listed in tests/test_layers.py)

    gen = torch.Generator().manual_seed(0)
    shape = (batch, seq, heads, dim)
    q, k = (torch.nn.functional.normalize(torch.randn(shape, generator=gen), dim=-1) for _ in range(2))
    v, f = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    beta = torch.rand(shape[:3], generator=gen)
    leaves = [t.requires_grad_() for t in (q, k, v, f, beta)]
    a_log, dt_bias = torch.zeros(heads, requires_grad=True), torch.zeros(heads * dim, requires_grad=True)

    def run():
        g = cp_kda.kda_gate(leaves[3], a_log, dt_bias, lower_bound=-5.0)
        cp_kda.kda_chunk(leaves[0], leaves[1], leaves[2], g, leaves[4])[0].sum().backward()

    return timer(run) * 1e6


def _per_call_us(comm, fn, repeats: int) -> float:
    """Wall microseconds per call of the collective ``fn``, all ranks calling back to back, mean over ranks.

    Wall, not CPU time: with ranks time-sharing cores a call lasts until every peer has been scheduled to do its
    part (measured here at 4 ranks on 2 cores: 2.6-2.8x a call's CPU time, against 2.2x for busy work), and that
    is what a training step waits for."""
    fn()
    return _wall_per_call(comm, fn, repeats) * 1e6


def collective_costs(comm, repeats: int, big: int) -> dict:
    """Per-call and per-MB wall costs of the collectives a training step issues (small vs ``big`` bytes)."""
    R, out = comm.world_size, {}
    for nbytes, tag in ((1024, "small"), (big, "big")):
        rows = max(R, nbytes // 128 // R * R)
        inp = torch.ones(rows, 32)
        got = torch.empty_like(inp)
        out[f"a2a_{tag}"] = _per_call_us(
            comm, lambda got=got, inp=inp: comm.all_to_all_single(got, inp, validate=False, splits_agreed=True), repeats
        )
        buf = torch.ones(max(1, nbytes // 4))
        out[f"ar_{tag}"] = _per_call_us(comm, lambda buf=buf: comm.all_reduce(buf, validate=False), repeats)
    small = torch.ones(256)
    out["checked"] = _per_call_us(comm, lambda: comm.all_reduce(small), repeats)
    counts, gathered = torch.zeros(16, dtype=torch.int64), torch.empty(16 * R, dtype=torch.int64)
    out["ag"] = _per_call_us(comm, lambda: comm.all_gather(gathered, counts, validate=False), repeats)
    return out


PROBE_SECONDS = 0.3
"""CPU seconds of the effective-cores work on one rank alone: shorter windows are dominated by scheduler
granularity (a 50 ms probe scattered 0.6-2.0 effective cores on one idle-ish machine, 300 ms 0.8-1.05)."""


def effective_cores(comm, sizes: CalibrationSizes, rounds: int) -> float:
    """Throughput of all ranks busy at once, in units of one rank alone: R * (CPU time alone) / (wall together)."""
    blocks, x = _reference_block(sizes.hidden), torch.randn(sizes.tokens, sizes.hidden, requires_grad=True)

    def step():
        blocks(x).sum().backward()

    count = _agreed_count(comm, step, PROBE_SECONDS, 1)  # every rank does the same work

    def work():
        return [step() for _ in range(count)]

    ratios = []
    for _ in range(rounds):
        comm.barrier()
        alone = torch.zeros(1, dtype=torch.float64)
        if comm.rank == 0:
            t0 = time.process_time()
            work()
            alone[0] = time.process_time() - t0
        comm.all_reduce(alone, validate=False)
        comm.barrier()
        t0 = time.perf_counter()
        work()
        wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        comm.all_reduce(wall, op="max", validate=False)
        ratios.append(comm.world_size * float(alone) / float(wall))
    return min(float(comm.world_size), statistics.median(ratios))


BIG = 1 << 20
"""Bytes of the large collective measurements (the per-MB costs are big minus small)."""


def op_costs(sizes: CalibrationSizes, timer) -> dict:
    """Per-op and KDA host costs as ``timer`` measures them."""
    tiny, act = measure_ops(8, 8, timer), measure_ops(sizes.tokens, sizes.hidden, timer)
    rows, tiny_tokens = sizes.tokens // sizes.seq_len, min(16, sizes.tokens // 2)  # tiny: the fixed cost
    return {
        "ops_tiny": tiny,
        "ops_act": act,
        "tiny_tokens": tiny_tokens,
        "kda": measure_kda(rows, sizes.seq_len, sizes.kda_heads, sizes.kda_head_dim, timer),
        "kda_tiny": measure_kda(1, tiny_tokens, sizes.kda_heads, sizes.kda_head_dim, timer),
    }


def calibrate_host(m: dict) -> dict:
    """The ``host`` block of a CPU profile (fields of ``hardware.HostSpec``) from ``measure_in_group``'s (or a
    one-rank ``calibrate``'s) measurements."""

    def per_mb(key: str) -> float:
        return max(0.0, m.get(f"{key}_big", 0.0) - m.get(f"{key}_small", 0.0)) / (BIG / 1e6)

    (tf, tb, tn), (af, ab, _) = m["ops_tiny"], m["ops_act"]
    sizes = m["sizes"]
    return {
        "timing": "shared_wall",
        "cores": len(os.sched_getaffinity(0)),
        "effective_cores": m.get("effective_cores", 1.0),
        "ranks": m["world_size"],
        "op_fwd_tiny_us": tf,
        "op_bwd_tiny_us": tb,
        "op_nograd_tiny_us": tn,
        "op_fwd_us": af,
        "op_bwd_us": ab,
        "ref_elements": sizes["tokens"] * sizes["hidden"],
        "kda_us": m["kda"],
        "kda_tiny_us": m["kda_tiny"],
        "kda_elements": sizes["tokens"] * sizes["kda_heads"] * sizes["kda_head_dim"],
        "kda_tiny_elements": m["tiny_tokens"] * sizes["kda_heads"] * sizes["kda_head_dim"],
        "a2a_call_us": m.get("a2a_small", 0.0),
        "all_reduce_call_us": m.get("ar_small", 0.0),
        "checked_all_reduce_call_us": m.get("checked", 0.0),
        "all_gather_call_us": m.get("ag", 0.0),
        "a2a_us_per_mb": per_mb("a2a"),
        "all_reduce_us_per_mb": per_mb("ar"),
    }
