"""Per-chunk costs of one micro-batch: compute by op class and communication by collective, in seconds.

Both engines (``analytic`` and ``events``) price work with these functions, so they differ only in how they
schedule it. A *chunk* is the contiguous layers one pipeline rank runs for one model stage (``parallel.
stage_layers``); ``t`` below is the tokens of one micro-batch on one GPU, ``micro_batch * seq_len / CP``.

Modelling choices (why, not just what):
- Backward = 2 x forward for every op class (weight and input gradients).
- TP with sequence parallelism: 2 all-gathers + 2 reduce-scatters of the ``[t, H]`` bf16 activation per layer
  forward, as many backward (the re-gathers for weight gradients are overlapped, as Megatron does).
- CP ring attention passes K/V around the ring under the attention kernel (exposed only past it); CP-KDA
  all-gathers the fp32 transfer state ``(M, B)`` of each sequence (not overlapped, it is small).
- MoE: dispatch + combine forward, their transposes backward. ``classic``: the busiest EP rank has ``(1 + maxvio)``
  x the mean tokens, so expert GEMMs and the all-to-all (incast) scale by it, the excess is ``imbalance``.
  ``moonep``: exact balance, plus the replica-weight traffic of the busiest receiver (``replicas_per_rank``:
  ``planner.plan`` on a synthetic load of that ``maxvio``, or the bound ``min(E/EP, ceil(maxvio E/EP))``) per
  layer per micro-batch, fetched forward, fetched again and their gradients returned backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from simulator import gemm_shapes, host
from simulator import network as net
from simulator.act_terms import GLU_INPUTS
from simulator.attention_model import attention_seconds
from simulator.hardware import HardwareSpec
from simulator.kept_bytes import offload_seconds
from simulator.layers import eager_expert_bytes, layer_stats
from simulator.modelspec import ModelSpec, blocks
from simulator.parallel import ParallelConfig
from simulator.replicas import replicas_per_rank

COMPUTE_CLASSES = (
    "gemm",
    "grouped_gemm",
    "attention",
    "kda",
    "elementwise",
    "moe_fixed",
    "imbalance",
    "recompute",
    "offload",
    "host",
)
"""``moe_fixed``: router, permute/unpermute bytes and the per-layer dropless sync; ``offload``: exposed PCIe time
of activation offload; ``host``: framework time of eager ops (nonzero only with a calibrated host profile)."""
COMM_CLASSES = ("tp", "cp", "ep")
FULL_RECOMPUTE = ("gemm", "grouped_gemm", "imbalance", "attention", "kda", "elementwise", "moe_fixed", "tp", "cp", "ep")
"""Forward work full recompute runs again in the backward."""


@dataclass
class ChunkCost:
    """One micro-batch through one chunk on one GPU: forward and backward seconds by class."""

    fwd: dict = field(default_factory=lambda: dict.fromkeys(COMPUTE_CLASSES + COMM_CLASSES, 0.0))
    bwd: dict = field(default_factory=lambda: dict.fromkeys(COMPUTE_CLASSES + COMM_CLASSES, 0.0))
    ep_raw_fwd: float = 0.0
    """EP all-to-all seconds before any overlap (DualPipe hides it behind the paired micro-batch)."""
    ep_raw_bwd: float = 0.0
    p2p: float = 0.0
    """One activation (or gradient) send to the neighbouring stage."""
    layers: int = 0

    @property
    def tf(self) -> float:
        return sum(self.fwd.values())

    @property
    def tb(self) -> float:
        return sum(self.bwd.values())

    def compute(self, d: dict) -> float:
        return sum(d[k] for k in COMPUTE_CLASSES)


def _size(eff, flops: float) -> float:
    """Size factor of the GEMM efficiency curve for one GEMM of ``flops``."""
    half = eff.gemm_half_gflop * 1e9
    return flops / (flops + half) if half > 0 else 1.0


def node_dedup(spec: ModelSpec, epg: net.Group) -> float:
    """Bytes leaving the node with per-node deduplication / without, for uniform top-k routing: a token's copies
    to other nodes are ``K (N - 1) / N`` on average, the distinct other nodes it reaches ``(N - 1) (1 - q)`` with
    ``q = C(E - E/N, K) / C(E, K)`` the chance that a node holds none of its K experts; group-limited routing
    (M groups of G >= N, each inside one node) caps that at ``M (N - 1) / N``."""
    nodes = epg.n // max(1, epg.k)
    if nodes <= 1:
        return 1.0
    e, k, per = spec.num_experts, spec.top_k, spec.num_experts // nodes
    q = math.comb(e - per, k) / math.comb(e, k)
    distinct = (nodes - 1) * (1.0 - q)
    if spec.groups_per_token and spec.expert_groups >= nodes:  # group-limited routing: at most M nodes a token
        distinct = min(distinct, spec.groups_per_token * (nodes - 1) / nodes)
    return distinct / (k * (nodes - 1) / nodes)


def _ep_seconds(spec, par, st, t, tiers, comm_scale, skew) -> tuple[float, float]:
    """Raw (forward, backward) seconds of one MoE layer's EP traffic: dispatch, combine, replica weights."""
    if par.ep <= 1:
        return 0.0, 0.0
    tp = par.tp
    epg = net.group(par.ep, par.expert_tp, tiers)
    rows = t / tp * spec.top_k * st.dispatch_dim * _capacity(par)[0]  # dropped copies are not sent
    disp = rows * (1.03 if par.precision == "fp8" else 2.0)  # fp8 payload + one fp32 scale per 128
    weights = net.all_to_all(
        replicas_per_rank(spec, par) * st.expert_bytes_bf16 / par.expert_tp, epg, tiers, comm_scale
    )
    remote = node_dedup(spec, epg) if par.dispatcher == "deepep" else 1.0
    tokens = net.all_to_all(rows * 2.0, epg, tiers, comm_scale, incast=skew, remote=remote)
    ep_f = net.all_to_all(disp, epg, tiers, comm_scale, incast=skew, remote=remote) + tokens + weights
    return ep_f, 2 * tokens + 2 * weights


