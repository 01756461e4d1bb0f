"""Host-bound step model: eager PyTorch on CPU ranks, priced with a calibrated ``HostSpec``.

A small model trained eagerly on CPU ranks (``moonep train --preset tiny``) is not bound by FLOPs: each framework
op costs microseconds of Python and dispatcher time, every collective costs host time per call, and local ranks
beyond the free cores time-share them. This module prices one rank's step from

- an **op census** of the project's eager implementation (``k3`` model code on ``moonep`` dispatch/combine):
  framework ops (every ATen dispatch, views included) per sublayer, forward and backward, and per optimizer
  block. The numbers were counted with ``TorchDispatchMode`` on the k3 modules (``tests/simulator/
  test_host_census.py`` recounts them); the KDA kernels (``cp_kda`` gate + chunk) and collectives are not in
  it, they are priced by their own calibrated costs;
- per-op host time from ``HostSpec`` (measured on a reference eager block, linear in the activation size);
- the measured KDA kernel, GEMM FLOPs at the measured GEMM rate, and collective calls and bytes at the measured
  per-call and per-MB costs (the MoE layer's calls follow moonep's dispatch/combine protocol);
- time sharing: the host costs are calibrated as the wall time of one rank while all local ranks do the same
  work, so they hold the time sharing at the calibrated rank count and only another rank count rescales them
  (``share_factor``); GEMM FLOPs run at the GEMM rate measured alone and stretch by ``local ranks / effective
  cores`` when ranks outnumber cores (``stretch``).

Pure model code: numbers in, numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from simulator.hardware import HardwareSpec, HostSpec
from simulator.layers import embedding_params, head_params, layer_stats
from simulator.modelspec import ModelSpec, blocks
from simulator.parallel import ParallelConfig
from simulator.replicas import replicas_per_rank

# Framework ops per sublayer call, (forward, backward), of the k3 implementation (k3/*.py on moonep and
# cp_kda), counted with TorchDispatchMode at T = 64; the KDA kernel (kda_gate + kda_chunk) and collectives are
# excluded. "kda" includes its three cp_kda.short_conv calls. "mla" was recounted for SDPA's causal path (no
# dense mask, v padded to the q/k width). An AttnRes mix (a custom autograd function that recomputes in
# backward) costs ATTN_RES_OPS: (base, per source) ops forward and backward.
# "moe" was recounted for the device-resident EP path (planner tables, layout and input checks as tensor ops:
# about 160 more forward ops a layer than the numpy layout it replaced; fitted at 1 and 2 ranks within 2%).
FWD_OPS = {"norm": 7, "kda": 205, "mla": 61, "mha": 84, "dense": 24, "moe": 315, "ends": 65, "none": 0}
BWD_OPS = {"norm": 20, "kda": 266, "mla": 116, "mha": 132, "dense": 45, "moe": 182, "ends": 0, "none": 0}
ATTN_RES_OPS = ((4, 12), (14, 26))
"""(forward, backward) ops of one AttnRes mix as (base, per source): counted on k3.attnres at 2, 3 and 5 sources."""
MOE_SEGMENT_OPS = (21, 67)
"""Extra (forward, backward) ops per non-empty expert segment of the grouped SiTU-GLU loop."""
NS5_STACK_OPS, NS5_SHARD_OPS = 52, 6
"""Ops of one batched Newton-Schulz (5 steps) over a stack of same-shape Muon blocks (k3.muon stacks every
block of one shape, whatever the layer), and the extra ops a stack's data-parallel share adds (slice, pad,
gather)."""
MUON_PARAM_OPS, ADAMW_PARAM_OPS = 8, 13
"""Ops per Muon parameter (momentum, head views, update) and per AdamW parameter."""
SYNC_OPS_PER_PARAM, CLIP_OPS_PER_PARAM = 4, 5
"""Gradient packing for the data-parallel all-reduce (per replicated tensor) and grad-norm clipping."""
BALANCE_OPS = (66, 0)
"""Quantile Balancing per MoE layer: fixed ops and ops per expert (none: vectorised over experts)."""
HIST_BINS = 1000
"""Quantile Balancing histogram bins per expert (all-reduced as int64 with the load counts)."""


@dataclass(frozen=True)
class StepCensus:
    """Framework ops and tensor counts of one training step on one rank."""

    fwd_ops: dict
    """Forward ops per layer kind (one layer of that kind, AttnRes and norms included)."""
    bwd_ops: dict
    """Backward ops per layer kind."""
    ends_fwd: int
    """Embedding, output AttnRes, final norm, LM head and loss: forward ops."""
    ends_bwd: int
    """The same, backward."""
    step_ops: int
    """No-grad ops outside forward/backward: optimizer, gradient packing, clipping, balancing."""
    opt_ops: int
    """The optimizer's share of ``step_ops`` (batched Newton-Schulz stacks, Muon and AdamW updates)."""
    replicated_params: int
    """Parameter elements all-reduced every step (everything but the routed experts)."""
    ns5_flops: float
    """Newton-Schulz FLOPs of the Muon update on this rank."""


