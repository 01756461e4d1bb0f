"""Per-layer counting: parameters, forward FLOPs per token by op class, saved activation bytes per token.

All counts are for one layer kind ``(attention, ffn)`` of a ``ModelSpec`` and are *per token* (FLOPs, bytes) or
per layer (parameters); the cost and memory models scale them by tokens, TP, CP and EP.

Conventions (stated because published tables differ):
- Model FLOPs = 2 x (matmul weights a token touches) + core attention 2 * heads * (d_qk + d_v) * s_kv with the
  *full* ``s_kv = s`` (no causal halving; Megatron's ``72 B s L h^2 (1 + s/6h + V/12hL)`` convention) + KDA
  chunked-recurrence FLOPs; training = 3 x forward. Norms, biases, convolutions and the router softmax are
  memory-bound ops timed by bytes, not counted as FLOPs.
- KDA forward FLOPs per token per head: ``6 dk dv`` (state read-out, key projection of the state, rank-1 update)
  ``+ 2 C (dk + dv)`` for the intra-chunk part with chunk ``C = 64``.
- Activation bytes follow Korthikanti et al. 2022 (arXiv 2205.05198) section 4: for the GPT layer they give
  ``34 s b h + 5 a s^2 b`` bytes (no recompute), of which ``10 s b h`` is not split by TP without sequence
  parallelism. Other layer types are generalised term by term (bf16 tensors = 2 bytes, dropout masks = 1 byte).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from simulator.act_terms import (
    ActTerm,
    attention_terms,
    common_terms,
    dense_ffn_terms,
    kda_terms,
    mamba2_terms,
    moe_terms,
    recurrent_terms,
)
from simulator.mamba_mixers import mamba_mixer
from simulator.modelspec import ModelSpec, blocks

KDA_CHUNK = 64
RECOMPUTE_MODES = ("none", "selective", "selective+act", "full")


@dataclass(frozen=True)
class LayerStats:
    """Counts for one layer kind; ``*_flops`` are forward FLOPs per token, ``act_*`` bytes per token."""

    kind: tuple[str, str]
    dense_params: int
    """Parameters sharded by TP and replicated over EP (attention, dense FFN, router, shared expert, norms)."""
    expert_params: int
    """Routed-expert parameters of the layer, all experts (sharded by EP x TP)."""
    active_params: int
    """Parameters one token touches."""
    gemm_flops: float
    """Dense matmuls (projections, dense FFN, router, latent, shared experts)."""
    grouped_flops: float
    """Routed-expert grouped GEMMs (top_k experts per token)."""
    attn_flops_per_s: float
    """Core softmax attention per token per key position (times s_kv)."""
    kda_flops: float
    """KDA chunked recurrence."""
    act_rep: float
    """Saved bytes not split by TP without sequence parallelism (norm and block inputs, dropout masks)."""
    act_par: float
    """Saved bytes split by TP (projections, FFN internals, expert internals)."""
    act_s2_per_s: float
    """Saved bytes per token per key position (non-flash softmax); dropped by selective recompute."""
    act_fn: float
    """Part of ``act_par`` recomputed by ``selective+act`` (activation outputs, KDA conv outputs)."""
    mla_kv: float
    """Compressed KV (latent + shared rope key) per token, reported separately from activations."""
    cp_kv_bytes: float
    """Ring-attention K and V bytes per token that travel around the CP ring (softmax layers)."""
    kda_state_bytes: float
    """fp32 KDA transfer state (M, B) per sequence exchanged by CP-KDA."""
    dispatch_dim: int
    """Width of one dispatched token (latent width for LatentMoE), 0 for dense layers."""
    expert_bytes_bf16: int
    """bf16 bytes of one routed expert (the replica weight a ``moonep`` plan may move)."""
    act_gemm_in: float = 0.0
    """Bytes per token fp8 storage of GEMM inputs saves (``act_terms``' bf16 minus fp8 bytes; negative where TE's
    fp8 copy comes on top of a bf16 tensor another kernel keeps)."""
    act_attn_res: float = 0.0
    """Block AttnRes (K3): bytes per token per layer its two mixes keep, averaged over the layers, as moonep's K3
    keeps them (the new partial sum, bf16, and three fp32 numbers per source); 0 without AttnRes."""
    act_attn_res_stacked: float = 0.0
    """The same for the release's ``_apply_attn_res``, which keeps two fp32 stacks of its sources per mix."""
    act_terms: tuple[ActTerm, ...] = ()
    """The saved bytes term by term (``simulator.act_terms``), what ``memory.saved_bytes_per_token`` sums; the
    ``act_*`` totals above are derived from them (bf16, flash, probabilities inside the SwiGLU)."""
    module_bytes: tuple = ()
    """``((recompute module, saved bytes per token it drops, re-run forward GEMM FLOPs per token), ...)`` for the
    ``--recompute-modules`` names (core attention is priced from ``attn_flops_per_s`` instead)."""


