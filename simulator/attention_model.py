"""Core softmax attention time from its shape: the key tiles a flash kernel computes and its rate by head dim.

A fused (flash) kernel walks a query block of ``KEY_TILE`` rows over key blocks of ``KEY_TILE`` keys and skips
only whole blocks, so a causal query computes ``s / 2 + KEY_TILE / 2`` keys on average and a sliding window of
``w`` keys ``w + KEY_TILE`` (the band crosses one more block), never more than the causal count.

The rate (``Efficiency.attention``, a fraction of the bf16 peak over forward + backward with the backward taken
as twice the forward) is the one at head dim 128. cuDNN's fused attention on H100 at 4k keys (FlashAttention-3
paper, Shah et al. 2024, arXiv 2407.08608, Figs. 5-6, non-causal) runs 609 / 499 TFLOP/s forward / backward at
head dim 128 and 408 / 417 at head dim 64; with the backward's 2.5x forward FLOPs that is 1.27x the time per
FLOP at head dim 64 (``HEAD_DIM_SLOWDOWN``, linear in between, 1 at 128 and above: head dim 256 runs at about
head dim 128's rate in the same figures). FP8 attention (TE's ``fp8_dot_product_attention``) runs
``FP8_SPEEDUP`` x faster: FlashAttention-3's FP8 forward over its BF16 forward at 4k keys, head dim 256 (1087 /
612 TFLOP/s, the only head dim the paper gives in FP8), taken for the backward too.
"""

from __future__ import annotations

from simulator.hardware import HardwareSpec
from simulator.modelspec import ModelSpec
from simulator.parallel import ParallelConfig

KEY_TILE = 128
"""Keys (and queries) per block of the fused kernels (FlashAttention-2/3 and cuDNN use 128-row tiles)."""
HEAD_DIM_SLOWDOWN = ((64, 1.27), (128, 1.0))
"""(head dim, time per FLOP relative to head dim 128): cuDNN on H100, see the module doc."""
FP8_SPEEDUP = 1087 / 612
"""FP8 over BF16 attention rate (FlashAttention-3 forward, 4k keys, head dim 256)."""


def keys_per_query(seq: int, window: int = 0, *, flash: bool = True) -> float:
    """Mean keys one query's blocks compute: causal ``s / 2 + KEY_TILE / 2``, a sliding window
    ``min(w + KEY_TILE, causal)``; without a fused kernel all ``s`` (the ``[s, s]`` scores are built, then masked)."""
    if not flash:
        return float(seq)
    causal = min(float(seq), seq / 2 + KEY_TILE / 2)
    return min(causal, float(window + KEY_TILE)) if window else causal


def head_dim_slowdown(head_dim: int) -> float:
    """Time per attention FLOP at ``head_dim`` relative to head dim 128 (``HEAD_DIM_SLOWDOWN``; held at the head
    dim 64 value below 64, where no measurement is quoted)."""
    (d0, s0), (d1, s1) = HEAD_DIM_SLOWDOWN
    if head_dim <= d0:
        return s0
    if head_dim >= d1:
        return s1
    return s0 + (s1 - s0) * (head_dim - d0) / (d1 - d0)


def qk_head_dim(spec: ModelSpec, kind: str) -> int:
    """The query/key head dim of a softmax layer kind (MLA: nope + rope)."""
    return spec.qk_nope_dim + spec.qk_rope_dim if kind == "mla" else spec.dhead


def attention_seconds(
    spec: ModelSpec,
    hw: HardwareSpec,
    par: ParallelConfig,
    kind: str,
    t: float,
    flops_per_key: float,
    *,
    window: int = 0,
    scale: float = 1.0,
) -> float:
    """Forward seconds of the core attention of ``t`` tokens (this GPU's, split by TP over heads) of a softmax
    layer ``kind`` whose forward costs ``flops_per_key`` per token per key; the backward is twice this."""
    eff = hw.efficiency
    keys = keys_per_query(par.seq_len, window, flash=eff.flash_attention)
    rate = hw.bf16_tflops * 1e12 / scale * eff.attention / head_dim_slowdown(qk_head_dim(spec, kind))
    if par.fp8_attention:
        rate *= FP8_SPEEDUP
    return t * flops_per_key * keys / par.tp / rate