def segments(spec: ModelSpec, par: ParallelConfig) -> int:
    """Non-empty expert segments per MoE layer: local experts plus replica slots the plan fills."""
    return spec.num_experts // par.ep + replicas_per_rank(spec, par)


def _attn_res_sources(spec: ModelSpec) -> list[tuple[int, int]]:
    """Per layer, the AttnRes source counts of (attention input, FFN input); 0 = no mix (K3 layer 0)."""
    size = spec.attn_res_block_size or spec.num_layers
    out, blocks = [], 0
    for i in range(spec.num_layers):
        attn = blocks + 1 if blocks else 0
        if i % size == 0:
            blocks += 1
        out.append((attn, blocks + 1))
    return out


def _muon_blocks(spec: ModelSpec, kind: tuple[str, str], epn: int) -> list[tuple[int, int, int, bool]]:
    """(count, rows, cols, local) of the Muon blocks of one layer: head-structured matrices split per head;
    local = this rank's routed experts (not shared with the other data-parallel ranks)."""
    d, attn, ffn = spec.hidden, kind[0], kind[1]
    if attn == "kda":
        h, k = spec.kda_heads, spec.kda_head_dim
        out = [
            (4 * h, k, d, False),
            (h, k, k, False),
            (h, d, k, False),
            (1, k, d, False),
            (1, h, d, False),
        ]  # q k v g, f_b, o; f_a, beta
    else:
        h, v = spec.num_heads, spec.v_head_dim or spec.dhead
        qk = (spec.qk_nope_dim + spec.qk_rope_dim) or spec.dhead
        ql, kvl = spec.q_lora_rank or d, spec.kv_lora_rank or d
        out = [
            (h, qk, ql, False),
            (h, (spec.qk_nope_dim or qk) + v, kvl, False),
            (h, v, d, False),
            (h, d, v, False),
            (1, ql, d, False),
            (1, kvl + spec.qk_rope_dim, d, False),
        ]
    if ffn == "dense":
        out += [(2, spec.ffn_hidden, d, False), (1, d, spec.ffn_hidden, False)]
    else:
        lat, f, fs = spec.moe_latent_dim or d, spec.moe_ffn_hidden, spec.shared_width
        out += [(1, lat, d, False), (1, d, lat, False), (2 * epn, f, lat, True), (epn, lat, f, True)]
        out += [(2, fs, d, False), (1, d, fs, False)] if fs else []
    return out


def _ns5_flops(rows: int, cols: int) -> float:
    r, c = min(rows, cols), max(rows, cols)
    return 5 * (4.0 * r * r * c + 2.0 * r**3)  # X X^T, A A, (bA + cA^2) X per step


def _param_tensors(spec: ModelSpec, kind: tuple[str, str]) -> tuple[int, int]:
    """(all parameter tensors, Muon-updated matrices) of one layer of the k3 implementation."""
    gate = int(spec.attn_output_gate)
    if kind[0] == "kda":
        attn = (14, 8)  # q k v g o f_a f_b beta projections, 3 conv taps, A_log, dt_bias, o_norm
    elif kind[0] == "mla":
        attn = (7 + gate, 5 + gate)  # q_a, q_a norm, q_b, kv_a, kv_a norm, kv_b, o (+ gate)
    else:
        attn = (4 + gate, 4 + gate)
    shared = 3 if spec.shared_width else 0
    ffn = (3, 3) if kind[1] == "dense" else (7 + shared, 5 + shared)  # router, down, norm, up, w1 w3 w2
    norms = 6 if spec.attn_res else (4 if spec.norm == "layernorm" else 2)  # 2 norms (+ 2 AttnRes q, gain)
    return attn[0] + ffn[0] + norms, attn[1] + ffn[1]


