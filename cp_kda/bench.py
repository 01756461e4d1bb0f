"""``moonep bench kda``: chunked vs recurrent KDA, and context-parallel scaling (scan vs ring).

    moonep bench kda --json out.json            # T = 1k, 8k, 32k; CP = 1, 2, 4 at T = 32k (minutes on a CPU)
    python -m cp_kda bench kda --quick --json /tmp/kda.json   # seconds; what the test suite runs

JSON (stable keys):
    {"config": {...},
     "chunk_vs_recurrent": {"<T>": {"chunk": s, "recurrent": s, "speedup": x, "chunk_cpu": s, ...}, ...},
     "cp": [{"world_size", "strategy", "T", "seconds", "bytes_per_rank", "expected_bytes_per_rank"}, ...],
     "summary": {"speedup_at_8k", "chunk_32k_over_8k", "bytes_match", ...}}

Timings are forward-only for ``chunk_vs_recurrent`` (fp32, one thread, best of ``repeats``) and forward +
backward for ``cp`` (each rank one thread; the slowest rank counts). ``bytes_per_rank`` is the state payload one
rank contributes to one pass (scan: fp32 [B | M] = 4*H*K*(K+V) bytes; ring: 4*H*K*V per hop).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from collectives import launch
from cp_kda.chunk import kda_chunk
from cp_kda.cp import context_parallel_kda
from cp_kda.naive import kda_recurrent


def _inputs(T, H, K, V, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(1, T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(1, T, H, generator=gen))
    return [x.requires_grad_(requires_grad) for x in (q, k, v, g, beta)]


def _best(fn, repeats):
    """Best wall seconds of ``repeats`` calls."""
    return _best_wall_cpu(fn, repeats)[0]


def _best_wall_cpu(fn, repeats):
    """Best wall and best process-CPU seconds of ``repeats`` calls (CPU time is the steadier number on a
    shared machine; the two agree on an idle one)."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall, cpu


def bench_chunk_vs_recurrent(seq_lens, H, K, V, chunk_size=64, repeats=2):
    """``{str(T): {"chunk", "recurrent", "speedup"}}`` forward seconds, best of ``repeats`` (the recurrence
    is timed once above 8k tokens: it takes tens of seconds there)."""
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread, as each CP rank gets: compares algorithms, not thread scaling
    try:
        _time_each(out, seq_lens, H, K, V, chunk_size, repeats, kda_chunk, kda_recurrent)
    finally:
        torch.set_num_threads(threads)
    return out


def _time_each(out, seq_lens, H, K, V, chunk_size, repeats, kda_chunk, kda_recurrent):
    with torch.no_grad():
        for T in seq_lens:
            xs = _inputs(T, H, K, V)
            chunk, chunk_cpu = _best_wall_cpu(lambda xs=xs: kda_chunk(*xs, chunk_size=chunk_size), repeats)
            recurrent, rec_cpu = _best_wall_cpu(lambda xs=xs: kda_recurrent(*xs), repeats if T <= 8192 else 1)
            out[str(T)] = {
                "chunk": chunk,
                "recurrent": recurrent,
                "speedup": recurrent / chunk,
                "chunk_cpu": chunk_cpu,
                "recurrent_cpu": rec_cpu,
                "speedup_cpu": rec_cpu / chunk_cpu,
            }


def cp_bench_worker(comm, T, H, K, V, strategy, chunk_size, repeats):
    """One rank of the CP benchmark: forward + backward of its slice; returns the slowest rank's seconds."""
    torch.set_num_threads(1)
    n = T // comm.world_size
    xs = _inputs(T, H, K, V)
    local = [x[:, comm.rank * n : (comm.rank + 1) * n].clone().requires_grad_() for x in xs]
    stats = {}

    def step():
        o, _ = context_parallel_kda(*local, comm, strategy=strategy, chunk_size=chunk_size, stats=stats)
        o.sum().backward()

    step()  # warm-up (allocator, first collective)
    comm.barrier()
    seconds = _best(lambda: (step(), comm.barrier()), repeats)
    worst = torch.tensor([seconds], dtype=torch.float64)
    comm.all_reduce(worst, op="max")
    return {"seconds": worst.item(), "bytes_per_rank": stats["bytes_per_rank"]}