def _capacity(par: ParallelConfig) -> tuple[float, float]:
    """(rows per routed expert over the dropless balanced mean, busiest expert's rows / that): the skew ``1 +
    maxvio`` (non-``moonep`` dispatchers) capped by a capacity factor (``moe_load``; padded rows count)."""
    load, busy = par.moe_load(1.0 + par.maxvio if par.dispatcher != "moonep" else 1.0)
    return load, busy / load


def _layer(spec, hw, par, kind, t, tiers, scale, comm_scale, window=0):
    """Forward/backward seconds of one layer: (fwd dict, bwd dict, ep_raw_f, ep_raw_b)."""
    st, eff = layer_stats(spec, kind), hw.efficiency
    bf16 = hw.bf16_tflops * 1e12 / scale
    hbm = hw.hbm_tbps * 1e12 * eff.hbm / scale
    tp, s = par.tp, par.seq_len
    split = tp if (par.sequence_parallel or tp == 1) else 1
    f = dict.fromkeys(COMPUTE_CLASSES + COMM_CLASSES, 0.0)
    h = spec.hidden
    # GEMMs from their shapes (simulator.gemm_model): tiles, waves, roofline, fp8 casts; backward priced apart
    roof = gemm_shapes.roof_for(hw, par.precision, scale)
    size = _size(eff, 2.0 * t * h * h / tp)
    dense = gemm_shapes.dense_seconds(spec, kind, roof, t, tp)
    gemm_fb = tuple(x / size for x in dense)
    grouped_fb = (0.0, 0.0)
    load, skew = _capacity(par)
    if st.grouped_flops:
        # balanced rows per local expert: the EP x ETP group's tokens (t / TP each), ETP ranks share an expert
        rows = par.ep * par.expert_tp * (t / tp) * spec.top_k / spec.num_experts * load
        one = rows * st.grouped_flops / spec.top_k / 3 / par.expert_tp  # FLOPs of one expert matrix's GEMM
        slow = eff.grouped_gemm * _size(eff, one) * rows / (rows + eff.grouped_half_rows)
        local = spec.num_experts // par.ep
        grouped_fb = tuple(x / slow for x in gemm_shapes.expert_seconds(spec, roof, rows, local, par.expert_tp))
    f["gemm"], f["grouped_gemm"], f["imbalance"] = gemm_fb[0], grouped_fb[0], grouped_fb[0] * (skew - 1.0)
    f["attention"] = attention_seconds(spec, hw, par, kind[0], t, st.attn_flops_per_s, window=window, scale=scale)
    f["kda"] = t * st.kda_flops / tp / (bf16 * eff.kda)
    s2 = 0.0 if eff.flash_attention else t * st.act_s2_per_s * s * 2.5 / tp / hbm
    # without sequence parallelism the norm/dropout share (act_rep of all saved bytes) is not split by TP
    rep = st.act_rep / (st.act_rep + st.act_par) if split == 1 and tp > 1 else 0.0
    # a single-block hybrid's layer holds one of the two blocks (norm, residual, activation), so half the bytes
    half = blocks(kind) / 2
    f["elementwise"] = half * t * eff.elementwise_bytes * spec.hidden * (rep + (1 - rep) / tp) / hbm + s2
    b = {k: 2.0 * v for k, v in f.items()}
    b["gemm"], b["grouped_gemm"], b["imbalance"] = gemm_fb[1], grouped_fb[1], grouped_fb[1] * (skew - 1.0)
    attention = (f["attention"], b["attention"])
    tp_f, cp_f, cp_b = _tp_cp_seconds(par, st, kind, (t, spec.hidden), tiers, comm_scale, eff, attention)
    ep_f, ep_b = _ep_seconds(spec, par, st, t, tiers, comm_scale, skew) if kind[1] == "moe" else (0.0, 0.0)
    f["tp"], b["tp"], f["cp"], b["cp"] = tp_f, tp_f, cp_f, cp_b
    keep = 1.0 - eff.ep_overlap if par.schedule != "dualpipe" else 1.0
    f["ep"], b["ep"] = ep_f * keep, ep_b * keep
    if hw.host is not None:  # a CPU rank: host-timed work and FLOPs, time-shared by the local ranks
        f["ep"], b["ep"] = _host_layer(spec, hw, par, kind, t, f, b, scale)
        f, b = host.time_share(hw, par, f), host.time_share(hw, par, b)
        ep_f, ep_b = f["ep"], b["ep"]
    elif par.shared_expert_overlap and par.schedule != "dualpipe" and ep_f + ep_b > 0 and spec.shared_width:
        # the shared experts' GEMMs run on their own stream while each pass's all-to-all is in flight
        sf, sb = (x / size for x in gemm_shapes.shared_expert_seconds(spec, roof, t, tp))
        f["ep"], b["ep"] = max(0.0, f["ep"] - sf), max(0.0, b["ep"] - sb)
    _recipe_terms(spec, hw, par, kind, t, f, b, s2, scale, roof, dense[0])
    # after the recipe terms: the MoE bookkeeping, sync gaps and recomputed work are compute-stream time too
    if par.moe_a2a_overlap and par.schedule != "dualpipe" and ep_f + ep_b > 0 and hw.host is None:
        f["ep"], b["ep"] = _overlapped_ep(par, f, b, ep_f * keep, ep_b * keep, hw.sms)
    over = eff.layer_overhead_s
    f["elementwise"] += over / 3
    b["elementwise"] += 2 * over / 3
    return f, b, ep_f, ep_b