@lru_cache(maxsize=256)
def census(spec: ModelSpec, par: ParallelConfig) -> StepCensus:
    """The op census of one step of ``spec`` on one rank of ``par`` (k3's eager implementation)."""
    seg = segments(spec, par) if spec.is_moe else 0
    fwd, bwd = dict(FWD_OPS), dict(BWD_OPS)
    fwd["moe"] += MOE_SEGMENT_OPS[0] * seg
    bwd["moe"] += MOE_SEGMENT_OPS[1] * seg
    f_kind: dict = {}
    b_kind: dict = {}
    sources = _attn_res_sources(spec)
    for kind, (sa, sf) in zip(spec.layer_kinds(), sources):
        mixes = [s for s in (sa, sf) if s] if spec.attn_res else []
        (f0, f1), (b0, b1) = ATTN_RES_OPS
        f = fwd[kind[0]] + fwd[kind[1]] + blocks(kind) * fwd["norm"] + sum(f0 + f1 * s for s in mixes)
        b = bwd[kind[0]] + bwd[kind[1]] + blocks(kind) * bwd["norm"] + sum(b0 + b1 * s for s in mixes)
        f_kind.setdefault(kind, []).append(f)
        b_kind.setdefault(kind, []).append(b)
    epn = spec.num_experts // par.ep if spec.is_moe else 0
    tensors = muon = 0
    flops = 0.0
    shapes: set = set()
    replicated = embedding_params(spec) + head_params(spec)
    for kind in spec.layer_kinds():
        t, m = _param_tensors(spec, kind)
        tensors, muon = tensors + t, muon + m
        for count, rows, cols, local in _muon_blocks(spec, kind, epn):
            shapes.add((rows, cols))
            # replicated blocks are orthogonalised once per step over all ranks (each rank its share);
            # a rank's own routed experts stay local
            flops += count * _ns5_flops(rows, cols) / (1 if local else par.dp)
        st = layer_stats(spec, kind)
        replicated += st.dense_params
    tensors += 5  # embedding, LM head, final norm, output AttnRes query and gain
    moe_layers = sum(1 for k in spec.layer_kinds() if k[1] == "moe")
    expert_tensors = 3 * moe_layers
    ns_ops = (NS5_STACK_OPS + (NS5_SHARD_OPS if par.dp > 1 else 0)) * len(shapes)
    opt = ns_ops + MUON_PARAM_OPS * muon + ADAMW_PARAM_OPS * (tensors - muon)
    step = (
        opt
        + SYNC_OPS_PER_PARAM * (tensors - expert_tensors)
        + CLIP_OPS_PER_PARAM * tensors
        + moe_layers * (BALANCE_OPS[0] + BALANCE_OPS[1] * spec.num_experts)
    )

    def avg(d: dict) -> dict:
        return {k: sum(v) / len(v) for k, v in d.items()}

    (f0, f1), (b0, b1) = ATTN_RES_OPS
    last = sources[-1][1]  # the output mix's sources
    out_mix = (f0 + f1 * last, b0 + b1 * last) if spec.attn_res else (0, 0)
    return StepCensus(
        fwd_ops=avg(f_kind),
        bwd_ops=avg(b_kind),
        ends_fwd=fwd["ends"] + out_mix[0] + fwd["norm"],
        ends_bwd=bwd["ends"] + out_mix[1] + bwd["norm"],
        step_ops=step,
        opt_ops=opt,
        replicated_params=replicated,
        ns5_flops=flops,
    )


def op_seconds(host: HostSpec, elements: float) -> tuple[float, float]:
    """Host seconds of one (forward, backward) framework op whose tensors hold ``elements`` activations.

    Linear between the tiny-tensor overhead and the reference block measured at ``ref_elements``."""
    x = elements / host.ref_elements
    f = host.op_fwd_tiny_us + (host.op_fwd_us - host.op_fwd_tiny_us) * x
    b = host.op_bwd_tiny_us + (host.op_bwd_us - host.op_bwd_tiny_us) * x
    return f * 1e-6, b * 1e-6


def kda_seconds(host: HostSpec, elements: float) -> float:
    """One KDA kernel call forward + backward on ``elements`` = tokens x heads x head width (linear fit
    through the two calibrated calls)."""
    slope = (host.kda_us - host.kda_tiny_us) / (host.kda_elements - host.kda_tiny_elements)
    return max(0.0, host.kda_tiny_us + slope * (elements - host.kda_tiny_elements)) * 1e-6


def _a2a(host: HostSpec, nbytes: float) -> float:
    return (host.a2a_call_us + host.a2a_us_per_mb * nbytes / 1e6) * 1e-6


def _all_reduce(host: HostSpec, nbytes: float, checked: bool) -> float:
    call = host.checked_all_reduce_call_us if checked else host.all_reduce_call_us
    return (call + host.all_reduce_us_per_mb * nbytes / 1e6) * 1e-6


