"""Saved activation bytes per token of one layer, term by term, as the fused kernels Megatron / Transformer Engine
run keep them (``layers.LayerStats.act_terms``; measured by ``simulator.calibrate_activations``); KDA as
flash-linear-attention's fused layer keeps it (``kda_terms``).

What each fused kernel keeps for its backward (docs/reference/foreign_traces_and_memory.md, "Measuring activation
memory on CPU"): flash attention q, k, v, its output o and an fp32 log-sum-exp per head (no s x s matrix); a fused
RMSNorm its input and an fp32 rstd per row (LayerNorm: mean and rstd); a GEMM its input (the weight is a
parameter); SwiGLU its input ``[n, 2F]`` and, with the routing probability applied inside (Megatron's
``weighted_bias_swiglu``), the probability; fused RoPE nothing (cos/sin are fixed); the fused permutation an int32
row map per routed copy. A storage read by several ops is counted once, by its first saver (the norm output that
feeds the router, the shared expert and the permutation is one term).

Buckets: ``rep`` terms are not split by TP without sequence parallelism (norm inputs and outputs, dropout masks);
``par`` terms are. ``fp8`` is a term's bytes in a run whose GEMM inputs are stored in fp8 (Transformer Engine keeps
the fp8 cast of a GEMM input instead of the bf16 tensor when nothing else keeps the bf16 one): the norm outputs that
a fused norm+GEMM produces directly in fp8, the MLA LoRA norm outputs, the expert and FFN second-GEMM inputs, the
permuted tokens. Not halved: flash attention's q, k, v, o (bf16 kernels; the output projection's fp8 copy of o
comes on top of the bf16 o flash keeps, so ``attn_out`` grows by 1 byte an element), SwiGLU inputs, the MoE layer's
norm output (the router's bf16 GEMM keeps it; the shared expert's fp8 copy comes on top), fp32 router state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from simulator.modelspec import ModelSpec, blocks

GLU_INPUTS = ("ffn_act_in", "expert_act_in", "shared_act_in")
"""The SwiGLU inputs (``[2F]`` per token or routed copy) that ``ParallelConfig.activation_fp8_input_store`` keeps
in fp8."""
WHEN = ("", "flash", "combine", "mla_kv")
"""``flash``: only with flash attention (the non-flash softmax keeps ``act_s2_per_s`` instead); ``combine``: only
when the routing probabilities are applied at the combine (``ParallelConfig.moe_probs``); ``mla_kv``: reported as
the ``mla_kv`` memory item, not as activations."""


@dataclass(frozen=True)
class ActTerm:
    """One group of tensors a layer keeps for its backward, bytes per token."""

    name: str
    """Term name (``norm_in``, ``qkv``, ``lse``, ``attn_out``, ``expert_act_in``, ...)."""
    nbytes: float
    """Bytes per token in a bf16 run."""
    bucket: str
    """``rep`` (not split by TP without sequence parallelism) or ``par`` (split by TP)."""
    fp8: float
    """Bytes per token when GEMM inputs are stored in fp8 (module docstring)."""
    removed_by: tuple[str, ...] = ()
    """Recompute modules (Megatron ``--recompute-modules`` names) or modes (``selective+act``) that drop it."""
    when: str = ""
    """A ``WHEN`` condition under which it exists (empty: always)."""

    def __post_init__(self):
        if self.bucket not in ("rep", "par"):
            raise ValueError(f"ActTerm.bucket must be rep or par, got {self.bucket!r}")
        if self.when not in WHEN:
            raise ValueError(f"ActTerm.when must be one of {WHEN}, got {self.when!r}")
        if self.nbytes < 0 or self.fp8 < 0:
            raise ValueError(f"ActTerm {self.name}: bytes must be >= 0")


def _t(name: str, nbytes: float, bucket: str = "par", fp8: float | None = None, removed_by=(), when="") -> ActTerm:
    return ActTerm(name, float(nbytes), bucket, float(nbytes if fp8 is None else fp8), tuple(removed_by), when)


def norm_stats(spec: ModelSpec) -> int:
    """fp32 bytes per row a fused norm keeps besides its input: rstd (RMSNorm) or mean and rstd (LayerNorm)."""
    return 8 if spec.norm == "layernorm" else 4


def common_terms(spec: ModelSpec, kind: tuple[str, str]) -> list[ActTerm]:
    """The pre-norm of each block the layer holds (two, or one in a single-block hybrid, where the other kind is
    ``none``): inputs (+ stats), outputs (the GEMM inputs of the sublayers), dropout masks."""
    h, n = spec.hidden, blocks(kind)
    out = [_t("norm_in", n * (2 * h + norm_stats(spec)), "rep")]
    if kind[0] != "none":  # fused norm + first GEMM (TE LayerNormLinear) emits the fp8 copy only; Mamba/KDA too
        out.append(_t("attn_norm_out", 2 * h, "rep", fp8=h, removed_by=("layernorm",)))
    if kind[1] != "none":  # dense: fused norm + FC1 (fp8 copy only); MoE: the router's bf16 GEMM keeps the bf16 one
        fp8 = h if kind[1] == "dense" else 2 * h
        out.append(_t("ffn_norm_out", 2 * h, "rep", fp8=fp8, removed_by=("layernorm",)))
    if spec.dropout:
        out.append(_t("dropout_masks", n * h, "rep"))
    return out


def attention_terms(spec: ModelSpec, kind: str) -> list[ActTerm]:
    """Softmax attention (GQA/MHA or MLA) as Megatron runs it with TE's fused kernels."""
    nh, stats = spec.num_heads, norm_stats(spec)
    out = []
    if kind == "mla":
        dqk, dv = spec.qk_nope_dim + spec.qk_rope_dim, spec.v_head_dim
        ql, kvl = spec.q_lora_rank, spec.kv_lora_rank
        if ql:  # q_a output (the q LoRA norm's input) and the norm's output (q_b's input, fused norm+GEMM)
            out += [_t("q_lora", 2 * ql + stats), _t("q_lora_norm_out", 2 * ql, fp8=ql)]
        # kv_a output [kvl + rope]: the kv norm keeps a view of it (the compressed KV), counted as ``mla_kv``
        out.append(_t("kv_lora", 2 * (kvl + spec.qk_rope_dim) + stats, when="mla_kv"))
        out.append(_t("kv_lora_norm_out", 2 * kvl, fp8=kvl))
        # fused MLA RoPE writes q, k and v as their own tensors; flash keeps them
        out.append(_t("qkv", 2 * nh * (2 * dqk + dv), removed_by=("mla_up_proj",)))
    else:
        dqk = dv = spec.dhead
        out.append(_t("qkv", 2 * (nh + 2 * spec.kv_heads) * dqk))
    out.append(_t("lse", 4 * nh, removed_by=("core_attn",), when="flash"))
    if spec.attn_output_gate:  # o * sigmoid(g): o (flash), g (the gate's input) and the product (out-proj input)
        out += [_t("attn_out", 2 * nh * dv), _t("attn_gate", 2 * nh * dv), _t("attn_gated", 2 * nh * dv, fp8=nh * dv)]
    else:  # o is both flash's output and the out-proj input; TE adds its fp8 copy of it in fp8 runs
        out.append(_t("attn_out", 2 * nh * dv, fp8=3 * nh * dv))
    return out