def _tp_cp_seconds(par, st, kind, shape, tiers, comm_scale, eff, attention) -> tuple[float, float, float]:
    """Seconds of one layer's TP collectives on its ``shape = (tokens, hidden)`` bf16 activations (each pass; what
    TP overlap leaves) and its CP exchange (forward, backward): the KV ring beyond the ``attention`` (forward,
    backward) it feeds, or KDA's chunk state."""
    (t, h), tp = shape, par.tp
    tp_one = net.all_gather(t * h * 2.0, net.group(tp, 1, tiers), tiers, comm_scale)
    tp_f = 2 * blocks(kind) * tp_one * (1.0 - eff.tp_overlap)  # an all-gather and a reduce-scatter per block
    if par.cp <= 1:
        return tp_f, 0.0, 0.0
    cpg = net.group(par.cp, tp, tiers)
    if kind[0] == "kda":
        cp = net.all_gather(par.micro_batch * st.kda_state_bytes / tp * par.cp, cpg, tiers, comm_scale)
        return tp_f, cp, cp
    ring = net.all_gather(t * st.cp_kv_bytes / tp * par.cp, cpg, tiers, comm_scale)
    return tp_f, max(0.0, ring - attention[0]), max(0.0, 2 * ring - attention[1])


def _host_layer(spec, hw, par, kind, t, f, b, scale) -> tuple[float, float]:
    """Host-bound pricing (``simulator.host``) of one layer, in place: framework ops instead of elementwise
    bytes, the calibrated KDA kernel (forward:backward taken as 1:2), collectives per call; returns the MoE
    layer's (forward, backward) collective seconds. ``scale`` slows this rank's compute (what-if)."""
    fwd_ops, bwd_ops, kda = (v * scale for v in host.layer_host(spec, hw, par, kind, t))
    f["host"], b["host"] = fwd_ops, bwd_ops
    f["elementwise"] = b["elementwise"] = 0.0
    f["kda"], b["kda"] = kda / 3, 2 * kda / 3
    if kind[1] == "moe":
        return host.moe_comm_seconds(spec, hw, par, t / par.tp)
    return 0.0, 0.0


