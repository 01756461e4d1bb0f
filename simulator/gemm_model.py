"""GEMM and grouped-GEMM time from shapes: a roofline with tile and wave quantisation, per hardware and dtype.

A GEMM ``[M, K] x [K, N]`` runs as CTA tiles of ``tile_m x tile_n`` (each walking K in steps of ``tile_k``) over the
GPU's SMs in waves. Its time is the larger of

- compute: ``waves x`` one tile's time, ``waves = ceil(tiles / units)``, ``tiles = ceil(M / tile_m) ceil(N / tile_n)``
  (padding of M and N to the tile, and a partly filled last wave, both cost a full tile / wave), one tile's time
  ``2 tile_m tile_n (ceil(K / tile_k) tile_k + K0)`` FLOPs at the unit's share of the achievable rate, ``K0 = 2
  tile_k`` the mainloop's pipeline fill per tile; the library picks the best of a few tile shapes (cuBLAS's
  heuristic does) and splits K over idle SMs when there are fewer tiles than SMs (split-K; the partial sums'
  reduction is left out); never faster than the dtype's ceiling;
- memory: ``(M K + K N) x`` input bytes ``+ M N x`` output bytes over the achieved HBM bandwidth (thin GEMMs).

The ceiling is the measured fraction of peak on the best large shapes (``Efficiency.gemm`` for bf16,
``Efficiency.gemm_fp8`` for fp8); the model reaches it on whole waves, tile-multiple M and N and ``K >= K_REF``.
A grouped GEMM (routed experts) is ``groups`` GEMMs of ``M`` rows each (each padded to the tile) sharing the waves.
FP8 adds what Transformer Engine does around the GEMM: the activation is quantised in the forward (read bf16, write
fp8 row- and column-wise, because Hopper's fp8 tensor cores take both operands K-major, so the weight-gradient GEMM
needs a transposed copy) and the output gradient likewise in the backward: ``4 M K`` and ``4 M N`` HBM bytes. The
weights' own cast is done once per step and cached across micro-batches (TE's ``is_first_microbatch``): left out.

Sources: SM counts and dense peaks from the NVIDIA datasheets / whitepapers (A100 108 SMs, H100 SXM, H800, H200 132,
B200 148 in 74 two-SM pairs); tile shapes: CUTLASS 3.x Hopper warp-specialised kernels (128x256x64 bf16,
128x256x128 fp8, ``cutlass/examples/48_hopper_warp_specialized_gemm``), cuBLAS Ampere ``256x128_ldg8 ... 64x3``
kernels, CUTLASS Blackwell 2-SM UMMA 256x256 tiles (``examples/70_blackwell_gemm``); ceilings: see ``hardware.py``.
The smaller tiles' relative mainloop rates (0.92, 0.80) are engineering estimates (less operand reuse per tile).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

K_REF = 2048
"""K at and above which a whole-wave, unpadded GEMM reaches the ceiling (the best shapes of the MAMF table,
ml-engineering ``compute/accelerator/README.md``, have K 1536-2816)."""

# (tile_m, tile_n, tile_k, relative mainloop rate, SMs per tile)
_HOPPER_BF16 = ((128, 256, 64, 1.0, 1), (256, 128, 64, 1.0, 1), (128, 128, 64, 0.92, 1), (64, 128, 64, 0.80, 1))
_HOPPER_FP8 = ((128, 256, 128, 1.0, 1), (256, 128, 128, 1.0, 1), (128, 128, 128, 0.92, 1), (64, 128, 128, 0.80, 1))
TILES: dict[tuple[str, str], tuple] = {
    ("ampere", "bf16"): (
        (256, 128, 64, 1.0, 1),
        (128, 256, 64, 1.0, 1),
        (128, 128, 32, 0.92, 1),
        (64, 128, 32, 0.80, 1),
    ),
    ("hopper", "bf16"): _HOPPER_BF16,
    ("hopper", "fp8"): _HOPPER_FP8,
    ("blackwell", "bf16"): ((256, 256, 64, 1.0, 2), (256, 128, 64, 0.92, 2), (128, 128, 64, 0.80, 1)),
    ("blackwell", "fp8"): ((256, 256, 128, 1.0, 2), (256, 128, 128, 0.92, 2), (128, 128, 128, 0.80, 1)),
}
"""Candidate CTA tiles per (architecture, dtype)."""


@dataclass(frozen=True)
class Roof:
    """What the GEMM model needs of one hardware and dtype (hashable: the model is cached on it)."""

    arch: str
    """``ampere``, ``hopper``, ``blackwell``, or ``""`` (no tile model: the rate is the ceiling, e.g. a profile
    that measured its own GEMM rate)."""
    sms: int
    """Streaming multiprocessors."""
    dtype: str
    """``bf16`` or ``fp8``."""
    peak: float
    """Dense peak of the dtype, FLOP/s."""
    ceiling: float
    """Achievable fraction of ``peak`` on the best large shapes."""
    hbm: float
    """Achieved HBM bandwidth, bytes/s."""

    def __post_init__(self):
        if self.arch and (self.arch, self.dtype) not in TILES:
            raise ValueError(f"GEMM model: no tiles for arch {self.arch!r} and dtype {self.dtype!r}")
        if not (self.peak > 0 and 0 < self.ceiling <= 1 and self.hbm > 0):
            raise ValueError(f"GEMM model: peak, ceiling in (0, 1] and hbm must be positive, got {self}")


@lru_cache(maxsize=1 << 16)
def _compute_seconds(roof: Roof, m: int, n: int, k: int, groups: int) -> float:
    """Tile-and-wave compute time of ``groups`` GEMMs ``[m, k] x [k, n]`` (best candidate tile)."""
    flops = 2.0 * groups * m * n * k
    floor = flops / (roof.peak * roof.ceiling)
    if not roof.arch:
        return floor
    best = math.inf
    for tm, tn, tk, rate, per in TILES[(roof.arch, roof.dtype)]:
        units = max(1, roof.sms // per)
        k0 = 2 * tk
        unit_rate = roof.peak * roof.ceiling * rate / units * (K_REF + k0) / K_REF
        tiles = groups * math.ceil(m / tm) * math.ceil(n / tn)
        k_tiles = math.ceil(k / tk)
        split = max(1, min(units // tiles, k_tiles))  # split-K fills idle SMs when the tiles are few
        waves = math.ceil(tiles * split / units)
        best = min(best, waves * 2.0 * tm * tn * (math.ceil(k_tiles / split) * tk + k0) / unit_rate)
    return max(best, floor)


def gemm_seconds(roof: Roof, m: float, n: float, k: float, groups: int = 1, out_bytes: float = 2.0) -> float:
    """Seconds of ``groups`` GEMMs ``[m, k] x [k, n]`` (``m`` rows each): max of tile-quantised compute and HBM
    traffic (inputs at the dtype's bytes, output at ``out_bytes``)."""
    mi, ni, ki = max(1, math.ceil(m)), max(1, math.ceil(n)), max(1, math.ceil(k))
    a = 1.0 if roof.dtype == "fp8" else 2.0
    mem = groups * ((mi * ki + ki * ni) * a + mi * ni * out_bytes) / roof.hbm
    return max(_compute_seconds(roof, mi, ni, ki, groups), mem)


def efficiency(roof: Roof, m: float, n: float, k: float, groups: int = 1) -> float:
    """Achieved fraction of the dtype's peak of one forward GEMM (no fp8 casts)."""
    return 2.0 * groups * m * n * k / gemm_seconds(roof, m, n, k, groups) / roof.peak


@lru_cache(maxsize=1 << 16)
def pass_seconds(roof: Roof, m: float, n: float, k: float, groups: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds of one linear layer ``y[m, n] = x[m, k] w[k, n]`` per group: forward GEMM;
    backward = input-gradient GEMM ``[m, n] x [n, k]`` + weight-gradient GEMM ``[k, m] x [m, n]`` (fp32 output
    accumulated into the main gradient: read + write 8 bytes); fp8 adds the activation / gradient casts."""
    fwd = gemm_seconds(roof, m, n, k, groups)
    bwd = gemm_seconds(roof, m, k, n, groups) + gemm_seconds(roof, k, n, m, groups, out_bytes=8.0)
    if roof.dtype == "fp8":
        fwd += groups * 4.0 * m * k / roof.hbm
        bwd += groups * 4.0 * m * n / roof.hbm
    return fwd, bwd


def speedup_fp8(bf16: Roof, fp8: Roof, m: float, n: float, k: float, groups: int = 1) -> float:
    """bf16 over fp8 seconds of one linear layer's forward + backward."""
    return sum(pass_seconds(bf16, m, n, k, groups)) / sum(pass_seconds(fp8, m, n, k, groups))
