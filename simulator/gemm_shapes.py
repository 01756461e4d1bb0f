"""The weight GEMMs of one layer kind, with their real shapes, and their time on one GPU (``simulator.gemm_model``).

A linear layer is ``(n, k, split)``: ``y[t, n] = x[t, k] w[k, n]`` per token, TP-sharded along ``split`` (``"n"``
column-parallel: QKV, FC1, up-projections, router; ``"k"`` row-parallel: the output projection and FC2). Sequence
parallelism gathers the micro-batch's tokens first, so every dense GEMM has ``M = t`` rows (``t`` = micro-batch x
sequence / CP). Routed experts: ``E / EP`` local experts of ``rows = EP x ETP x (t / TP) x K / E`` rows each, FC1
``[rows, d] x [d, 2 F / ETP]`` (gate and up fused), FC2 ``[rows, F / ETP] x [F / ETP, d]``.
"""

from __future__ import annotations

from functools import lru_cache

from simulator.gemm_model import TILES, Roof, efficiency, pass_seconds, speedup_fp8
from simulator.hardware import HardwareSpec, load_hardware
from simulator.layers import layer_stats
from simulator.modelspec import ModelSpec


def _mixer(spec: ModelSpec, kind: str) -> list[tuple[int, int, str]]:
    h, nh = spec.hidden, spec.num_heads
    if kind == "none":
        return []
    if kind == "kda" and spec.kda_gate == "head":
        p, pk, nh = spec.kda_heads * spec.kda_head_dim, spec.kda_key_width, spec.kda_heads
        return [(2 * pk + 2 * p + 2 * nh, h, "n"), (h, p, "k")]
    if kind == "kda":
        p, d = spec.kda_heads * spec.kda_head_dim, spec.kda_head_dim
        return [(4 * p, h, "n"), (h, p, "k"), (d, h, "n"), (p, d, "n"), (spec.kda_heads, h, "n")]
    if kind == "mamba" and spec.mamba_heads:
        return [(spec.mamba2_in_proj, h, "n"), (h, spec.mamba_inner, "k")]
    if kind == "mamba":
        di, n, r = spec.mamba_inner, spec.mamba_d_state, spec.mamba_rank
        return [(2 * di, h, "n"), (r + 2 * n, di, "k"), (di, r, "n"), (h, di, "k")]
    if kind == "mla":
        dqk, dv, ql, kvl = spec.qk_nope_dim + spec.qk_rope_dim, spec.v_head_dim, spec.q_lora_rank, spec.kv_lora_rank
        q = [(ql, h, "n"), (nh * dqk, ql, "n")] if ql else [(nh * dqk, h, "n")]
        out = q + [(kvl + spec.qk_rope_dim, h, "n"), (nh * (spec.qk_nope_dim + dv), kvl, "n"), (h, nh * dv, "k")]
    else:
        dv = spec.dhead
        out = [(nh * dv + 2 * spec.kv_heads * dv, h, "n"), (h, nh * dv, "k")]
    if spec.attn_output_gate:
        out.append((nh * dv, h, "n"))
    return out


def _ffn(spec: ModelSpec, kind: str) -> list[tuple[int, int, str]]:
    h = spec.hidden
    if kind == "none":
        return []
    if kind == "dense":
        f = spec.ffn_hidden
        return [((2 if spec.gated_ffn else 1) * f, h, "n"), (h, f, "k")]
    out = [(spec.num_experts, h, "n")]
    fs = spec.shared_width
    if fs:
        out += [(spec.expert_fc1 * fs, h, "n"), (h, fs, "k")]
    if spec.moe_latent_dim:
        out += [(spec.moe_latent_dim, h, "n"), (h, spec.moe_latent_dim, "k")]
    return out


def layer_gemms(spec: ModelSpec, kind: tuple[str, str]) -> list[tuple[int, int, str]]:
    """``(n, k, split)`` of every dense weight GEMM of the layer (not the routed experts)."""
    return _mixer(spec, kind[0]) + _ffn(spec, kind[1])


@lru_cache(maxsize=4096)
def dense_seconds(spec: ModelSpec, kind: tuple[str, str], roof: Roof, t: float, tp: int) -> tuple[float, float]:
    """(forward, backward) seconds of the layer's dense GEMMs on one GPU; FLOPs the shape list does not name (a
    layer kind it does not know in detail) run at the listed GEMMs' mean rate, or at ``[t, H] x [H, H / TP]``'s."""
    fwd = bwd = listed = 0.0
    for n, k, split in layer_gemms(spec, kind):
        nn, kk = (n / tp, k) if split == "n" else (n, k / tp)
        f, b = pass_seconds(roof, t, nn, kk)
        fwd, bwd, listed = fwd + f, bwd + b, listed + 2.0 * n * k
    total = layer_stats(spec, kind).gemm_flops
    if listed <= 0:
        f, b = pass_seconds(roof, t, spec.hidden / tp, spec.hidden)
        return f * total / (2.0 * spec.hidden**2), b * total / (2.0 * spec.hidden**2)
    return fwd * total / listed, bwd * total / listed


