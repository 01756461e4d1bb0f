"""``moonep bench ep``: MoonEP's balanced layer vs the classic all-to-all dispatcher, swept over maxvio.

Routing with a target maxvio (= max_e T_e / mean - 1): every token's first slot goes to expert 0 with probability p
= (1 + maxvio) K / E, the other slots to distinct uniformly drawn experts (seeded per rank). Both layers get the
same tokens, routing, routing weights and expert weights and run the same SwiGLU GEMM code; times are fwd+bwd
medians of the slowest rank, ours and the baseline alternating call by call. Per stage (dispatch, expert compute
incl. MoonEP's replica weight push, combine) the forward alone is timed, each stage between barriers (stage by
stage, so the weight push is not overlapped with the token exchange there). ``*_busy_s`` is the slowest rank's own
thread CPU time for fwd+bwd: what the layer would take with one core per rank and free communication, the number to
read when ranks outnumber cores (then wall time only measures the total work of all ranks). Ours balances as
``--balance`` says: ``cost`` (default) measures a ``planner.CostModel`` on the ranks (``moonep.measure_cost_model``:
one more row in the layer's step, the two exchanges of one replica) and lets the planner choose σ per step;
``ours_slack`` is the σ the step used (max rows / mean rows - 1), ``ours_rows_bound`` the rows any plan may give a
rank (σ = max_slack: the static buffers' size), ``ours_replicas`` and ``ours_weight_bytes`` (push forward plus grads
back) the weight traffic. ``ours_host_reads_per_layer``: reads of tensor data into Python during one fwd+bwd
(``moonep.hostreads``; the CPU kernels' zero-copy entries exempt), the slowest rank's; each is a host sync on
a GPU. Peak bytes are measured (``moonep.peak_memory.PeakBytes``, one untimed fwd+bwd per layer, the largest rank):
bytes of every tensor storage the call allocates, alive at once, plus for ours the static ``Buffer`` and the replica
weight/grad pools, which exist before the call.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from collectives import launch
from collectives.base import Communicator
from moonep.baseline import classic_combine, classic_dispatch, classic_experts, classic_moe
from moonep.buffer import Buffer
from moonep.comm_plan import CommPlan
from moonep.cost import measure_cost_model
from moonep.ep_step import ep_combine, ep_dispatch, ep_experts
from moonep.experts import pools_of, push_replicas
from moonep.hostreads import CPU_KERNEL_ENTRIES, HostReads
from moonep.moe import MoE
from moonep.peak_memory import peak_bytes
from planner import row_bound


def make_routing(rank: int, s: int, K: int, E: int, maxvio: float, seed: int = 1234):
    """(topk_idx [s, K], topk_weights [s, K]) for one rank, aiming at the given maxvio."""
    g = torch.Generator().manual_seed(seed + 7919 * rank)
    p = min(1.0, (1 + maxvio) * K / E)
    hot = torch.rand(s, generator=g) < p
    scores = torch.rand(s, E, generator=g)
    scores[:, 0] = torch.where(hot, 2.0, -1.0)  # expert 0 first when hot, never otherwise
    idx = torch.topk(scores, K, dim=1).indices
    return idx, torch.rand(s, K, generator=g) + 0.5


def _median_times(comm: Communicator, fns, iters: int) -> list[tuple[float, float]]:
    """Per callable of ``fns``: (wall, busy) medians over ``iters`` calls, each the max over ranks. The callables
    alternate, their order flipping every round, so that drift on a shared host hits them alike."""
    walls, busys = [[] for _ in fns], [[] for _ in fns]
    for i in range(iters):
        for j in range(len(fns)) if i % 2 == 0 else reversed(range(len(fns))):
            comm.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            fns[j]()
            dt = torch.tensor([time.perf_counter() - t0, time.thread_time() - c0], dtype=torch.float64)
            wall, busy = comm.all_reduce(dt, "max").tolist()
            walls[j].append(wall)
            busys[j].append(busy)
    return [(statistics.median(w), statistics.median(b)) for w, b in zip(walls, busys)]


def _stage_times(comm: Communicator, stages, iters: int) -> list[float]:
    """Forward stage by stage: ``stages`` are callables, each taking the previous one's result (the first
    takes None). Returns per stage the median over iters of the slowest rank's wall seconds."""
    per = [[] for _ in stages]
    with torch.no_grad():
        for _ in range(iters):
            out = None
            for k, stage in enumerate(stages):
                comm.barrier()
                t0 = time.perf_counter()
                out = stage(out)
                per[k].append(time.perf_counter() - t0)
    got = comm.all_reduce(torch.tensor([statistics.median(p) for p in per], dtype=torch.float64), "max")
    return got.tolist()


