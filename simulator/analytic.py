"""The fast engine: closed-form step time, metrics and the stable result dictionary.

``simulate(model, hardware, parallel, gpus)`` never raises on a bad configuration: it returns a result with
``feasible: False`` and a ``reason``. Step time = pipeline time (schedule formula over per-chunk costs from
``simulator.costs``) + exposed data-parallel collectives + optimizer + fixed per-step overhead.

Schedule formulas (``p`` ranks, ``m`` micro-batches, ``T_r`` = forward+backward of rank r for one micro-batch,
``P`` = one stage-to-stage send):
- 1F1B: ``(m - 1) max_r (T_r + P) + sum_r T_r + 2 (p - 1) P``
- interleaved (``v`` chunks per rank): ``m max_r T_r + (p - 1) max_r T_r / v + (2 (p - 1) + m (v - 1)) P``
- DualPipe-like: each rank pairs a forward of one direction with a backward of the other, hiding the EP
  all-to-all of one behind the compute of the other: ``m F&B + (p/2 - 1)(F&B + B) + 2 (p - 1) P`` with
  ``F&B`` the overlapped pair time per micro-batch (DeepSeek's bubble without the weight/input split).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from simulator import dp_comm
from simulator import network as net
from simulator.costs import COMM_CLASSES, COMPUTE_CLASSES, ChunkCost, chunk_cost
from simulator.events import dualpipe_order, simulate_pipeline
from simulator.feasibility import infeasible_reason
from simulator.hardware import HardwareSpec, load_hardware
from simulator.host import step_host
from simulator.layers import model_flops_per_token
from simulator.memory import GIB, chunk_end_params, chunk_params, kept_rank_memory, peak_memory
from simulator.network import ClusterSpec
from simulator.parallel import ParallelConfig, rank_chunks, stage_layers
from simulator.replicas import replica_model, replicas_per_rank
from simulator.specs import ModelSpec, load_model

BREAKDOWN_KEYS = COMPUTE_CLASSES + COMM_CLASSES + ("pp", "dp", "bubble", "optimizer", "overhead")


@dataclass
class Perturbation:
    """Per pipeline-rank compute slowdown (>= 1) and per-tier bandwidth factors (<= 1); see ``whatif``."""

    compute: list[float] = field(default_factory=list)
    comm: list[tuple[float, float, float]] = field(default_factory=list)


def pipeline_costs(
    spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig, tiers: net.Tiers, pert: Perturbation | None = None
) -> list[list[ChunkCost]]:
    """``[rank][chunk]`` costs of one micro-batch (chunk order as in ``parallel.rank_chunks``)."""
    chunks = stage_layers(spec, par)
    out = []
    memo: dict = {}
    for r, mine in enumerate(rank_chunks(par)):
        scale = pert.compute[r] if pert and pert.compute else 1.0
        cs = tuple(pert.comm[r]) if pert and pert.comm else (1.0, 1.0, 1.0)
        row = []
        for c in mine:
            first, last = c == 0, c == len(chunks) - 1
            key = (tuple(spec.layer_kinds()[i] for i in chunks[c]), first, last, scale, cs)
            if key not in memo:
                memo[key] = chunk_cost(
                    spec, hw, par, chunks[c], tiers, first=first, last=last, scale=scale, comm_scale=cs
                )
            row.append(memo[key])
        out.append(row)
    return out


def dp_seconds(
    spec: ModelSpec,
    par: ParallelConfig,
    tiers: net.Tiers,
    rank: int,
    comm_scale=(1.0, 1.0, 1.0),
    *,
    overlap: float = 0.0,
    windows: tuple[float, float] = (0.0, 0.0),
) -> float:
    """Exposed data-parallel seconds of one pipeline rank per step: gradient reduce-scatter (all-reduce without
    ZeRO) and bf16 parameter all-gather in Megatron's buckets (``simulator.dp_comm``), ``overlap`` x the (backward,
    forward) ``windows`` of one micro-batch hiding them (0: none hidden; ``ParallelConfig.overlap_grad_reduce`` /
    ``overlap_param_gather`` off: none for that half); ZeRO-3 gathers again per pass, and the gradients are
    reduced once per step or after every micro-batch (``ParallelConfig.reduces_every_microbatch``)."""
    chunks = stage_layers(spec, par)
    dense = expert = 0.0
    for c in rank_chunks(par)[rank]:
        layer_dense, layer_expert = chunk_params(spec, chunks[c])
        end_dense, end_expert = chunk_end_params(spec, c, len(chunks))
        dense, expert = dense + layer_dense + end_dense, expert + layer_expert + end_expert
    grads, gathers = [], []
    for params, n, stride in (
        (dense / par.tp, par.dp * par.cp, par.tp),
        (expert / (par.ep * par.expert_tp), par.expert_dp, par.expert_tp * par.ep),
    ):
        g = net.group(n, stride, tiers)
        op = "all_reduce" if par.zero_stage == 0 else "reduce_scatter"
        grads.append(dp_comm.buckets(params, par.grad_bytes, g, tiers, op, comm_scale))
        if par.zero_stage:
            gathers.append(dp_comm.buckets(params, 2.0, g, tiers, "all_gather", comm_scale))
    back, fwd = (overlap * w for w in windows)
    gather = dp_comm.exposed(gathers, fwd if par.overlap_param_gather else 0.0)
    rounds = par.micro_batches if par.reduces_every_microbatch else 1
    regather = 2 * sum(p.total_s for p in gathers) if par.zero_stage == 3 else 0.0  # the stream's other sends
    # off: no compute hides the reduction, nor an earlier round behind the next forward
    grad_back, grad_fwd = (back, fwd) if par.overlap_grad_reduce else (0.0, 0.0)
    reduce = dp_comm.exposed(grads, grad_back, rounds=rounds, between=grad_fwd, busy=regather)
    return reduce + gather * (1 + (2 * par.micro_batches if par.zero_stage == 3 else 0))


def optimizer_seconds(spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig, rank: int, scale: float = 1.0) -> float:
    """Adam update: about 30 bytes of HBM traffic per local (ZeRO-sharded) parameter. With a host profile:
    the eager optimizer and gradient bookkeeping ops (``simulator.host.step_host``), time-shared."""
    if hw.host is not None:
        return step_host(spec, hw, par)[0] * scale

    mem = kept_rank_memory(spec, hw, par, rank)
    local_params = mem["optimizer"] / (12.0 if par.moment_dtype == "fp32" else 8.0)
    return local_params * 30.0 / (hw.hbm_tbps * 1e12 * hw.efficiency.hbm) * scale


def schedule_time(par: ParallelConfig, costs: list[list[ChunkCost]]) -> float:
    """Pipeline seconds of one step from per-rank chunk costs (formulas in the module docstring)."""
    m, p = par.micro_batches, par.pp
    P = costs[0][0].p2p if p > 1 else 0.0
    T = [sum(c.tf + c.tb for c in row) for row in costs]
    if par.schedule == "dualpipe":
        return _dualpipe(par, costs, P)
    if par.schedule == "interleaved":
        v = par.vpp
        return m * max(T) + (p - 1) * max(T) / v + (2 * (p - 1) + m * (v - 1)) * P
    return (m - 1) * max(t + P for t in T) + sum(T) + 2 * (p - 1) * P


def _pair(a: ChunkCost, b: ChunkCost) -> float:
    """A forward of ``a`` overlapped with a backward of ``b``: compute streams add, EP all-to-alls hide."""
    ca, cb = a.tf - a.fwd["ep"], b.tb - b.bwd["ep"]
    return max(ca + cb, a.ep_raw_fwd + b.ep_raw_bwd, ca + a.ep_raw_fwd, cb + b.ep_raw_bwd)


def _dualpipe_counts(par: ParallelConfig, rank: int) -> tuple:
    """``((entry, count), ...)`` of the rank's DualPipe order; entry = ((kind, phase), ...)."""
    return _dualpipe_counts_of(par.pp, par.micro_batches, rank)