def moe_comm_seconds(spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig, tokens: float) -> tuple[float, float]:
    """Host seconds of one MoE layer's collectives (forward, backward) on one rank, moonep's protocol:

    forward: all-gather of expert counts, side-table all-to-all, row dispatch, 3 replica-weight fetches, the
    combine's agreement all-reduce and row return; backward: re-dispatch (agreement + rows), 3 replica-grad
    returns, combine transpose (agreement + rows + routing weights). fp32 rows of the dispatch width."""
    host = hw.host
    if par.ep == 1 or host is None:
        return 0.0, 0.0
    st = layer_stats(spec, next(k for k in spec.layer_kinds() if k[1] == "moe"))
    slots = tokens * spec.top_k
    rows = tokens * min(spec.top_k, par.ep) * st.dispatch_dim * 4.0
    weights = replicas_per_rank(spec, par) * st.expert_bytes_bf16 * 2.0 / 3  # fp32, one of w1/w3/w2
    ag = host.all_gather_call_us * 1e-6
    fwd = ag + _a2a(host, slots * 24) + 2 * _a2a(host, rows) + 3 * _a2a(host, weights) + _all_reduce(host, 8, False)
    bwd = 2 * _all_reduce(host, 8, False) + 2 * _a2a(host, rows) + 3 * _a2a(host, weights) + _a2a(host, slots * 4)
    return fwd, bwd


def layer_host(
    spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig, kind: tuple[str, str], tokens: float
) -> tuple[float, float, float]:
    """(forward framework-op seconds, backward framework-op seconds, KDA kernel seconds) of one layer."""
    host = hw.host
    c = census(spec, par)
    f_op, b_op = op_seconds(host, tokens * spec.hidden / par.tp)
    kda = kda_seconds(host, tokens * spec.kda_heads * spec.kda_head_dim / par.tp) if kind[0] == "kda" else 0.0
    return c.fwd_ops[kind] * f_op, c.bwd_ops[kind] * b_op, kda


def ends_host(spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig, tokens: float) -> tuple[float, float]:
    """Forward and backward framework-op seconds of embedding, output mix, final norm, head and loss."""
    c = census(spec, par)
    f_op, b_op = op_seconds(hw.host, tokens * spec.hidden / par.tp)
    return c.ends_fwd * f_op, c.ends_bwd * b_op


def step_host(spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig) -> tuple[float, float]:
    """(optimizer-side seconds, step collectives seconds) of one rank, time-shared.

    Optimizer side: the no-grad ops of the census plus Newton-Schulz FLOPs at the GEMM rate. Collectives: the
    checked all-reduce of the replicated gradients (fp32), the grad-norm and QK-Clip all-reduces and the
    balancing all-reduce of load counts and histograms (int64)."""
    host, c, share = hw.host, census(spec, par), share_factor(hw, par)
    opt = c.step_ops * host.op_nograd_tiny_us * 1e-6 * share + c.ns5_flops / (hw.bf16_tflops * 1e12) * stretch(hw, par)
    if par.dp * par.cp == 1:
        return opt, 0.0
    moe_layers = sum(1 for k in spec.layer_kinds() if k[1] == "moe")
    mla_layers = sum(1 for k in spec.layer_kinds() if k[0] != "kda")
    comm = (
        _all_reduce(host, 4.0 * (c.replicated_params + 1), True)
        + _all_reduce(host, 8.0, True)
        + (_all_reduce(host, 4.0 * mla_layers * spec.num_heads, True) if mla_layers else 0.0)
        + (_all_reduce(host, 8.0 * moe_layers * spec.num_experts * (1 + HIST_BINS), True) if moe_layers else 0.0)
    )
    return opt, comm * share


def local_ranks(hw: HardwareSpec, par: ParallelConfig) -> int:
    """Ranks of this job sharing one host (the job fills hosts of ``gpus_per_node`` ranks)."""
    return min(par.gpus, hw.gpus_per_node)


def stretch(hw: HardwareSpec, par: ParallelConfig) -> float:
    """Wall seconds per host second of one rank (1 without a host profile or with free cores)."""
    return 1.0 if hw.host is None else hw.host.stretch(local_ranks(hw, par))


def share_factor(hw: HardwareSpec, par: ParallelConfig) -> float:
    """Factor on the calibrated host times (measured with all local ranks busy): 1 at the calibrated rank count."""
    return 1.0 if hw.host is None else hw.host.share_factor(local_ranks(hw, par))


HOST_TIMED = ("host", "kda", "ep")
"""Breakdown parts priced from calibrated host times (``share_factor``); the rest are FLOPs at solo rates."""


def time_share(hw: HardwareSpec, par: ParallelConfig, part: dict) -> dict:
    """One layer's seconds per breakdown part, time-shared: host-timed parts by ``share_factor``, FLOP parts
    by ``stretch``."""
    k, share = stretch(hw, par), share_factor(hw, par)
    return {n: v * (share if n in HOST_TIMED else k) for n, v in part.items()}


__all__ = [
    "StepCensus",
    "census",
    "segments",
    "op_seconds",
    "kda_seconds",
    "moe_comm_seconds",
    "layer_host",
    "ends_host",
    "step_host",
    "stretch",
    "share_factor",
    "time_share",
    "local_ranks",
    "HOST_TIMED",
]