def _recipe_terms(spec, hw, par, kind, t, f, b, s2, scale, roof, dense_f) -> None:
    """In place: MoE fixed costs, recompute (modes and ``--recompute-modules``), the bytes Megatron's eager expert
    path moves for an expert bias or activation clamp (``layers.eager_expert_bytes``; none when the experts are
    fused, ``ParallelConfig.fused_expert_mlp``) and activation offload."""
    st, eff = layer_stats(spec, kind), hw.efficiency
    hbm = hw.hbm_tbps * 1e12 * eff.hbm / scale
    if kind[1] == "moe" and hw.host is None:
        f["moe_fixed"] = _moe_fixed(spec, par, t, hbm) + _dispatcher_overhead(spec, par, t, eff, scale)
        b["moe_fixed"] = 2 * f["moe_fixed"]
    # recomputed GEMMs run at the layer's own dense GEMM rate (``dense_f``: its forward GEMM seconds, from shapes)
    gemm_rate = t * st.gemm_flops / par.tp / dense_f if dense_f > 0 else roof.peak * roof.ceiling
    b["recompute"] = _recompute(par, f, s2) + _module_recompute(par, st, t, gemm_rate)
    rerun_moe = kind[1] == "moe" and par.recompute != "full" and par.recomputes("moe")
    if rerun_moe:  # the whole MoE layer again (its dense GEMMs are above): routed experts, bookkeeping, dispatch and
        # combine, and its activation function (a tenth of the elementwise bytes, as ``moe_act``)
        redo_act = 0.1 * (f["elementwise"] - s2)
        b["recompute"] += f["grouped_gemm"] + f["imbalance"] + f["moe_fixed"] + f["ep"] + redo_act
    if kind[1] == "moe" and hw.host is None and not par.fused_expert_mlp:  # Megatron's eager expert epilogue
        fwd, bwd, redo = eager_expert_bytes(spec)
        per_byte = t / par.tp * spec.top_k * _capacity(par)[0] / hbm  # seconds per byte of each routed copy
        redo = fwd if par.recompute == "full" else fwd * rerun_moe + redo * par.recomputes("moe_act")
        f["elementwise"] += per_byte * fwd
        b["elementwise"] += per_byte * bwd
        b["recompute"] += per_byte * redo
    if par.activation_fp8_input_store:  # SwiGLU inputs cast to e4m3 and back by unfused ops: 3 B/element each way
        glu = t / par.tp * sum(x.nbytes for x in st.act_terms if x.name in GLU_INPUTS) / 2 * 3.0 / hbm
        f["elementwise"], b["elementwise"] = f["elementwise"] + glu, b["elementwise"] + glu
    if par.offload_fraction and hw.host is None:
        f["offload"], b["offload"] = offload_seconds(spec, hw, par, st, t, f)


def steady_fraction(par: ParallelConfig) -> float:
    """Share of a pipeline rank's forward and backward passes that run in 1F1B steady state, paired with a pass
    of another micro-batch (mean over ranks): rank r of 1F1B warms up with ``min(m, p - r - 1)`` lone forwards and
    cools down with as many lone backwards; interleaved with ``(p - r - 1) 2 + (v - 1) N`` chunk passes."""
    m, p, v = par.micro_batches, par.pp, par.vpp
    passes = m * v if par.schedule == "interleaved" else m
    return 1.0 - sum(par.warmup_passes(r) / passes for r in range(p)) / p