def _our_stages(moe, x, idx, w):
    """The phases of ``moonep.ep_step`` as ``moonep.MoE`` runs them (the replica push started beside the rows)."""
    weights = (moe.w13, moe.w2)

    def disp(_):
        return ep_dispatch(moe.buffer, x, topk_idx=idx, topk_weights=w, weights=weights, key=moe._key)

    def experts(rows):
        return rows, ep_experts(rows, weights, key=moe._key)

    return [disp, experts, lambda e: ep_combine(*e)]


def _classic_stages(comm: Communicator, moe, x, idx, w, E):
    def experts(d):
        rows, weights, cu, route = d
        return classic_experts(rows, weights, cu, moe.w13, moe.w2), route

    return [
        lambda _: classic_dispatch(comm, x, topk_idx=idx, topk_weights=w, E=E),
        experts,
        lambda e: classic_combine(comm, e[0], e[1], x),
    ]


def _last_plan(moe: MoE) -> CommPlan:
    """The plan of the layer's last step (the bench reads it after running one)."""
    if moe.last_plan is None:
        raise RuntimeError("moonep bench: the layer has not run a step yet, so it has no plan to measure")
    return moe.last_plan


def _replica_times(comm: Communicator, moe: MoE, iters: int) -> tuple[float, float]:
    """(push, reduce) seconds of the last step's replica exchanges alone, each between barriers (the median of
    the slowest rank): the weight push of the forward and the grad reduce of the backward (0 without replicas)."""
    plan, buf, weights = _last_plan(moe), moe.buffer, (moe.w13, moe.w2)
    pools = pools_of(buf, weights, "fused")
    grads = [torch.zeros(t.shape, dtype=torch.float32) for t in weights]
    calls = (
        lambda: push_replicas(buf, plan, ("bench",), pools, weights),
        lambda: buf.reduce_grad(plan, grads, [p.grads for p in pools]),
    )
    per: list[list[float]] = [[], []]
    for _ in range(iters):
        for k, call in enumerate(calls):
            comm.barrier()
            t0 = time.perf_counter()
            call()
            per[k].append(time.perf_counter() - t0)
    got = comm.all_reduce(torch.tensor([statistics.median(p) for p in per], dtype=torch.float64), "max")
    return tuple(got.tolist())


def parse_balance(text: str, max_slack: float) -> dict:
    """``--balance`` -> {"mode": "cost" | "exact" | "slack", "slack": σ, "max_slack": ...}, or ValueError."""
    if text in ("cost", "exact"):
        if text == "cost":
            row_bound(0, 1, max_slack)  # names a bad --max-slack
        return {"mode": text, "slack": None, "max_slack": max_slack if text == "cost" else 0.0}
    try:
        sigma = float(text)
    except ValueError:
        raise ValueError(f"--balance must be 'cost', 'exact' or a slack such as 0.1, got {text!r}") from None
    row_bound(0, 1, sigma)
    return {"mode": "slack", "slack": sigma, "max_slack": sigma}


def bench_rank(
    comm: Communicator,
    maxvios: list[float],
    S: int,
    H: int,
    F: int,
    E: int,
    K: int,
    iters: int,
    balance: dict | None = None,
) -> dict:
    """Run on every rank; returns {"results": [...], ...} (rank 0's is the report)."""
    torch.set_num_threads(1)
    R, r = comm.world_size, comm.rank
    balance = balance or {"mode": "cost", "slack": None, "max_slack": 0.5}
    cost = None
    if balance["mode"] == "cost":
        cost = measure_cost_model(comm, H=H, F=F, tokens=S, max_slack=balance["max_slack"])
    # argument checks of plan-reuse calls off: the classic baseline checks nothing either
    buffer = Buffer(comm, S=S, H=H, K=K, E=E, check_reuse=False, slack=balance["slack"], cost=cost)
    moe = MoE(comm, H=H, F=F, E=E, K=K, S=S, router=lambda x: None, buffer=buffer)  # routing injected per maxvio
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(r)).requires_grad_()
    results = [_bench_maxvio(comm, moe, x, v, iters) for v in maxvios]
    config = {"world_size": R, "S": S, "H": H, "F": F, "E": E, "K": K, "iters": iters, "cores": os.cpu_count()}
    config["balance"] = dict(balance)
    if cost is not None:
        config["cost_model"] = {"row_seconds": cost.row_seconds, "copy_seconds": cost.copy_seconds}
    return {"results": results, "config": config}


