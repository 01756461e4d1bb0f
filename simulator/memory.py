"""Memory per GPU for training (per pipeline rank, the peak is reported) and K3-hybrid inference memory.

Training bytes per parameter: bf16 weight 2 (+1 fp8 copy with ``precision=fp8``), fp32 main gradient 4, Adam
fp32 master + m + v 12 (Megatron's 18, or ``6 + 12/DP`` with the distributed optimizer). Dense parameters are
sharded by TP (ZeRO over DP x CP); routed experts by EP x TP (ZeRO over the DP x CP / EP expert-data ranks).

Activations per layer follow ``layers.LayerStats``; in-flight micro-batches follow the schedule: 1F1B rank r
holds ``min(m, p - r)``; interleaved rank r holds ``(p - r - 1) * 2 + (v - 1) * N + 1`` chunks (Megatron's
warm-up with N contiguous micro-batches, default p, which gives the paper's ``1 + (p-1)/(p v)`` factor on rank
0); DualPipe holds ``p + 1`` micro-batches (``p - h`` of its first-direction stage, ``h + 1`` of the other,
``h = min(r, p-1-r)``) and two weight copies. Unlike chunks of one rank (an uneven first or last stage, the MTP
module and the logits on the last) are weighted by what each holds at the rank's peak (``simulator.inflight``
walks the op order). ZeRO 2/3 keep one layer's gradients unsharded when each micro-batch reduces its own, and
price the accumulated unsharded gradients where activations + gradients peak when the step reduces them once
(``_zero_peak``).
Full recompute keeps each layer's ``[t, H]`` input plus one layer's working set.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from functools import lru_cache

from simulator.events import static_order
from simulator.hardware import HardwareSpec
from simulator.inflight import dualpipe_ops, has_dualpipe_order, peak_inflight
from simulator.kept_bytes import kept_bytes_per_token, kept_layer_bytes
from simulator.layers import embedding_params, head_params, layer_stats
from simulator.modelspec import ModelSpec
from simulator.parallel import ParallelConfig, rank_chunks, stage_layers
from simulator.replicas import replicas_per_rank

GIB = float(2**30)
MEMORY_ITEMS = ("params", "grads", "optimizer", "activations", "kda_states", "mla_kv", "ep_buffers", "reserved")


def _layer_act(spec: ModelSpec, par: ParallelConfig, st, t: float, flash: bool) -> tuple[float, float, float]:
    """(activations, mla_kv, kda_state) bytes of one layer for one micro-batch, on the GPU (offload deducted)."""
    if par.recompute == "full":
        return t * kept_layer_bytes(spec, par, st, flash) * (1.0 - par.offload_fraction), 0.0, 0.0
    return t * saved_bytes_per_token(spec, par, st, flash), t * st.mla_kv, par.micro_batch * st.kda_state_bytes / par.tp


def saved_bytes_per_token(spec: ModelSpec, par: ParallelConfig, st, flash: bool) -> float:
    """Activation bytes one token leaves on the GPU for the backward in one layer: what it keeps
    (``kept_bytes.kept_bytes_per_token``: the fused kernels' terms after fp8 storage, the attention-output cache,
    recomputed modules and the probabilities' place) less the share offloaded to the host."""
    return kept_bytes_per_token(spec, par, st, flash) * (1.0 - par.offload_fraction)


def mtp_act_bytes(spec: ModelSpec, par: ParallelConfig, flash: bool) -> float:
    """Saved bytes per token of the multi-token-prediction modules (on the last pipeline stage): per module its
    layers (``ModelSpec.mtp_kinds``), the ``[2H]`` concatenation the projection reads (an fp8 copy in fp8 runs)
    and the two norms' inputs and stats (embedding and the previous depth's hidden state)."""
    n = getattr(spec, "mtp_layers", 0)
    if not n:
        return 0.0
    stats = [layer_stats(spec, kind) for kind in spec.mtp_kinds()]
    split = par.tp if (par.sequence_parallel or par.tp == 1) else 1
    h = spec.hidden
    extra = 2 * (2 * h + 4) + (2 * h if par.fp8_activations else 4 * h)
    if par.recompute == "full":
        return n * (2.0 * h * len(stats) + extra) / split * (1.0 - par.offload_fraction)
    layers = sum(saved_bytes_per_token(spec, par, st, flash) + st.mla_kv for st in stats)
    return n * (layers + extra / split * (1.0 - par.offload_fraction))


@lru_cache(maxsize=1024)
def _full_working_set(spec: ModelSpec, par: ParallelConfig, t: float, flash: bool) -> float:
    """Largest single-layer activation set (rebuilt during a full-recompute backward)."""
    worst = 0.0
    for kind in set(spec.layer_kinds()):
        st = layer_stats(spec, kind)
        split = par.tp if (par.sequence_parallel or par.tp == 1) else 1
        s2 = 0.0 if flash else st.act_s2_per_s * par.seq_len / par.tp
        worst = max(worst, t * (st.act_rep / split + st.act_par / par.tp + s2 + st.mla_kv))
    return worst


@lru_cache(maxsize=4096)
def _chunk_totals(spec: ModelSpec, layers: tuple[int, ...], par: ParallelConfig, flash: bool) -> tuple:
    """(dense params, expert params, MoE layers, activation, MLA KV, KDA state bytes per micro-batch)."""
    per_kind = _kind_totals(spec, par, flash)
    totals = [0.0] * 6
    for kind, n in _kind_counts(spec, layers):
        for j, x in enumerate(per_kind[kind]):
            totals[j] += n * x
    dense, expert, moe, act, kv, kda = totals
    return dense, expert, int(moe), act, kv, kda


@lru_cache(maxsize=4096)
def _kind_counts(spec: ModelSpec, layers: tuple[int, ...]) -> tuple[tuple[tuple, int], ...]:
    """(layer kind, count) of a chunk's ``layers``; a search's many layouts cut the same chunks again and again."""
    kinds = spec.layer_kinds()
    return tuple(Counter(kinds[i] for i in layers).items())


@lru_cache(maxsize=4096)
def chunk_params(spec: ModelSpec, layers: tuple[int, ...]) -> tuple[float, float]:
    """(dense, expert) parameters of a chunk's ``layers`` (its embedding and head: ``chunk_end_params``)."""
    dense = expert = 0.0
    for kind, n in _kind_counts(spec, layers):
        st = layer_stats(spec, kind)
        dense, expert = dense + n * st.dense_params, expert + n * st.expert_params
    return dense, expert


@lru_cache(maxsize=256)
def _kind_totals(spec: ModelSpec, par: ParallelConfig, flash: bool) -> dict:
    """Per layer kind of ``spec``: (dense params, expert params, is MoE, activation, MLA KV, KDA state bytes per
    micro-batch); a layout's chunks share it, so each kind's saved bytes are worked out once per layout."""
    t = par.micro_batch * par.seq_len / par.cp
    out = {}
    for kind in set(spec.layer_kinds()):
        st = layer_stats(spec, kind)
        out[kind] = (st.dense_params, st.expert_params, float(kind[1] == "moe"), *_layer_act(spec, par, st, t, flash))
    return out


def rank_memory(spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig, rank: int) -> dict[str, float]:
    """Bytes by item (``MEMORY_ITEMS``) on pipeline rank ``rank``."""
    chunks = stage_layers(spec, par)
    mine, last = rank_chunks(par)[rank], len(chunks) - 1
    t = par.micro_batch * par.seq_len / par.cp
    flash = hw.efficiency.flash_attention
    totals = [_chunk_totals(spec, chunks[c], par, flash) for c in mine]
    # the multi-token-prediction modules sit after the last layer: their layers' saved bytes go with that chunk
    mtp_act = t * mtp_act_bytes(spec, par, flash)
    counts = peak_inflight(par, rank, tuple(tot[3] + (mtp_act if c == last else 0.0) for c, tot in zip(mine, totals)))
    dense = expert = act = kv = kda = 0.0
    moe_layers = 0
    for c, (d, e, n, a, k, s), live in zip(mine, totals, counts):
        dense, expert, moe_layers = dense + d, expert + e, moe_layers + n
        act, kv, kda = act + a * live, kv + k * live, kda + s * live
        end_dense, end_expert = chunk_end_params(spec, c, len(chunks))
        dense, expert = dense + end_dense, expert + end_expert
        if c == last:
            # MTP layers per micro-batch in flight, the bf16 logits + fp32 loss buffer of the main head and of each
            # MTP depth (all depths' losses are in the graph together until its backward)
            act += mtp_act * live + t * spec.vocab * 6.0 / par.tp * (1 + getattr(spec, "mtp_layers", 0))
    if par.recompute == "full":
        act += _full_working_set(spec, par, t, flash)
    params, grads, optim = _state_bytes(spec, par, dense, expert, mine, chunks)
    if par.zero_stage >= 2 and not par.reduces_every_microbatch:  # accumulated unsharded where the sum peaks
        full = _state_bytes(spec, replace(par, zero_stage=1), dense, expert, mine, chunks)[1]
        if par.schedule == "dualpipe" and not has_dualpipe_order(par):  # no order to walk: the upper bound
            fresh = full
        else:
            walked, fresh = _zero_peak(spec, par, rank, flash)
            act += walked - sum(tot[3] * live for tot, live in zip(totals, counts))
        grads = min(full, grads + fresh)
    ep_buf = 0.0
    if moe_layers:
        st = layer_stats(spec, next(k for k in spec.layer_kinds() if k[1] == "moe"))
        skew = 1.0 + par.maxvio if par.dispatcher != "moonep" else 1.0
        ep_buf = 2 * (t / par.tp) * spec.top_k * st.dispatch_dim * 2.0 * skew  # send + receive, bf16
        ep_buf += 2 * replicas_per_rank(spec, par) * st.expert_bytes_bf16 / par.expert_tp * 2  # weights+grads, x2 buf
    return {
        "params": params,
        "grads": grads,
        "optimizer": optim,
        "activations": act,
        "kda_states": kda,
        "mla_kv": kv,
        "ep_buffers": ep_buf,
        "reserved": hw.reserved_gib * GIB,
    }


def mtp_params(spec: ModelSpec) -> tuple[float, float]:
    """(dense, expert) parameters of the multi-token-prediction modules (DeepSeek-V3 section 2.2): per module its
    layers (``ModelSpec.mtp_kinds``), the ``[2H -> H]`` projection and its two input RMSNorms; embedding and LM
    head are shared with the main model, and repeated depths (``ModelSpec.mtp_repeated``) share one module."""
    n = getattr(spec, "mtp_layers", 0)
    if not n:
        return 0.0, 0.0
    n = 1 if spec.mtp_repeated else n
    stats = [layer_stats(spec, kind) for kind in spec.mtp_kinds()]
    dense = sum(st.dense_params for st in stats) + 2.0 * spec.hidden * spec.hidden + 2.0 * spec.hidden
    return n * dense, n * sum(st.expert_params for st in stats)


def chunk_end_params(spec: ModelSpec, chunk: int, n_chunks: int) -> tuple[float, float]:
    """(dense, expert) parameters chunk ``chunk`` of ``n_chunks`` holds beyond its layers: the word (and position)
    embedding on the first; the LM head, final norm and MTP modules on the last. A tied head on a chunk of its own
    keeps a copy of the word embedding (Megatron's last stage allocates ``output_layer.weight`` and all-reduces its
    gradient with the first stage's); a model in one chunk uses the embedding itself. Memory, ZeRO's walk and the
    data-parallel reduction all count a rank's parameters with this one rule."""
    dense = float(embedding_params(spec)) if chunk == 0 else 0.0
    expert = 0.0
    if chunk == n_chunks - 1:
        mtp_dense, mtp_expert = mtp_params(spec)
        copy = spec.vocab * spec.hidden if spec.tie_embeddings and n_chunks > 1 else 0
        dense += head_params(spec) + copy + mtp_dense
        expert += mtp_expert
    return dense, expert


def _state_bytes(spec, par: ParallelConfig, dense: float, expert: float, mine, chunks) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of the rank's ``dense`` / ``expert`` parameters. ZeRO shards over
    DP x CP (experts over their expert-data ranks): 1 the optimizer, 2 also the gradient accumulators, 3 also the
    weights, with two layers gathered (the one computing and the one prefetched, FSDP's default) alive. Gradients
    reduced after every micro-batch (``ParallelConfig.reduces_every_microbatch``) are unsharded one layer at a
    time; accumulated over the step, their unsharded peak is ``_zero_peak``'s (``rank_memory``)."""
    dense_g, expert_g = dense / par.tp, expert / (par.ep * par.expert_tp)
    dpg, edpg, zs = par.dp * par.cp, par.expert_dp, par.zero_stage
    w_bytes = 3.0 if par.precision == "fp8" else 2.0
    g_bytes = par.grad_bytes
    o_bytes = 4.0 + (8.0 if par.moment_dtype == "fp32" else 4.0)  # fp32 master + m + v
    params = dense_g * w_bytes / (dpg if zs >= 3 else 1) + expert_g * w_bytes / (edpg if zs >= 3 else 1)
    grads = dense_g * g_bytes / (dpg if zs >= 2 else 1) + expert_g * g_bytes / (edpg if zs >= 2 else 1)
    optim = dense_g * o_bytes / (dpg if zs >= 1 else 1) + expert_g * o_bytes / (edpg if zs >= 1 else 1)
    biggest = _biggest_layer(spec, par, mine, chunks) if zs >= 2 else 0.0
    if zs >= 2 and par.reduces_every_microbatch:  # each backward's gradients reduce-scattered: one layer unsharded
        grads += biggest * g_bytes
    if zs >= 3:  # two layers gathered: the one computing and the one prefetched
        params += 2 * biggest * w_bytes * (1.0 - 1.0 / dpg)
    return params, grads, optim


def _biggest_layer(spec, par: ParallelConfig, mine, chunks) -> float:
    """Parameters on this GPU of the rank's largest layer (what FSDP gathers, or reduce-scatters, at once)."""
    kinds = spec.layer_kinds()
    layers = [layer_stats(spec, kinds[i]) for c in mine for i in chunks[c]]
    return max((s.dense_params / par.tp + s.expert_params / (par.ep * par.expert_tp) for s in layers), default=0)


def _zero_peak(spec: ModelSpec, par: ParallelConfig, rank: int, flash: bool) -> tuple[float, float]:
    """(activations, unsharded gradient bytes) at the rank's peak of their sum under ZeRO 2/3, walking its op
    order (``events.static_order``; DualPipe's ``inflight.dualpipe_ops``): a forward adds its chunk's
    activations; the first backward of a chunk makes the chunk's unsharded gradients while its activations are
    still alive, and they stay until the step's reduce-scatter (``grad_reduce = step``: accumulated over the
    micro-batches, as FSDP ``no_sync`` keeps them); each backward then frees its activations. So the activation
    peak, at the end of the warm-up, has no gradients yet, and the gradients' peak, at the end, almost no
    activations."""
    chunks, mine = stage_layers(spec, par), rank_chunks(par)[rank]
    g_bytes = par.grad_bytes
    acts, grads = [], []
    for c in mine:
        d, e, _, a, _, _ = _chunk_totals(spec, chunks[c], par, flash)
        end_dense, end_expert = chunk_end_params(spec, c, len(chunks))
        d, e = d + end_dense, e + end_expert
        acts.append(a)
        grads.append((d / par.tp + e / (par.ep * par.expert_tp)) * g_bytes)
    order = dualpipe_ops(par, rank) if par.schedule == "dualpipe" else tuple(static_order(par, rank))
    return _walk(order, tuple(acts), tuple(grads))


@lru_cache(maxsize=1024)
def _walk(order: tuple, acts: tuple, grads: tuple) -> tuple[float, float]:
    """(activations, gradients) where their sum peaks along ``order`` (``[(kind, micro_batch, local_chunk)]``)."""
    act = made = 0.0
    best = (0.0, 0.0)
    seen = set()
    for kind, _, j in order:
        if kind == "F":
            act += acts[j]
        elif j not in seen:
            seen.add(j)
            made += grads[j]
        if act + made > sum(best):
            best = (act, made)
        if kind == "B":
            act -= acts[j]
    return best


def peak_memory(spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig) -> tuple[int, dict[str, float]]:
    """(rank, bytes by item) of the pipeline rank with the largest total."""
    best = None
    for r, mem in enumerate(pipeline_memory(spec, hw, par)):
        if best is None or sum(mem.values()) > sum(best[1].values()):
            best = (r, mem)
    return best[0], dict(best[1])


def pipeline_memory(spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig) -> tuple[dict[str, float], ...]:
    """``kept_rank_memory`` of every pipeline rank. Read-only (a shared cache)."""
    return tuple(kept_rank_memory(spec, hw, par, r) for r in range(par.pp))


def exceeds_memory(spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig, limit: float) -> bool:
    """Whether some pipeline rank needs more than ``limit`` bytes (``rank_memory``'s total). Rank 0 (the most
    micro-batches in flight) and the last (the logits) are tried first and the first rank over answers: a search
    screens far more layouts out than in. The ranks priced are kept (``kept_rank_memory``)."""
    p = par.pp
    return any(
        sum(kept_rank_memory(spec, hw, par, r).values()) > limit for r in dict.fromkeys((0, p - 1, *range(1, p)))
    )


@lru_cache(maxsize=1024)
def kept_rank_memory(spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig, rank: int) -> dict[str, float]:
    """``rank_memory``, kept for the next call: a search screens a layout's memory, then simulates it and prices
    each rank's optimizer from the same bytes. Read-only (a shared cache)."""
    return rank_memory(spec, hw, par, rank)


def inference_memory(
    spec: ModelSpec,
    *,
    batch: int,
    context: int,
    tp: int = 1,
    ep: int = 1,
    weight_bits: float = 16.0,
    expert_weight_bits: float | None = None,
    kv_bytes: float = 2.0,
) -> dict[str, float]:
    """Inference bytes per GPU: weights + MLA latent KV per token + fixed fp32 KDA state per sequence.

    For K3: MLA caches ``(512 + 64)`` values x 24 layers per token (27.6 KB in bf16); KDA keeps
    ``96 x 128 x 128`` fp32 per layer per sequence (69 layers: 434 MB) plus the 3-tap conv state, independent
    of ``context``. Softmax (non-MLA) layers cache K and V per KV head.
    """
    kinds = spec.layer_kinds()
    ebits = weight_bits if expert_weight_bits is None else expert_weight_bits
    dense = expert = 0.0
    kv_per_token = state_per_seq = 0.0
    for kind in kinds:
        st = layer_stats(spec, kind)
        dense += st.dense_params
        expert += st.expert_params
        if kind[0] == "mla":
            kv_per_token += (spec.kv_lora_rank + spec.qk_rope_dim) * kv_bytes
        elif kind[0] == "kda":
            conv = 2 * spec.kda_key_width + spec.kda_heads * spec.kda_head_dim  # q, k and v channels
            state_per_seq += st.kda_state_bytes / 2 + conv * (spec.kda_conv - 1) * 2.0  # S (fp32) + conv taps
        else:
            kv_per_token += 2 * spec.kv_heads * spec.dhead * kv_bytes / min(tp, spec.kv_heads)
    dense += embedding_params(spec) + head_params(spec)
    weights = dense * weight_bits / 8 / tp + expert * ebits / 8 / (tp * ep)
    return {
        "weights": weights,
        "mla_kv": kv_per_token * context * batch,
        "kda_state": state_per_seq * batch / tp,
        "kv_bytes_per_token": kv_per_token,
        "kda_state_bytes_per_sequence": state_per_seq,
        "total": weights + kv_per_token * context * batch + state_per_seq * batch / tp,
    }


def gib(x: float) -> float:
    return x / GIB


def fits(total_bytes: float, hw: HardwareSpec) -> bool:
    return total_bytes <= hw.hbm_gib * GIB and math.isfinite(total_bytes)