def _overlapped_ep(par, f, b, ep_f, ep_b, sms: int) -> tuple[float, float]:
    """EP seconds left exposed with ``moe_a2a_overlap``: in a steady-state pair (this layer's forward of one
    micro-batch with its backward of another, as Megatron's combined 1F1B runs them) the dispatch/combine of one
    hides behind the other's compute-stream time (recomputed work and the MoE bookkeeping and sync gaps included:
    the communication kernels run on their own stream), ``max(0, ep_f + ep_b - compute_f - compute_b)`` stays;
    lone warm-up and cool-down passes keep theirs. The compute that runs beside the dispatch/combine kernels loses
    their ``ParallelConfig.ep_comm_sms`` of the GPU's ``sms``: it takes ``sms / (sms - ep_comm_sms)`` as long."""
    compute = sum(f[k] + b[k] for k in COMPUTE_CLASSES if k != "recompute") + b["recompute"]
    shared = par.ep_comm_sms / (sms - par.ep_comm_sms) if 0 < par.ep_comm_sms < sms else 0.0
    paired = max(0.0, ep_f + ep_b - compute) + shared * min(ep_f + ep_b, compute)
    phi = steady_fraction(par)
    scale = (phi * paired + (1.0 - phi) * (ep_f + ep_b)) / (ep_f + ep_b)
    return ep_f * scale, ep_b * scale


def _dispatcher_overhead(spec, par, t, eff, scale) -> float:
    """Forward seconds of the MoE dispatcher's per-copy work and per-layer fixed cost (host sync and launches), a
    third of each (the backward pays twice the forward). The fixed cost follows how the step is launched: eager
    ``moe_layer_fixed_s``, per-module CUDA graphs ``moe_layer_module_graph_s`` (the sync and the expert part's
    launches stay), a full-iteration graph ``moe_layer_graphed_s`` (neither). A token-dropping run (capacity
    factor) pays the same: its fixed-size buffers remove the sync but not the launches, and the fit cannot tell
    the two apart (an eager capacity-factor run, Nemotron 3 Super on H100, is +35% too fast without it)."""
    copies = t / par.tp * spec.top_k * eff.moe_copy_ns * 1e-9 * scale
    fixed = {
        "none": eff.moe_layer_fixed_s,
        "modules": eff.moe_layer_module_graph_s,
        "full": eff.moe_layer_graphed_s,
    }[par.cuda_graph]
    return (fixed + copies) / 3


def _moe_fixed(spec, par, t, hbm) -> float:
    """Forward seconds of the MoE bookkeeping kernels on this GPU's ``t / TP`` tokens: router logits, softmax and
    top-k over E experts in fp32 (about 4 passes of 4 bytes), permutation and un-permutation of the ``top_k``
    copies (read + write each way, bf16) and the probability-weighted sum."""
    de = spec.moe_latent_dim or spec.hidden
    per_token = 16.0 * spec.num_experts + 8.0 * spec.top_k * de * _capacity(par)[0] + 4.0 * de
    return t / par.tp * per_token / hbm


def _module_recompute(par: ParallelConfig, st, t: float, gemm_rate: float) -> float:
    """Backward seconds re-running ``--recompute-modules`` GEMMs (MLA up-projection, shared experts); the
    activation-function and norm modules are elementwise and priced by ``_recompute``'s share."""
    if par.recompute == "full":
        return 0.0
    return sum(t * flops / par.tp / gemm_rate for name, _, flops in st.module_bytes if flops and par.recomputes(name))


def _recompute(par: ParallelConfig, f: dict, s2: float) -> float:
    """Extra backward seconds spent re-running forward work."""
    if par.recompute == "none":
        return 0.0
    if par.recompute == "full":
        return sum(f[k] for k in FULL_RECOMPUTE)
    extra = f["attention"] + s2 if par.recomputes("core_attn") else 0.0
    if par.recompute == "selective+act":
        extra += 0.3 * (f["elementwise"] - s2) + 0.5 * f["kda"]
    else:  # each activation / norm module re-runs about a tenth of the layer's elementwise bytes
        extra += 0.1 * (f["elementwise"] - s2) * sum(par.recomputes(m) for m in ("mlp_act", "moe_act", "layernorm"))
    return extra