def moe_terms(spec: ModelSpec) -> list[ActTerm]:
    """Router, fused permutation, routed experts (grouped GEMMs, SwiGLU), shared experts, LatentMoE projections."""
    h, e, k, fe = spec.hidden, spec.num_experts, spec.top_k, spec.moe_ffn_hidden
    de, fs, lat = spec.moe_latent_dim or h, spec.shared_width, spec.moe_latent_dim
    act_in = 2 * spec.expert_fc1  # bf16 bytes per F of the activation's input: SwiGLU [2F], squared ReLU [F]
    out = [
        # fp32 scores [E] (sigmoid/softmax keep their output), top-k indices int64 [K] (the gather's), the
        # gathered scores [K] and their sum (the normalising division's)
        _t("router", 4 * e + 8 * k + 4 * k + 4),
        _t("perm_map", 4 * k),  # int32 row map per routed copy (fused permute; the un-permute reuses it)
        _t("probs", 4 * k),  # fp32 permuted probability per copy (SwiGLU's, or the combine's)
        _t("expert_in", 2 * k * de, fp8=k * de),  # the permuted tokens, FC1's input
        _t("expert_act_in", act_in * k * fe),  # the activation's input per copy
        _t("expert_act_out", 2 * k * fe, fp8=k * fe, removed_by=("moe_act", "selective+act")),  # FC2's input
        _t("expert_out", 2 * k * de, when="combine"),  # kept for d(probs) only when probs multiply at the combine
    ]
    if lat:  # down [H -> d] before the dispatch (its input is the norm output), up [d -> H] after the combine
        out.append(_t("latent_up_in", 2 * lat, fp8=lat))
    if fs:  # input is the MoE norm output (already counted); TE's fp8 copy of it comes on top in fp8 runs
        out += [
            _t("shared_in_fp8", 0, fp8=h, removed_by=("shared_experts",)),
            _t("shared_act_in", act_in * fs, removed_by=("shared_experts",)),
            _t("shared_act_out", 2 * fs, fp8=fs, removed_by=("shared_experts", "selective+act")),
        ]
    if spec.shared_expert_gate:  # sigmoid(x w) [1] and the shared output it scales (not measured)
        out.append(_t("shared_gate", 2 * h + 4))
    # Megatron's "moe" recompute checkpoints the whole MoE layer: it keeps the layer's input (the norm output, a
    # common term) and none of these
    return [replace(t, removed_by=(*t.removed_by, "moe")) for t in out]