@lru_cache(maxsize=4096)
def shared_expert_seconds(spec: ModelSpec, roof: Roof, t: float, tp: int) -> tuple[float, float]:
    """(forward, backward) seconds of the shared experts' two GEMMs on one GPU (``_ffn``'s shapes)."""
    fs, h = spec.shared_width, spec.hidden
    f1, b1 = pass_seconds(roof, t, spec.expert_fc1 * fs / tp, h)
    f2, b2 = pass_seconds(roof, t, h, fs / tp)
    return f1 + f2, b1 + b2


@lru_cache(maxsize=4096)
def expert_seconds(spec: ModelSpec, roof: Roof, rows: float, local: int, etp: int) -> tuple[float, float]:
    """(forward, backward) seconds of one GPU's routed-expert grouped GEMMs: ``local`` experts of ``rows`` rows."""
    d, f = spec.moe_latent_dim or spec.hidden, spec.moe_ffn_hidden
    f1, b1 = pass_seconds(roof, rows, spec.expert_fc1 * f / etp, d, local)
    f2, b2 = pass_seconds(roof, rows, d, f / etp, local)
    return f1 + f2, b1 + b2


@lru_cache(maxsize=256)
def roof_for(hw: HardwareSpec, precision: str, scale: float = 1.0) -> Roof:
    """The GEMM model's view of ``hw`` at ``precision``; ``scale`` >= 1 slows compute and HBM (what-if)."""
    eff, dtype = hw.efficiency, "fp8" if precision == "fp8" else "bf16"
    ceiling = (eff.gemm_fp8 or eff.gemm) if dtype == "fp8" else eff.gemm
    arch = hw.arch if (hw.arch, dtype) in TILES else ""
    peak = hw.peak_tflops(precision) * 1e12 / scale
    return Roof(
        arch=arch, sms=hw.sms, dtype=dtype, peak=peak, ceiling=ceiling, hbm=hw.hbm_tbps * 1e12 * eff.hbm / scale
    )


EXAMPLE_SHAPES = (
    ("square 8192^3", 8192, 8192, 8192, 1),
    ("Llama-3 70B QKV, TP8, 8k tokens", 8192, 1280, 8192, 1),
    ("Llama-3 70B FC2, TP8, 8k tokens", 8192, 8192, 3584, 1),
    ("DeepSeek-V3 experts FC1, 4 x 8192 rows", 8192, 4096, 7168, 4),
    ("Qwen3-30B-A3B experts FC1, 16 x 2048 rows", 2048, 1536, 2048, 16),
    ("Qwen3-30B-A3B experts FC2, 16 x 2048 rows", 2048, 2048, 768, 16),
    ("thin: 256 rows x 4096 x 4096", 256, 4096, 4096, 1),
)
"""``(label, M, N, K, groups)`` of the README's GEMM efficiency table."""


def efficiency_table(hardware: tuple[str, ...] = ("a100", "h100", "h200", "b200")) -> list[dict]:
    """Forward bf16 / fp8 efficiency (fraction of each dtype's peak) and the fp8 speed-up of forward + backward
    (casts included) for ``EXAMPLE_SHAPES`` on each preset."""
    rows = []
    for name in hardware:
        hw = load_hardware(name)
        bf16 = roof_for(hw, "bf16")
        fp8 = roof_for(hw, "fp8") if hw.fp8_tflops else None
        for label, m, n, k, g in EXAMPLE_SHAPES:
            rows.append(
                {
                    "hardware": name,
                    "shape": label,
                    "bf16": efficiency(bf16, m, n, k, g),
                    "fp8": efficiency(fp8, m, n, k, g) if fp8 else None,
                    "fp8_speedup": speedup_fp8(bf16, fp8, m, n, k, g) if fp8 else None,
                }
            )
    return rows


def format_efficiency_table(rows: list[dict]) -> str:
    """The README's markdown table of ``efficiency_table``."""
    out = [
        "| hardware | GEMM [M, K] x [K, N] (x groups) | bf16 | fp8 | fp8 speed-up (fwd + bwd) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        fp8 = f"{r['fp8']:.2f}" if r["fp8"] is not None else "-"
        up = f"{r['fp8_speedup']:.2f}x" if r["fp8_speedup"] is not None else "-"
        out.append(f"| {r['hardware']} | {r['shape']} | {r['bf16']:.2f} | {fp8} | {up} |")
    return "\n".join(out)