def chunk_cost(
    spec: ModelSpec,
    hw: HardwareSpec,
    par: ParallelConfig,
    layers: list[int],
    tiers: net.Tiers,
    *,
    first: bool = False,
    last: bool = False,
    scale: float = 1.0,
    comm_scale: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> ChunkCost:
    """Costs of ``layers`` for one micro-batch; ``first``/``last`` add the embedding / LM head and loss.

    ``scale`` >= 1 slows this GPU's compute (what-if); ``comm_scale`` multiplies each tier's bandwidth.
    """
    t = par.micro_batch * par.seq_len / par.cp
    c = ChunkCost(layers=len(layers))
    kinds = spec.layer_kinds()
    cache: dict = {}
    windowed = set(spec.sliding_window_layers)
    for i in layers:
        key = (kinds[i], i in windowed)
        if key not in cache:
            w = spec.sliding_window if key[1] else 0
            cache[key] = _layer(spec, hw, par, kinds[i], t, tiers, scale, comm_scale, w)
        f, b, ef, eb = cache[key]
        for k in c.fwd:
            c.fwd[k] += f[k]
            c.bwd[k] += b[k]
        c.ep_raw_fwd += ef
        c.ep_raw_bwd += eb
    eff = hw.efficiency
    hbm = hw.hbm_tbps * 1e12 * eff.hbm / scale
    for _ in range(1 + getattr(spec, "mtp_layers", 0) if last else 0):  # the LM head, again per MTP module
        head, loss = _head_seconds(spec, hw, par, t, scale)
        c.fwd["gemm"] += head
        c.bwd["gemm"] += 2 * head
        if hw.host is None:
            c.fwd["elementwise"] += loss
            c.bwd["elementwise"] += loss
    if last and getattr(spec, "mtp_layers", 0):
        _add_mtp(c, spec, hw, par, t, tiers, scale, comm_scale)
    if first and hw.host is None:
        c.fwd["elementwise"] += t * spec.hidden * 4 / hbm
        c.bwd["elementwise"] += t * spec.hidden * 8 / hbm
    if hw.host is not None and (first or last):  # embedding, output mix, final norm, head and loss ops
        ends_f, ends_b = host.ends_host(spec, hw, par, t)
        share = host.share_factor(hw, par)
        c.fwd["host"] += ends_f * share * scale
        c.bwd["host"] += ends_b * share * scale
    split = par.tp if par.sequence_parallel else 1
    c.p2p = net.p2p(t * spec.hidden * 2.0 / split, par.tp * par.cp * par.dp, tiers, comm_scale)
    return c


def _head_seconds(spec, hw, par, t, scale) -> tuple[float, float]:
    """(LM-head GEMM, fp32 loss elementwise) forward seconds of one micro-batch on this GPU. The head runs in
    bf16 in FP8 runs too (Megatron's ``output_layer`` is a plain ``ColumnParallelLinear``, not a TE layer)."""
    eff = hw.efficiency
    peak = hw.peak_tflops("bf16") * 1e12 / scale
    head = t * 2.0 * spec.vocab * spec.hidden / par.tp / (peak * eff.gemm) * host.stretch(hw, par)
    loss = t * spec.vocab * 4 * 3 / par.tp / (hw.hbm_tbps * 1e12 * eff.hbm / scale)  # fp32 logits: write, read+write
    return head, loss


def _add_mtp(c: ChunkCost, spec, hw, par, t, tiers, scale, comm_scale) -> None:
    """In place: the multi-token-prediction modules on the last stage (DeepSeek-V3 section 2.2), each its layers
    (``ModelSpec.mtp_kinds``) plus the ``[2H -> H]`` projection of the concatenated norm outputs (its LM head pass
    and loss are added with the main head)."""
    n, h = spec.mtp_layers, spec.hidden
    for kind in spec.mtp_kinds():
        f, b, ef, eb = _layer(spec, hw, par, kind, t, tiers, scale, comm_scale)
        for k in c.fwd:
            c.fwd[k] += n * f[k]
            c.bwd[k] += n * b[k]
        c.ep_raw_fwd, c.ep_raw_bwd = c.ep_raw_fwd + n * ef, c.ep_raw_bwd + n * eb
    head = _head_seconds(spec, hw, par, t, scale)[0]
    proj = head * (2.0 * h) / spec.vocab  # [t, 2H] x [2H, H] at the head's rate: 2 t 2H H FLOPs / TP
    c.fwd["gemm"] += n * proj
    c.bwd["gemm"] += 2 * n * proj