def bench_cp(world_sizes, strategies, T, H, K, V, chunk_size=64, repeats=1):
    """One entry per (world size, strategy); world size 1 runs in a spawned rank too, for a fair baseline."""
    entries = []
    for world in world_sizes:
        for strategy in strategies:
            if world == 1 and strategy == "ring":
                continue  # identical to scan at one rank
            res = launch(
                cp_bench_worker,
                world_size=world,
                timeout=600,
                T=T,
                H=H,
                K=K,
                V=V,
                strategy=strategy,
                chunk_size=chunk_size,
                repeats=repeats,
            )
            expected = 4 * H * K * (K + V) if strategy == "scan" else 4 * H * K * V
            entries.append(
                {
                    "world_size": world,
                    "strategy": strategy,
                    "T": T,
                    "seconds": res["seconds"],
                    "bytes_per_rank": res["bytes_per_rank"],
                    "expected_bytes_per_rank": expected,
                }
            )
    return entries


def bench_sizes(quick: bool) -> tuple[list[int], int, list[int]]:
    """(chunk-vs-recurrent sequence lengths, the CP runs' T, their world sizes)."""
    return ([256, 1024], 512, [1, 2]) if quick else ([1024, 8192, 32768], 32768, [1, 2, 4])


def input_bytes(quick: bool, H: int, K: int, V: int) -> int:
    """Bytes of the inputs alone (fp32 q, k, g [T, H, K], v [T, H, V], beta [T, H]) at the benchmark's largest
    moment: the widest CP run, where every rank builds the whole sequence's inputs before taking its slice."""
    _, cp_T, world_sizes = bench_sizes(quick)
    return 4 * cp_T * H * (3 * K + V + 1) * max(world_sizes)


def run_bench(quick=False, H=2, K=128, V=128, chunk_size=64):
    """The whole benchmark; ``quick`` shrinks every size so it runs in seconds (schema check)."""
    if quick:
        H, K, V = 1, 16, 16
    seq_lens, cp_T, world_sizes = bench_sizes(quick)
    cvr = bench_chunk_vs_recurrent(seq_lens, H, K, V, chunk_size, repeats=1 if quick else 3)
    cp = bench_cp(world_sizes, ["scan", "ring"], cp_T, H, K, V, chunk_size)
    mid, top = str(seq_lens[-2]), str(seq_lens[-1])
    base = next(e["seconds"] for e in cp if e["world_size"] == 1)
    summary = {
        f"speedup_at_{mid}": cvr[mid]["speedup"],
        f"chunk_{top}_over_{mid}": cvr[top]["chunk"] / cvr[mid]["chunk"],
        "bytes_match": all(e["bytes_per_rank"] == e["expected_bytes_per_rank"] for e in cp),
        "cp_speedup_vs_1": {f"{e['strategy']}@{e['world_size']}": base / e["seconds"] for e in cp},
    }
    summary[f"chunk_cpu_{top}_over_{mid}"] = cvr[top]["chunk_cpu"] / cvr[mid]["chunk_cpu"]
    if not quick:
        summary["speedup_at_8k"] = cvr["8192"]["speedup"]
        summary["speedup_cpu_at_8k"] = cvr["8192"]["speedup_cpu"]
        summary["chunk_32k_over_8k"] = cvr["32768"]["chunk"] / cvr["8192"]["chunk"]
        summary["chunk_cpu_32k_over_8k"] = cvr["32768"]["chunk_cpu"] / cvr["8192"]["chunk_cpu"]
    config = {
        "H": H,
        "K": K,
        "V": V,
        "chunk_size": chunk_size,
        "dtype": "float32",
        "threads_per_rank": 1,
        "quick": quick,
        "cp_T": cp_T,
        "torch": torch.__version__,
    }
    return {"config": config, "chunk_vs_recurrent": cvr, "cp": cp, "summary": summary}