_NO_MIXER = {"mat": 0, "vec": 0, "core": 0.0, "kda": 0.0, "par": 0.0, "fn": 0.0, "s2": 0.0, "kv": 0.0}
_NO_MIXER |= {"cp_kv": 0.0, "state": 0.0}
_NO_FFN = {"mat": 0, "vec": 0, "experts": 0, "active_experts": 0, "grouped": 0.0, "par": 0.0, "fn": 0, "dim": 0}
_NO_FFN |= {"eb": 0}


def _attention(spec: ModelSpec, kind: str) -> dict:
    h = spec.hidden
    if kind == "none":  # an FFN-only layer of a single-block hybrid
        return dict(_NO_MIXER)
    if kind == "mamba":
        return mamba_mixer(spec)
    if kind == "kda":
        nh, d = spec.kda_heads, spec.kda_head_dim
        p, pk, dk, kda = nh * d, spec.kda_key_width, spec.kda_key_dim or d, kda_terms(spec, KDA_CHUNK)
        if spec.kda_gate == "head":  # Gated DeltaNet: q, k [pk], v and z [p], b and a [nh], o; norm gain [d]
            mat, vec = h * (2 * pk + 2 * p + 2 * nh) + p * h, (2 * pk + p) * spec.kda_conv + 2 * nh + d
        else:
            mat = 4 * h * p + p * h + h * d + d * p + h * nh  # q, k, v, g, o, f_a, f_b, beta
            vec = 3 * p * spec.kda_conv + p + nh + d
        return {
            "mat": mat,
            "vec": vec,
            "core": 0.0,
            "kda": nh * (6 * dk * d + 2 * KDA_CHUNK * (dk + d)),
            "par": sum(t.nbytes for t in kda),
            "fn": sum(t.nbytes for t in kda if "selective+act" in t.removed_by),
            "s2": 0.0,
            "kv": 0.0,
            "cp_kv": 0.0,
            "state": nh * dk * 2 * d * 4,
        }
    nh = spec.num_heads
    if kind == "mla":
        dqk, dv = spec.qk_nope_dim + spec.qk_rope_dim, spec.v_head_dim
        ql, kvl = spec.q_lora_rank, spec.kv_lora_rank
        q = h * ql + ql * nh * dqk if ql else h * nh * dqk
        mat = q + h * (kvl + spec.qk_rope_dim) + kvl * nh * (spec.qk_nope_dim + dv) + nh * dv * h
        vec = ql + kvl
        kv = 2 * (kvl + spec.qk_rope_dim)
    else:
        dqk = dv = spec.dhead
        mat = h * nh * dqk + 2 * h * spec.kv_heads * dqk + nh * dv * h
        vec = (nh * dqk + 2 * spec.kv_heads * dqk + h) if spec.bias else 0
        kv = 0.0
    vec += nh if spec.attn_sinks else 0  # gpt-oss: one sink logit per head
    if spec.attn_output_gate:
        mat += h * nh * dv
    par = _terms_bytes(attention_terms(spec, kind))
    s2 = nh * (5 if spec.dropout else 2)  # softmax out (2) [+ dropout mask (1) + dropout out (2)]
    cp_kv = 2 * nh * (dqk + dv) if kind == "mla" else 2 * 2 * spec.kv_heads * dqk
    return {
        "mat": mat,
        "vec": vec,
        "core": 2.0 * nh * (dqk + dv),
        "kda": 0.0,
        "par": par,
        "fn": 0.0,
        "s2": s2,
        "kv": kv,
        "cp_kv": cp_kv,
        "state": 0.0,
    }