def _bench_maxvio(comm: Communicator, moe: MoE, x: torch.Tensor, v: float, iters: int) -> dict:
    """One row of the sweep: both layers on the same routing aiming at maxvio ``v``."""
    r, E, K, H, F, S = comm.rank, moe.E, moe.K, moe.H, moe.F, x.shape[0]
    idx, w = make_routing(r, S, K, E, v)
    counts = comm.all_reduce(torch.bincount(idx.reshape(-1), minlength=E), "sum")
    measured = float(counts.max()) / (float(counts.sum()) / E) - 1
    moe.router = lambda _x, idx=idx, w=w: (idx, w.clone().requires_grad_())

    def ours():
        moe(x).sum().backward()

    stats: dict = {}

    def base():
        classic_moe(
            comm, x, topk_idx=idx, topk_weights=w.clone().requires_grad_(), w13=moe.w13, w2=moe.w2, E=E, stats=stats
        ).sum().backward()

    ours()  # warm-up (and fills last_plan)
    base()  # warm-up (and fills stats)
    with HostReads(exempt=CPU_KERNEL_ENTRIES) as reads:  # one layer fwd+bwd: the budget is 1
        ours()
    (t_ours, busy_ours), (t_base, busy_base) = _median_times(comm, (ours, base), iters)
    st_ours = _stage_times(comm, _our_stages(moe, x, idx, w), iters)
    st_base = _stage_times(comm, _classic_stages(comm, moe, x, idx, w, E), iters)
    push_s, reduce_s = _replica_times(comm, moe, iters)
    last = _last_plan(moe)
    plan = last.global_plan
    rows = comm.all_reduce(torch.tensor([stats["rows"]]), "max")
    weights_per_copy = (H * 2 * F + F * H) * 4
    static = moe.buffer.nbytes + 2 * moe.epn * weights_per_copy  # Buffer + replica slot pools (weights, grads)
    peaks = comm.all_reduce(torch.tensor([static + peak_bytes(ours), peak_bytes(base), reads.count]), "max").tolist()
    stages = {
        f"{who}_{stage}_s": t
        for who, ts in (("ours", st_ours), ("baseline", st_base))
        for stage, t in zip(("dispatch", "expert", "combine"), ts)
    }
    stages.update(ours_push_s=push_s, ours_reduce_s=reduce_s, baseline_push_s=0.0, baseline_reduce_s=0.0)
    total = int(plan.caps.sum())
    return {
        "maxvio": v,
        "maxvio_measured": round(measured, 4),
        "cap": -(-total // comm.world_size),
        "ours_max_rows": int(plan.caps.max()),
        "ours_slack": round(int(plan.caps.max()) * comm.world_size / max(total, 1) - 1, 4),
        "ours_rows_bound": row_bound(total, comm.world_size, moe.buffer.max_slack),
        "baseline_max_rows": int(rows),
        "ours_layer_s": t_ours,
        "baseline_layer_s": t_base,
        "ours_busy_s": busy_ours,
        "baseline_busy_s": busy_base,
        **stages,
        "ours_peak_bytes": int(peaks[0]),
        "baseline_peak_bytes": int(peaks[1]),
        "ours_host_reads_per_layer": int(peaks[2]),
        "ours_replicas": plan.num_replicas,
        "ours_weight_bytes": 2 * plan.num_replicas * weights_per_copy,  # push fwd + grad reduce bwd
        "ours_token_bytes": sum(last.send_uniq_splits) * H * 4,
        "baseline_token_bytes": stats["token_bytes"],
    }


def run(
    world_size: int, maxvios: list[float], *, quick: bool = False, backend: str = "torch", balance: dict | None = None
) -> dict:
    """Launch the sweep on local ranks and return the report."""
    S, H, F, E, iters = (64, 32, 32, 4 * world_size, 1) if quick else (1024, 256, 256, 8 * world_size, 11)
    report = launch(
        bench_rank,
        world_size,
        backend=backend,
        timeout=300,
        job_timeout=3600,
        maxvios=maxvios,
        balance=balance,
        S=S,
        H=H,
        F=F,
        E=E,
        K=2,
        iters=iters,
    )
    flat = next((e["baseline_layer_s"] for e in report["results"] if e["maxvio"] == 0), None)
    for e in report["results"]:
        e["ratio"] = e["ours_layer_s"] / e["baseline_layer_s"]
        e["busy_ratio"] = e["ours_busy_s"] / e["baseline_busy_s"]
        # the yardstick of "skew costs nothing": the classic dispatcher on the same tokens at NO skew, same run
        e["ratio_vs_classic_flat"] = None if flat is None else e["ours_layer_s"] / flat
    ours = [e["ours_layer_s"] for e in report["results"]]
    report["ours_max_over_min"] = max(ours) / min(ours)  # flatness of ours over the sweep (1: skew costs nothing)
    cores = os.cpu_count() or 1
    report["note"] = (
        f"{world_size} ranks on {cores} cores: ranks outnumber cores, times are contended"
        if world_size > cores
        else f"{world_size} ranks on {cores} cores"
    )
    return report


def plot(report: dict, path: str) -> None:
    """Layer time vs maxvio for both dispatchers (matplotlib object API, Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy: only when a plot is asked for
    from matplotlib.figure import Figure  # heavy: matplotlib

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