@lru_cache(maxsize=4096)
def _dualpipe_counts_of(pp: int, micro_batches: int, rank: int) -> tuple:
    # the order depends on PP and the micro-batch count only: one entry serves every layout that shares them
    bare = ParallelConfig(pp=pp, seq_len=1, global_batch_tokens=micro_batches, schedule="dualpipe")
    return tuple(Counter(tuple(e) for e in dualpipe_order(bare, rank)).items())


def _dualpipe(par: ParallelConfig, costs: list[list[ChunkCost]], P: float) -> float:
    """Busiest rank's work in DualPipe order (warm-up/cool-down ops alone, the rest in overlapped pairs) plus
    DeepSeek's fill/drain idle ``(p/2 - 1) (F&B + B)`` (no weight/input split)."""
    p = par.pp
    best = 0.0
    for r, (a, b) in enumerate(costs):
        phase = (a, b) if r < p // 2 else (b, a)
        busy = 0.0
        for entry, n in _dualpipe_counts(par, r):
            if len(entry) == 2:
                busy += n * _pair(phase[entry[0][1]], phase[entry[1][1]])
            else:
                kind, ph = entry[0]
                c = phase[ph]
                busy += n * (
                    (c.tf - c.fwd["ep"] + c.ep_raw_fwd) if kind == "F" else (c.tb - c.bwd["ep"] + c.ep_raw_bwd)
                )
        steady = (_pair(a, b) + _pair(b, a)) / 2
        back = (a.tb - a.bwd["ep"] + a.ep_raw_bwd + b.tb - b.bwd["ep"] + b.ep_raw_bwd) / 2
        paired = par.micro_batches * steady  # the same work if every op were in a pair
        # Warm-up/cool-down ops run alone with their all-to-all exposed; about a third of that extra lands in
        # fill/drain time that is idle anyway (fitted to the event engine on K3 and DeepSeek-V3, not to data).
        best = max(best, paired + (busy - paired) * 2 / 3 + (p // 2 - 1) * (steady + back))
    return best + 2 * (p - 1) * P


def flop_conventions(spec: ModelSpec, seq_len: int, tokens_per_s_per_gpu: float, peak_tflops: float) -> dict:
    """Model TFLOP/s/GPU and MFU (against the bf16 peak) under the two conventions in use: ``full_square`` counts
    every query-key pair (``tflops_per_gpu``, Korthikanti's formula), ``causal`` half of them (Megatron-LM's
    current ``num_floating_point_operations`` and most published MoE tables)."""
    out = {}
    for name, causal in (("full_square", False), ("causal", True)):
        tf = model_flops_per_token(spec, seq_len, causal=causal) * tokens_per_s_per_gpu / 1e12
        out[name] = {"tflops_per_gpu": tf, "mfu": tf / peak_tflops}
    return out


@dataclass
class SimResult:
    """One configuration's prediction; ``to_dict`` is the stable JSON of ``moonep simulate run``."""

    feasible: bool
    reason: str
    model: str
    hardware: str
    gpus: int
    parallel: dict
    step_time_s: float = float("nan")
    tokens_per_s_per_gpu: float = 0.0
    tflops_per_gpu: float = 0.0
    mfu: float = 0.0
    memory_gib_per_gpu: float = float("nan")
    memory_breakdown_gib: dict = field(default_factory=dict)
    peak_memory_rank: int = 0
    breakdown: dict = field(default_factory=dict)
    gpu_hours_per_trillion_tokens: float = float("nan")
    cost_usd_per_trillion_tokens: float = float("nan")
    moe: dict = field(default_factory=dict)
    """MoE dispatch detail: dispatcher, maxvio, replicas per rank and how they were priced."""
    engine: str = "analytic"
    ep_overlap: dict = field(default_factory=dict)
    """EP all-to-all seconds per step before (``raw_s``) and after (``exposed_s``) overlap, the overlapped
    fraction and which overlap model applied (schedule and ``moe_a2a_overlap``)."""
    flops: dict = field(default_factory=dict)
    """Model TFLOP/s/GPU and MFU under both conventions (``full_square``, ``causal``), labelled."""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _ep_overlap_model(spec: ModelSpec, par: ParallelConfig) -> str:
    """What hides the EP all-to-all (``ep_overlap.model`` in the JSON)."""
    if par.schedule == "dualpipe":
        return "dualpipe pairs"
    if par.moe_a2a_overlap:
        return "steady-state pairs"
    return "shared experts" if par.shared_expert_overlap and spec.shared_width else "none"


def simulate(
    model,
    hardware,
    par: ParallelConfig,
    gpus: int | None = None,
    cluster: ClusterSpec | None = None,
    *,
    engine: str = "analytic",
    pert: Perturbation | None = None,
) -> SimResult:
    """Predict one training step; bad input gives ``feasible=False`` with a ``reason``, never an exception."""
    try:
        spec, hw = load_model(model), load_hardware(hardware)
    except (ValueError, OSError, KeyError, TypeError) as exc:
        return SimResult(False, f"bad model or hardware: {exc}", str(model), str(hardware), gpus or 0, {})
    gpus = par.gpus if gpus is None else gpus
    res = SimResult(True, "", spec.name, hw.name, gpus, par.to_dict(), engine=engine)
    reason = infeasible_reason(spec, hw, par, gpus)
    if reason:
        res.feasible, res.reason = False, reason
        return res
    rank, mem = peak_memory(spec, hw, par)
    total = sum(mem.values())
    res.memory_gib_per_gpu, res.peak_memory_rank = total / GIB, rank
    res.memory_breakdown_gib = {k: v / GIB for k, v in mem.items()}
    tiers = net.cluster_tiers(gpus, hw, cluster or ClusterSpec())
    costs = pipeline_costs(spec, hw, par, tiers, pert)
    pipe = simulate_pipeline(par, costs).makespan if engine == "event" else schedule_time(par, costs)
    _fill_metrics(res, spec, hw, par, tiers, costs, pipe, pert)
    if total > hw.hbm_gib * GIB:
        res.feasible = False
        res.reason = (
            f"out of memory: {total / GIB:.1f} GiB needed on pipeline rank {rank} > "
            f"{hw.hbm_gib:g} GiB ({', '.join(f'{k} {v / GIB:.1f}' for k, v in mem.items() if v)})"
        )
    return res


def _fill_metrics(res, spec, hw, par, tiers, costs, pipe, pert) -> None:
    eff, m = hw.efficiency, par.micro_batches
    comm = [tuple(pert.comm[r]) if pert and pert.comm else (1.0, 1.0, 1.0) for r in range(par.pp)]
    scale = [pert.compute[r] if pert and pert.compute else 1.0 for r in range(par.pp)]
    if hw.host is not None:  # the eager step's all-reduces (gradients, norm, QK-Clip, balancing), wall
        dp = step_host(spec, hw, par)[1]
    else:
        win = [(sum(c.tb for c in row), sum(c.tf for c in row)) for row in costs]  # one micro-batch each
        ov = eff.dp_overlap
        dp = max(dp_seconds(spec, par, tiers, r, comm[r], overlap=ov, windows=win[r]) for r in range(par.pp))
    opt = max(optimizer_seconds(spec, hw, par, r, scale[r]) for r in range(par.pp))
    step = pipe + dp + opt + eff.step_overhead_s
    busiest = max(range(par.pp), key=lambda r: sum(c.tf + c.tb for c in costs[r]))
    bd = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    for c in costs[busiest]:
        for k in COMPUTE_CLASSES + COMM_CLASSES:
            bd[k] += m * (c.fwd[k] + c.bwd[k]) / (2 if par.schedule == "dualpipe" else 1)
    if par.schedule == "dualpipe":  # EP hides under the paired op; charge what the pairs could not hide
        a, b = costs[busiest]
        nonep = (a.tf - a.fwd["ep"] + a.tb - a.bwd["ep"] + b.tf - b.fwd["ep"] + b.tb - b.bwd["ep"]) / 2
        bd["ep"] = m * max(0.0, (_pair(a, b) + _pair(b, a)) / 2 - nonep)
    bd["pp"] = 2 * (par.pp - 1) * costs[0][0].p2p if par.pp > 1 else 0.0
    bd["bubble"] = max(0.0, pipe - sum(bd[k] for k in COMPUTE_CLASSES + COMM_CLASSES) - bd["pp"])
    bd["dp"], bd["optimizer"], bd["overhead"] = dp, opt, eff.step_overhead_s
    tokens = par.global_batch_tokens
    res.step_time_s = step
    res.breakdown = bd
    res.tokens_per_s_per_gpu = tokens / step / res.gpus
    res.tflops_per_gpu = model_flops_per_token(spec, par.seq_len) * tokens / step / res.gpus / 1e12
    res.mfu = res.tflops_per_gpu / hw.bf16_tflops
    res.gpu_hours_per_trillion_tokens = 1e12 / res.tokens_per_s_per_gpu / 3600.0
    res.cost_usd_per_trillion_tokens = res.gpu_hours_per_trillion_tokens * hw.price_per_gpu_hour
    raw = m * sum(c.ep_raw_fwd + c.ep_raw_bwd for c in costs[busiest])
    raw /= 2 if par.schedule == "dualpipe" else 1
    res.ep_overlap = {
        "raw_s": raw,
        "exposed_s": bd["ep"],
        "overlapped_fraction": max(0.0, 1.0 - bd["ep"] / raw) if raw > 0 else 0.0,
        "model": _ep_overlap_model(spec, par),
    }
    res.flops = flop_conventions(spec, par.seq_len, tokens / step / res.gpus, hw.bf16_tflops)
    if spec.is_moe:
        res.moe = {
            "dispatcher": par.dispatcher,
            "maxvio": par.maxvio,
            "replicas_per_rank": replicas_per_rank(spec, par),
            "replica_model": replica_model() if par.dispatcher == "moonep" else "none",
            "experts_per_rank": spec.num_experts // par.ep,
        }