def _ffn(spec: ModelSpec, kind: str) -> dict:
    h = spec.hidden
    if kind == "none":  # a mixer-only layer of a single-block hybrid
        return dict(_NO_FFN)
    if kind == "dense":
        f = spec.ffn_hidden
        mat = (3 if spec.gated_ffn else 2) * h * f
        vec = (f + h) if spec.bias else 0
        par = _terms_bytes(dense_ffn_terms(spec))
        return {
            "mat": mat,
            "vec": vec,
            "experts": 0,
            "active_experts": 0,
            "grouped": 0.0,
            "par": par,
            "fn": 2 * f,
            "dim": 0,
            "eb": 0,
        }
    e, k, fe = spec.num_experts, spec.top_k, spec.moe_ffn_hidden
    de, mats = spec.moe_latent_dim or h, spec.expert_fc1 + 1
    one = mats * de * fe
    fs = spec.shared_width
    mat = e * h + mats * h * fs + (2 * h * spec.moe_latent_dim if spec.moe_latent_dim else 0)
    vec = (e if spec.router_bias else 0) + spec.moe_latent_dim + (h if spec.shared_expert_gate else 0)
    par = _terms_bytes(moe_terms(spec))  # probabilities inside the SwiGLU: no expert output kept
    return {
        "mat": mat,
        "vec": vec,
        "experts": e * one,
        "active_experts": k * one,
        "grouped": 2.0 * k * one,
        "par": par,
        "fn": k * 2 * fe + 2 * fs,
        "dim": de,
        "eb": 2 * one,
    }


def _modules(spec: ModelSpec, kind: tuple[str, str], terms: tuple[ActTerm, ...]) -> tuple:
    """Per recompute module: (name, bf16 bytes per token of the terms it stops saving, GEMM FLOPs per token to
    redo it)."""
    h, out = spec.hidden, []

    def dropped(name: str) -> float:
        return sum(t.nbytes for t in terms if name in t.removed_by and t.when in ("", "flash"))

    out.append(("layernorm", dropped("layernorm"), 0.0))  # the two norm outputs, recomputed from the saved inputs
    if kind[0] == "mla":
        nh, dqk, dv = spec.num_heads, spec.qk_nope_dim + spec.qk_rope_dim, spec.v_head_dim
        up = (spec.q_lora_rank * nh * dqk if spec.q_lora_rank else 0) + spec.kv_lora_rank * nh * (spec.qk_nope_dim + dv)
        out.append(("mla_up_proj", dropped("mla_up_proj"), 2.0 * up))
    if kind[1] == "dense":
        out.append(("mlp_act", dropped("mlp_act"), 0.0))
        mats = 3 if spec.gated_ffn else 2  # Megatron's "mlp": the whole dense MLP re-run from its saved input
        out.append(("mlp", dropped("mlp"), 2.0 * mats * h * spec.ffn_hidden))
    elif kind[1] == "moe":
        fs = spec.shared_width
        out.append(("moe_act", dropped("moe_act"), 0.0))
        if fs:
            out.append(("shared_experts", dropped("shared_experts"), 2.0 * (spec.expert_fc1 + 1) * h * fs))
        # Megatron's "moe": the whole layer re-run from its saved input; these are its dense GEMMs (router, shared
        # experts, LatentMoE projections), the routed experts' grouped GEMMs are priced with them in ``costs``
        lat = spec.moe_latent_dim
        dense = spec.num_experts * h + (spec.expert_fc1 + 1) * h * fs + 2 * h * lat
        out.append(("moe", dropped("moe"), 2.0 * dense))
    return tuple(out)


def _terms_bytes(terms) -> float:
    """bf16 bytes per token of ``terms`` that are activations by default (flash, probabilities inside SwiGLU)."""
    return float(sum(t.nbytes for t in terms if t.when in ("", "flash")))


