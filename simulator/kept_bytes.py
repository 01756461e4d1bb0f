"""What one token's layer keeps for its backward under a recipe (``kept_bytes_per_token``): the fused kernels'
terms (``simulator.act_terms``) after the recipe's storage and recompute choices. The memory model keeps the
share not offloaded on the GPU (``memory.saved_bytes_per_token``); the offload moves the rest each way, and
``offload_seconds`` prices that traffic where compute does not hide it."""

from __future__ import annotations

from simulator.act_terms import GLU_INPUTS
from simulator.hardware import HardwareSpec
from simulator.layers import LayerStats
from simulator.modelspec import ModelSpec
from simulator.parallel import ParallelConfig

CACHE_BYTES = {"e5m6": 1.5, "fp8": 1.0}
"""Bytes per element of ``ParallelConfig.attn_out_cache`` (E5M6: 12 bits, DeepSeek-V3 report section 3.3.2)."""


def kept_bytes_per_token(spec: ModelSpec, par: ParallelConfig, st: LayerStats, flash: bool) -> float:
    """Activation bytes one token's layer keeps for the backward, on the GPU or offloaded: ``st.act_terms`` after
    fp8 storage (GEMM inputs; SwiGLU inputs with ``activation_fp8_input_store``), the attention-output cache,
    recomputed modules and the probabilities' place; a non-flash softmax adds ``act_s2_per_s`` per key position.
    The memory model keeps ``1 - offload_fraction`` of it on the GPU, the offload moves the rest each way."""
    split = par.tp if (par.sequence_parallel or par.tp == 1) else 1
    rep = st.act_attn_res_stacked if par.attn_res_impl == "release" else st.act_attn_res
    par_bytes = 0.0
    for term in st.act_terms:
        if term.when == "mla_kv" or (term.when == "flash" and not flash):
            continue
        if term.when == "combine" and par.moe_probs != "combine":
            continue
        if any(par.recompute == m or par.recomputes(m) for m in term.removed_by):
            continue
        nbytes = term.fp8 if par.fp8_activations else term.nbytes
        if par.activation_fp8_input_store and term.name in GLU_INPUTS:
            nbytes = term.nbytes / 2  # the e4m3 copy of the bf16 [2F] input
        if term.name == "attn_out" and par.attn_out_cache != "bf16" and not spec.attn_output_gate:
            nbytes = term.nbytes / 2 * CACHE_BYTES[par.attn_out_cache]  # one copy serves flash and the out-proj
        if term.bucket == "rep":
            rep += nbytes
        else:
            par_bytes += nbytes
    act = rep / split + par_bytes / par.tp
    if not flash and not par.recomputes("core_attn"):
        act += st.act_s2_per_s * par.seq_len / par.tp
    return act


def kept_layer_bytes(spec: ModelSpec, par: ParallelConfig, st: LayerStats, flash: bool) -> float:
    """Bytes per token the layer keeps under its recompute mode: full recompute keeps only its ``[t, H]`` input
    (the rest is rebuilt in the backward), any other mode ``kept_bytes_per_token``."""
    if par.recompute == "full":
        return 2.0 * spec.hidden / (par.tp if (par.sequence_parallel or par.tp == 1) else 1)
    return kept_bytes_per_token(spec, par, st, flash)


def offload_seconds(
    spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig, st: LayerStats, t: float, f: dict
) -> tuple[float, float]:
    """Exposed (forward, backward) PCIe seconds of moving the ``offload_fraction`` of what the layer keeps, for
    ``t`` tokens: to the host in the forward, back in the backward, each hidden behind that pass's compute of the
    layer (``f``: the forward's seconds by class)."""
    nbytes = t * kept_layer_bytes(spec, par, st, hw.efficiency.flash_attention) * par.offload_fraction
    move = nbytes / (hw.pcie_gbps * 1e9)
    busy_f = sum(f[k] for k in ("gemm", "grouped_gemm", "attention", "kda", "elementwise"))
    return max(0.0, move - busy_f), max(0.0, move - 2 * busy_f)
