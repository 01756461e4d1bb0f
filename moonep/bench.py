"""``moonep bench ep``: MoonEP's balanced layer vs the classic all-to-all dispatcher, swept over maxvio.

Routing with a target maxvio (= max_e T_e / mean - 1): every token's first slot goes to expert 0 with
probability p = (1 + maxvio) K / E, the other slots to distinct uniformly drawn experts (seeded per rank).
Both layers get the same tokens, routing, routing weights and expert weights and run the same SwiGLU GEMM code;
times are fwd+bwd medians of the slowest rank. Peak bytes are modelled from the live tensors whose size can
depend on the routing (receive rows and expert activations) plus static buffers; torch has no CPU allocator
statistics to read.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from .baseline import classic_moe
from .moe import MoE


def make_routing(rank: int, s: int, K: int, E: int, maxvio: float, seed: int = 1234):
    """(topk_idx [s, K], topk_weights [s, K]) for one rank, aiming at the given maxvio."""
    g = torch.Generator().manual_seed(seed + 7919 * rank)
    p = min(1.0, (1 + maxvio) * K / E)
    hot = torch.rand(s, generator=g) < p
    scores = torch.rand(s, E, generator=g)
    scores[:, 0] = torch.where(hot, 2.0, -1.0)  # expert 0 first when hot, never otherwise
    idx = torch.topk(scores, K, dim=1).indices
    return idx, torch.rand(s, K, generator=g) + 0.5


def _median_time(comm, fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        times.append(float(comm.all_reduce(dt, "max")))
    return statistics.median(times)


def bench_rank(comm, maxvios: list[float], S: int, H: int, F: int, E: int, K: int, iters: int) -> dict:
    """Run on every rank; returns {"results": [...], ...} (rank 0's is the report)."""
    torch.set_num_threads(1)
    R, r = comm.world_size, comm.rank
    epn = E // R
    moe = MoE(comm, H, F, E, K, S, router=lambda x: None)  # routing is injected below
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(r)).requires_grad_()
    results = []
    for v in maxvios:
        idx, w = make_routing(r, S, K, E, v)
        counts = comm.all_reduce(torch.bincount(idx.reshape(-1), minlength=E), "sum")
        measured = float(counts.max()) / (float(counts.sum()) / E) - 1
        moe.router = lambda _x, idx=idx, w=w: (idx, w.clone().requires_grad_())

        def ours():
            moe(x).sum().backward()

        stats: dict = {}

        def base():
            classic_moe(comm, x, idx, w.clone().requires_grad_(), moe.w13, moe.w2, E, stats).sum().backward()

        ours(), base()  # warm-up (and fills stats / last_plan)
        t_ours, t_base = _median_time(comm, ours, iters), _median_time(comm, base, iters)
        plan = moe.last_plan
        act = lambda rows: rows * (H + 2 * F + 2 * H) * 4  # noqa: E731 recv, a13, y, z (fp32)
        rows = comm.all_reduce(torch.tensor([stats["rows"]]), "max")
        weights_per_copy = (H * 2 * F + F * H) * 4
        results.append({
            "maxvio": v, "maxvio_measured": round(measured, 4), "cap": int(plan.plan.caps.max()),
            "ours_max_rows": int(plan.plan.caps.max()), "baseline_max_rows": int(rows),
            "ours_layer_s": t_ours, "baseline_layer_s": t_base,
            "ours_peak_bytes": moe.buffer.nbytes + act(plan.nvs) + 2 * 2 * epn * weights_per_copy,
            "baseline_peak_bytes": act(int(rows)) + 2 * stats["token_bytes"],
            "ours_replicas": plan.plan.num_replicas,
            "ours_weight_bytes": 2 * plan.plan.num_replicas * weights_per_copy,  # push fwd + grad reduce bwd
            "ours_token_bytes": sum(plan.send_uniq_splits) * H * 4, "baseline_token_bytes": stats["token_bytes"],
        })
    return {"results": results, "config": {"world_size": R, "S": S, "H": H, "F": F, "E": E, "K": K,
                                           "iters": iters, "cores": os.cpu_count()}}


def run(world_size: int, maxvios: list[float], *, quick: bool = False, backend: str = "torch") -> dict:
    """Launch the sweep on local ranks and return the report."""
    from collectives import launch

    shape = dict(S=64, H=32, F=32, E=4 * world_size, K=2, iters=1) if quick else \
        dict(S=1024, H=256, F=256, E=8 * world_size, K=2, iters=5)
    report = launch(bench_rank, world_size, backend=backend, timeout=300, job_timeout=3600, maxvios=maxvios,
                    **shape)
    cores = os.cpu_count() or 1
    report["note"] = (f"{world_size} ranks on {cores} cores: ranks outnumber cores, times are contended"
                      if world_size > cores else f"{world_size} ranks on {cores} cores")
    return report


def plot(report: dict, path: str) -> None:
    """Layer time vs maxvio for both dispatchers (matplotlib object API, Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    res = report["results"]
    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = [e["maxvio"] for e in res]
    ax.plot(xs, [e["ours_layer_s"] * 1e3 for e in res], "o-", label="MoonEP (balanced)")
    ax.plot(xs, [e["baseline_layer_s"] * 1e3 for e in res], "s--", label="classic all-to-all")
    ax.set_xlabel("maxvio")
    ax.set_ylabel("fwd+bwd layer time [ms]")
    ax.set_title(f"MoE layer, {report['config']['world_size']} ranks")
    ax.legend()
    fig.savefig(path)