def act_terms(spec: ModelSpec, kind: tuple[str, str], a: dict, f: dict) -> tuple[ActTerm, ...]:
    """Every saved-bytes term of one layer kind (``simulator.act_terms``); recurrent mixers from ``_attention``."""
    terms = common_terms(spec, kind)
    if kind[0] == "kda":
        terms += kda_terms(spec, KDA_CHUNK)
    elif kind[0] == "mamba":
        terms += mamba2_terms(spec) if spec.mamba_heads else recurrent_terms(a["par"], a["fn"], kind[0])
    elif kind[0] != "none":
        terms += attention_terms(spec, kind[0])
    if kind[1] != "none":
        terms += dense_ffn_terms(spec) if kind[1] == "dense" else moe_terms(spec)
    return tuple(terms)


def _norm_params(spec: ModelSpec, kind: tuple[str, str]) -> int:
    """Norm (and AttnRes) parameters of a layer: one pre-norm per block it holds."""
    h = spec.hidden
    if spec.attn_res:
        return 6 * h  # 4 RMSNorm gains + 2 AttnRes pseudo-queries (k3_architecture.md 3.2)
    return (2 if spec.norm == "layernorm" else 1) * h * blocks(kind)


@lru_cache(maxsize=256)
def layer_stats(spec: ModelSpec, kind: tuple[str, str]) -> LayerStats:
    """Counts for one ``(attention, ffn)`` layer kind of ``spec``."""
    a, f = _attention(spec, kind[0]), _ffn(spec, kind[1])
    dense = a["mat"] + a["vec"] + f["mat"] + f["vec"] + _norm_params(spec, kind)
    terms = act_terms(spec, kind, a, f)
    rep = _terms_bytes(t for t in terms if t.bucket == "rep")  # norm inputs (+ stats) and outputs, dropout masks
    mixes, mixes_stacked = attn_res_bytes(spec)
    return LayerStats(
        kind=kind,
        dense_params=dense,
        expert_params=f["experts"],
        active_params=dense + f["active_experts"],
        gemm_flops=2.0 * (a["mat"] + f["mat"]),
        grouped_flops=f["grouped"],
        attn_flops_per_s=a["core"],
        kda_flops=float(a["kda"]),
        act_rep=float(rep),
        act_par=_terms_bytes(t for t in terms if t.bucket == "par" and t.when != "mla_kv"),
        act_s2_per_s=float(a["s2"]) if a["core"] else 0.0,
        act_fn=_terms_bytes(t for t in terms if "selective+act" in t.removed_by),
        mla_kv=float(a["kv"]),
        cp_kv_bytes=float(a["cp_kv"]),
        kda_state_bytes=float(a["state"]),
        dispatch_dim=f["dim"],
        expert_bytes_bf16=f["eb"],
        act_gemm_in=float(sum(t.nbytes - t.fp8 for t in terms if t.when in ("", "flash"))),
        act_attn_res=mixes,
        act_attn_res_stacked=mixes_stacked,
        act_terms=terms,
        module_bytes=_modules(spec, kind, terms),
    )