def dense_ffn_terms(spec: ModelSpec) -> list[ActTerm]:
    """Dense MLP: the activation's input (SwiGLU ``[2F]``, GeLU ``[F]``) and output (FC2's input)."""
    f = spec.ffn_hidden
    act_in = 4 * f if spec.gated_ffn else 2 * f
    return [
        _t("ffn_act_in", act_in, removed_by=("mlp",)),
        _t("ffn_act_out", 2 * f, fp8=f, removed_by=("mlp", "mlp_act", "selective+act")),
    ]


def kda_terms(spec: ModelSpec, chunk: int) -> list[ActTerm]:
    """KDA as flash-linear-attention's fused layer keeps it (``fla/layers/kda.py``: ``ShortConvolution`` keeps
    its input; ``chunk_kda`` with the l2norm, gate and beta sigmoid in-kernel keeps the normalised q, k and their
    fp32 rstd, v, the raw gate, the raw and fp32 sigmoided beta and the bf16 ``[n, h, chunk]`` Aqk and Akk;
    ``FusedRMSNormGated`` its input, the gate and an fp32 rstd per head); K3's output gate is full rank, the
    decay gate low rank (``f_a`` output kept as ``f_b``'s input). ``D = h d``. Gated DeltaNet (``kda_gate =
    "head"``, not measured: the same kernels' set by analogy) has q and k of ``kda_key_width`` and keeps its raw
    per-head decay and beta instead of the channel-wise gate."""
    nh, d = spec.kda_heads, spec.kda_head_dim
    dd, qkv = nh * d, 2 * spec.kda_key_width + nh * d
    gate = _t("kda_gate", 2 * dd + 2 * d, fp8=2 * dd + d)  # raw decay gate [D] (in-kernel gate), f_a output [d]
    return [
        _t("kda_conv_in", 2 * qkv),  # q, k, v projection outputs, the three short convolutions' inputs
        # conv outputs as the chunk keeps them (q, k normalised, with fp32 rstd): re-made by recomputing the conv
        _t("kda_qkv", 2 * qkv + 2 * 4 * nh, removed_by=("selective+act",)),
        gate if spec.kda_gate == "channel" else _t("kda_gate", 2 * nh + 4 * nh),
        _t("kda_beta", 2 * nh + 4 * nh),
        _t("kda_intra", 2 * 2 * nh * chunk),  # Aqk and Akk, bf16 [h, chunk] per token
        _t("kda_out", 2 * dd + 4 * nh + 2 * dd),  # o (the gated norm's input), its rstd, the output gate
        _t("kda_out_proj_in", 2 * dd, fp8=dd),
    ]


def mamba2_terms(spec: ModelSpec) -> list[ActTerm]:
    """A Mamba-2 mixer as Megatron trains it (``MambaMixer._ssm_training``): mamba_ssm's fused
    ``mamba_split_conv1d_scan_combined`` keeps the in-projection's output ``zxbcdt`` and the scan's ungated output
    (its backward recomputes the convolution); the grouped RMSNorm after it keeps its input (the gated output) and an
    fp32 rstd per group; the out-projection its input. ``Di`` inner width, ``G`` groups of state ``N``, ``nh``
    heads. The in-projection's own input is the layer's norm output (a common term)."""
    di, g = spec.mamba_inner, spec.mamba_groups
    return [
        _t("mamba_in_proj_out", 2 * spec.mamba2_in_proj),
        _t("mamba_scan_out", 2 * di),
        _t("mamba_norm_in", 2 * di + 4 * g),
        _t("mamba_out_proj_in", 2 * di, fp8=di),
    ]


def recurrent_terms(par_bytes: float, fn_bytes: float, name: str) -> list[ActTerm]:
    """Mamba-1 mixers (HF ``JambaMambaMixer``; not measured: no fused-kernel stand-in): projections and state
    inputs, and the convolution / activation outputs ``selective+act`` recomputes."""
    return [_t(name, par_bytes - fn_bytes), _t(f"{name}_act", fn_bytes, removed_by=("selective+act",))]


__all__ = [
    "WHEN",
    "ActTerm",
    "attention_terms",
    "common_terms",
    "dense_ffn_terms",
    "kda_terms",
    "mamba2_terms",
    "moe_terms",
    "recurrent_terms",
]
