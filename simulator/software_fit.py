"""The five constants the simulator fits to published runs: what the software stack sustains.

First principles price the work (FLOPs at GEMM shapes, bytes, link bandwidths, schedules); microbenchmarks give
the ceilings (``hardware.GEMM_CEILING``, ``simulator.gemm_model``). What neither gives is how much of a ceiling a
real training step sustains, and the MoE layer's per-micro-batch work that does not scale with tokens. Those,
and only those, are fitted here:

- ``sustained_hopper`` / ``sustained_blackwell``: the share of the microbenchmark GEMM ceilings (BF16 and FP8) a
  training step keeps (clocks under a training power load, SMs lent to communication kernels, launch gaps), one
  per architecture: no Blackwell GEMM ceiling was measured (``hardware.GEMM_CEILING`` uses the H100 fraction), so
  its share carries what Blackwell's microbenchmarks would have said;
- ``moe_layer_fixed_s``: seconds per MoE layer per micro-batch (forward + backward) of dropless dispatcher work
  (host syncs for the token counts, kernel launches);
- ``moe_layer_graphed_s``: the same under a full-iteration CUDA graph (no sync, no launches: kernel fill and
  drain), pinned by the recipes that capture one (``Published.cuda_graph``);
- ``moe_layer_module_graph_s``: the same under per-module TE graphs (router and preprocessing graphed, the host
  sync kept), pinned by the recipes that set them.

The three MoE constants are one number each for every GPU.

They are fitted jointly on every published run the simulator knows (``simulator.published.ROWS`` and
``simulator.calibration_runs.ROWS``, 40+ runs on five systems), by coordinate descent with golden-section search on
the absolute log error of tokens/s/GPU, averaged per family (MoE, dense) and summed: the mean absolute error is
what the validation is judged by, and unlike a squared error it does not let one family's unexplained cost (the
gpt-oss-120b rows, 1 to 2 s per step too fast, see the README) pull the constants every other run shares.
Never per row: a row moves a constant only by moving every row.
Because the fit sees the validation rows, their in-sample errors are optimistic; ``leave_one_out`` refits
without each row in turn and gives the out-of-sample error (``python -m simulator.software_fit`` prints both; the
README quotes them). Issue 18's Qwen3-30B-A3B H100 row is kept out (``validation.KNOWN_MISSES``). More constants
(per dtype, attention, per-architecture MoE costs) were tried and rejected: the published bf16 Hopper rows are too
few to pin them, and they soaked up one model family's unexplained cost (gpt-oss-120b, see the README).
"""

from __future__ import annotations

import math
from dataclasses import replace

from simulator.analytic import simulate
from simulator.calibration_runs import ROWS as CALIBRATION
from simulator.hardware import (
    MOE_LAYER_FIXED_S,
    MOE_LAYER_GRAPHED_S,
    MOE_LAYER_MODULE_GRAPH_S,
    SUSTAINED,
    HardwareSpec,
    load_hardware,
    sustained_gemm,
)
from simulator.published import ROWS, Published
from simulator.validation import KNOWN_MISSES, published_config, published_model, row_key

BOUNDS = {
    **{f"sustained_{arch}": (0.5, 1.0) for arch in SUSTAINED},
    "moe_layer_fixed_s": (0.0, 0.01),
    "moe_layer_graphed_s": (0.0, 0.01),
    "moe_layer_module_graph_s": (0.0, 0.01),
}
"""Search range of each constant (a fraction; seconds)."""


def fit_rows() -> tuple[Published, ...]:
    """Every published run the fit uses: validation and calibration tables, less the documented miss."""
    return tuple(r for r in ROWS + CALIBRATION if row_key(r) not in KNOWN_MISSES)


def with_constants(system: str, constants: dict[str, float]) -> HardwareSpec:
    """The preset of ``system`` with ``constants`` in place of the shipped ones (GPU presets with an ``arch``)."""
    hw = load_hardware(system)
    eff = replace(
        hw.efficiency,
        **sustained_gemm(constants[f"sustained_{hw.arch}"]),
        moe_layer_fixed_s=constants["moe_layer_fixed_s"],
        moe_layer_graphed_s=constants["moe_layer_graphed_s"],
        moe_layer_module_graph_s=constants["moe_layer_module_graph_s"],
    )
    return replace(hw, efficiency=eff)


def log_errors(rows: tuple[Published, ...], constants: dict[str, float]) -> list[float]:
    """``log(predicted / published)`` tokens/s/GPU of each row with ``constants``."""
    out = []
    for row in rows:
        res = simulate(published_model(row), with_constants(row.system, constants), published_config(row), row.gpus)
        out.append(math.log(res.tokens_per_s_per_gpu / row.tokens_per_s_per_gpu))
    return out


def loss(rows: tuple[Published, ...], constants: dict[str, float]) -> float:
    """Mean absolute log error of each family (MoE, dense), summed: the two families weigh the same, so the more
    numerous and noisier MoE rows do not set the dense GEMM rate alone."""
    errors = log_errors(rows, constants)
    total = 0.0
    for moe in (True, False):
        family = [abs(e) for r, e in zip(rows, errors) if r.is_moe == moe]
        total += sum(family) / len(family) if family else 0.0
    return total


def shipped() -> dict[str, float]:
    """The constants the presets carry now (``hardware.py``)."""
    return {
        **{f"sustained_{arch}": share for arch, share in SUSTAINED.items()},
        "moe_layer_fixed_s": MOE_LAYER_FIXED_S,
        "moe_layer_graphed_s": MOE_LAYER_GRAPHED_S,
        "moe_layer_module_graph_s": MOE_LAYER_MODULE_GRAPH_S,
    }


def _golden(f, lo: float, hi: float, iters: int) -> float:
    """Minimiser of a unimodal ``f`` on ``[lo, hi]`` by golden-section search."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def fit(
    rows: tuple[Published, ...], start: dict[str, float] | None = None, sweeps: int = 3, iters: int = 18
) -> dict[str, float]:
    """Coordinate descent from ``start`` (default: the shipped constants): each constant in turn by golden-section
    search (``iters`` steps, each narrowing the bracket 0.618x) within ``BOUNDS``, ``sweeps`` times over all."""
    constants = dict(start or shipped())
    for _ in range(sweeps):
        for key in constants:
            lo, hi = BOUNDS[key]

            def at(x: float, key: str = key) -> float:
                return loss(rows, {**constants, key: x})

            constants[key] = _golden(at, lo, hi, iters=iters)
    return constants


def leave_one_out(rows: tuple[Published, ...], start: dict[str, float] | None = None) -> list[float]:
    """Each row's log error under constants fitted without it (one sweep from ``start``)."""
    base = dict(start or shipped())
    out = []
    for i, row in enumerate(rows):
        others = rows[:i] + rows[i + 1 :]
        out.append(log_errors((row,), fit(others, base, sweeps=1))[0])
    return out


def main() -> None:
    rows = fit_rows()
    constants = fit(rows)
    print("fitted:", {k: round(v, 5) for k, v in constants.items()})
    print("shipped:", {k: round(v, 6) for k, v in shipped().items()})
    for row, err, loo in zip(rows, log_errors(rows, constants), leave_one_out(rows, constants)):
        print(
            f"{row.model:16} {row.system:6} {row.gpus:5} {row.precision:4} {row.release:9} "
            f"in-sample {math.exp(err) - 1:+7.1%}  left out {math.exp(loo) - 1:+7.1%}"
        )


if __name__ == "__main__":
    main()