def attn_res_sources(spec: ModelSpec) -> list[int]:
    """Sources of every AttnRes mix in layer order (k3_architecture.md 2.1): before the attention of layer
    ``l >= 1``, the blocks closed at layers ``0, S, 2S, ... < l`` plus the partial sum; before the FFN, also the
    block closed at ``l`` itself."""
    size = spec.attn_res_block_size or spec.num_layers
    out = []
    for layer in range(spec.num_layers):
        if layer:
            out.append((layer - 1) // size + 2)
        out.append(layer // size + 2)
    return out


@lru_cache(maxsize=64)
def attn_res_bytes(spec: ModelSpec) -> tuple[float, float]:
    """(moonep, release) bytes per token per layer the AttnRes mixes keep, averaged over the layers. moonep's
    custom backward (``k3.attnres``) keeps the sources by reference, so a mix adds the one source that is new, the
    partial sum ([t, H] bf16), and fp32 norms, logits and weights per source (12 bytes each); the release's
    ``_apply_attn_res`` keeps the fp32 stack of the sources and of their normalised copies: 8 H bytes a source."""
    if not spec.attn_res:
        return 0.0, 0.0
    sources = attn_res_sources(spec)
    h, layers = spec.hidden, spec.num_layers
    ours = sum(2.0 * h + 12.0 * n for n in sources) / layers
    stacked = sum(8.0 * h * n for n in sources) / layers
    return ours, stacked


def embedding_params(spec: ModelSpec) -> int:
    return spec.vocab * spec.hidden + spec.position_embeddings * spec.hidden


def head_params(spec: ModelSpec) -> int:
    """LM head plus final norm (and the K3 output AttnRes vectors)."""
    final = 3 * spec.hidden if spec.attn_res else (2 if spec.norm == "layernorm" else 1) * spec.hidden
    return (0 if spec.tie_embeddings else spec.vocab * spec.hidden) + final


@dataclass(frozen=True)
class ParamCounts:
    """Whole-model parameter counts."""

    total: int
    """All parameters (tied embeddings counted once)."""
    active: int
    """Parameters one token touches, counting the LM head but not the input embedding (K3 Table 1 rule)."""
    experts: int
    """Routed-expert parameters."""
    embedding: int
    head: int


def param_counts(spec: ModelSpec) -> ParamCounts:
    """Exact parameter counts of ``spec`` (``k3`` gives 2,779,484,476,000 total and 104,189,612,640 active)."""
    total = active = experts = 0
    for kind in spec.layer_kinds():
        st = layer_stats(spec, kind)
        total += st.dense_params + st.expert_params
        active += st.active_params
        experts += st.expert_params
    emb, head = embedding_params(spec), head_params(spec)
    head_mat = spec.vocab * spec.hidden  # a tied head still multiplies every token
    return ParamCounts(
        total=total + emb + head,
        active=active + head + (head_mat if spec.tie_embeddings else 0),
        experts=experts,
        embedding=emb,
        head=head,
    )


@lru_cache(maxsize=256)
def model_flops_per_token(spec: ModelSpec, seq_len: int, causal: bool = False) -> float:
    """Training model FLOPs per token (3 x forward, LM head included, no recompute). Attention counts every
    query-key pair (full square, the default) or, with ``causal``, the mean ``(s + 1) / 2`` keys a query sees;
    a sliding-window layer counts ``min(window, keys)``."""
    fwd = 2.0 * spec.vocab * spec.hidden
    windowed = set(spec.sliding_window_layers)
    keys = (seq_len + 1) / 2 if causal else float(seq_len)
    for i, kind in enumerate(spec.layer_kinds()):
        st = layer_stats(spec, kind)
        k = min(keys, spec.sliding_window) if i in windowed else keys
        fwd += st.gemm_flops + st.grouped_flops + st.attn_flops_per_s * k + st.kda_flops
    return 3.0 * fwd


EAGER_BIAS_BYTES = (28.0, 40.0)
"""HBM bytes per FC2 output element of one routed copy that Megatron's eager ``TEGroupedMLP._apply_bias`` moves
(forward, backward): FC2's bias comes back per expert and is added as ``t + b * p`` in fp32, expert by expert, then
concatenated and cast back to bf16. Counted on megatron-core's own code (tests/simulator/test_eager_expert.py)."""
EAGER_CLAMP_BYTES = (8.0, 15.0)
"""The same per FC1 output element for the clamp that ``weighted_bias_quick_geglu_impl`` applies before its fused
activation (``activation_func_clamp_value``): two clamps and a concatenation forward; backward, each clamp's
masked gradient (compare, and, where) and the chunk's concatenation."""


def eager_expert_bytes(spec: ModelSpec) -> tuple[float, float, float]:
    """(forward, backward, recomputed forward) HBM bytes per routed copy that Megatron's eager expert path moves
    outside its fused kernels for an expert bias and an activation clamp (FC1's bias is in its GEMM epilogue)."""
    fc1 = spec.expert_fc1 * spec.moe_ffn_hidden
    out = spec.moe_latent_dim or spec.hidden
    bias = EAGER_BIAS_BYTES if spec.expert_bias else (0.0, 0.0)
    clamp = EAGER_CLAMP_BYTES if spec.glu_clamp else (0.0, 0.0)
    return bias[0] * out + clamp[0] * fc1, bias[1] * out + clamp[1] * fc1, clamp[0] * fc1
