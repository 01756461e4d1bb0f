"""Mamba mixers' parameters, scan FLOPs and rough saved bytes (``layers.layer_stats``' per-kind dict): Mamba-1 as
Jamba builds it, Mamba-2 (SSD) as Bamba and Granite-4 build it."""

from __future__ import annotations

from simulator.act_terms import mamba2_terms
from simulator.modelspec import ModelSpec


def mamba_mixer(spec: ModelSpec) -> dict:
    """A Mamba mixer as HF ``JambaMambaMixer`` builds it: in_proj [H -> 2 Di], depthwise conv1d (Di x d_conv taps
    + bias), x_proj [Di -> R + 2N], dt_proj [R -> Di] + bias, A_log [Di, N], D [Di], out_proj [Di -> H], RMSNorm
    gains on dt (R), B and C (N each). The projections are GEMMs; the selective scan (per token and channel-state
    pair: exp(dt A), dt B u, h = a h + b, y += C h: about 7 FLOPs) is priced as a recurrence through the ``kda``
    (recurrent-kernel) channel, a rough stand-in for a memory-bound scan. Saved bytes (rough, bf16): xz, the conv
    output, x_proj's output, dt, the gated scan output."""
    if spec.mamba_heads:
        return _mamba2(spec)
    h, di, n, r = spec.hidden, spec.mamba_inner, spec.mamba_d_state, spec.mamba_rank
    mat = h * 2 * di + di * (r + 2 * n) + r * di + di * h
    vec = di * spec.mamba_d_conv + di * int(spec.mamba_conv_bias) + di  # conv taps (+ bias), dt_proj bias
    vec += di * n + di + r + 2 * n  # A_log, D, dt/B/C norm gains
    vec += (2 * di + h) if spec.mamba_proj_bias else 0
    return {
        "mat": mat,
        "vec": vec,
        "core": 0.0,
        "kda": 7.0 * di * n,
        "par": 2 * (6 * di + r + 2 * n),
        "fn": 2 * di,
        "s2": 0.0,
        "kv": 0.0,
        "cp_kv": 0.0,
        "state": di * n * 4,
    }


MAMBA2_CHUNK = 256
"""SSD chunk length (HF ``mamba_chunk_size`` default; the intra-chunk products grow with it)."""


def _mamba2(spec: ModelSpec) -> dict:
    """A Mamba-2 mixer as HF ``BambaMixer`` / ``GraniteMoeHybridMambaLayer`` build it: in_proj [H -> 2 Di + 2 G N +
    nh] (z, x, B, C, dt), depthwise conv1d over x, B and C (+ bias), dt_bias, A_log and D per head, the gated
    RMSNorm gain [Di], out_proj [Di -> H]. The SSD scan (per token: B x into the state and C h out, 4 Di N FLOPs,
    plus the intra-chunk C B^T and its product with x, (Di + G N) x chunk) goes through the recurrent-kernel
    (``kda``) channel, as for Mamba-1: rough. Saved bytes: what Megatron's fused path keeps
    (``act_terms.mamba2_terms``, measured in ``tests/simulator/test_act_measured.py``)."""
    h, di, n, g, nh = spec.hidden, spec.mamba_inner, spec.mamba_d_state, spec.mamba_groups, spec.mamba_heads
    conv = di + 2 * g * n
    mat = h * spec.mamba2_in_proj + di * h
    vec = conv * spec.mamba_d_conv + conv * int(spec.mamba_conv_bias) + 3 * nh + di
    vec += (spec.mamba2_in_proj + h) if spec.mamba_proj_bias else 0
    return {
        "mat": mat,
        "vec": vec,
        "core": 0.0,
        "kda": 4.0 * di * n + (di + g * n) * MAMBA2_CHUNK,
        "par": sum(t.nbytes for t in mamba2_terms(spec)),
        "fn": 0.0,  # the fused kernel recomputes the convolution whatever the recompute mode
        "s2": 0.0,
        "kv": 0.0,
        "cp_kv": 0.0,
        "state": di * n * 4,
    }
