"""The one fitted MoE constant per GPU type, fitted on calibration rows that the validation table never holds.

What is fitted: ``Efficiency.moe_copy_ns`` of the Hopper and Blackwell presets, the time per routed token copy
per MoE layer (forward + backward) that the first-principles terms (router/permute bytes at HBM bandwidth, grouped
GEMM FLOPs at the grouped-GEMM efficiency, EP all-to-all bytes over the links) leave unexplained. Nothing else of
the MoE model is fitted to published runs: ``grouped_gemm`` keeps the engineering estimate it had before any
published MoE row was read (Hopper 0.50, Blackwell 0.48), ``moe_layer_fixed_s`` and ``grouped_half_rows`` are 0
in the presets (``moonep simulate calibrate`` measures the first on a GPU).

On what: ``CANDIDATES``, the dropless MoE rows of the 25.11 NeMo Container tables (DGX-H100 and DGX-B200) of
https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html
(repository file ``docs/performance-summary-archive.md`` of NVIDIA-NeMo/Megatron-Bridge), section "25.11 NeMo
Container". The validation rows (``simulator.published.ROWS``) come from the 26.02 and 25.09 tables. Two rules,
applied by ``calibration_rows`` in code, choose the rows the fit uses; neither looks at a validation error:
- the recipe as the table gives it fits in memory in this simulator (otherwise the run used memory settings the
  table does not give, such as heavier recompute, and its time would be priced for another run);
- the recipe is not a validation row's recipe (same model, system, GPUs, precision, batch, sequence and layout
  measured in another release is a re-measurement of a validation row, not a held-out one).
Not listed: the 25.11 DGX-B200 DeepSeek-V3 row (trained with MTP, which is not modelled) and the 25.09
token-drop rows (token dropping is not modelled). The fit minimises the summed squared log error of tokens/s/GPU
over the chosen rows of one system (golden-section search over ``moe_copy_ns``; step time grows monotonically
with it).
"""

from __future__ import annotations

import math
from dataclasses import replace

from simulator.analytic import simulate
from simulator.hardware import HardwareSpec, load_hardware
from simulator.published import ARCHIVE, ROWS, Published
from simulator.validation import published_config

_A2511 = f"{ARCHIVE} (25.11 NeMo Container, System: DGX-{{}}, '{{}}')"


def _row(model, system, gpus, precision, gbs, mbs, layout, tokens, tflops, label, **kw) -> Published:
    """A 25.11 row; ``layout`` = (TP, PP, CP, VP, EP), sequence 4096 in every MoE row of that table."""
    tp, pp, cp, vp, ep = layout
    src = _A2511.format(system.upper(), label)
    return Published(model, system, gpus, precision, gbs, mbs, 4096, tp, pp, cp, vp, ep, tokens, tflops, src, **kw)


CANDIDATES = (
    _row("gpt-oss-120b", "h100", 64, "bf16", 512, 4, (1, 4, 1, 1, 8), 5630, 153, "GPT OSS 120B"),
    _row(
        "qwen3-30b-a3b", "h100", 16, "fp8", 512, 2, (1, 2, 1, 24, 8), 5275, 121, "Qwen3_30B_a3B", moe_a2a_overlap=True
    ),
    _row(
        "qwen3-235b-a22b",
        "h100",
        256,
        "fp8",
        2048,
        1,
        (2, 8, 1, 4, 32),
        1575,
        233,
        "Qwen3_235B_a22B",
        moe_a2a_overlap=True,
    ),
    _row("gpt-oss-120b", "b200", 64, "bf16", 512, 4, (1, 1, 1, 1, 8), 8213, 223, "GPT OSS 120B"),
    _row("qwen3-30b-a3b", "b200", 8, "fp8", 512, 1, (1, 1, 1, 1, 8), 9299, 214, "Qwen3_30B_a3B"),
    _row("qwen3-235b-a22b", "b200", 64, "fp8", 1024, 1, (1, 8, 1, 2, 8), 3269, 484, "Qwen3_235B_a22B"),
)
"""Dropless MoE rows of the 25.11 tables for the two preset GPU types (VP 1 there means no interleaving).
Settings the table does not give are read as for the validation rows (``simulator.published``), from the
25.11 release's recipe files (``scripts/performance/configs/qwen3/workload_base_configs.py`` at Megatron-Bridge
tag v0.2.0): ``moe_a2a_overlap`` for both H100 Qwen3 recipes; no flex dispatcher in any Qwen3 recipe there
(``classic``)."""


def recipe_key(row: Published) -> tuple:
    """What makes two rows the same recipe: model, system, GPUs, precision, batch, sequence, layout."""
    return (
        row.model,
        row.system,
        row.gpus,
        row.precision,
        row.gbs,
        row.mbs,
        row.seq,
        row.tp,
        row.pp,
        row.cp,
        row.vp,
        row.ep,
    )


def calibration_rows(system: str) -> tuple[list[Published], list[tuple[Published, str]]]:
    """(rows the fit uses, [(row, why it is left out)]) among ``CANDIDATES`` of ``system`` (see module doc)."""
    held_out = {recipe_key(r) for r in ROWS}
    used, left = [], []
    for row in (r for r in CANDIDATES if r.system == system):
        if recipe_key(row) in held_out:  # checked first: a validation recipe is never even priced here
            left.append((row, "same recipe as a validation row (a re-measurement, not held out)"))
            continue
        res = simulate(row.model, row.system, published_config(row), row.gpus)
        if res.feasible:
            used.append(row)
        else:
            left.append((row, f"recipe as given does not fit: {res.reason}"))
    return used, left


def with_copy_ns(system: str | HardwareSpec, copy_ns: float) -> HardwareSpec:
    """The preset with ``moe_copy_ns`` replaced."""
    hw = load_hardware(system)
    return replace(hw, efficiency=replace(hw.efficiency, moe_copy_ns=copy_ns))


def log_errors(rows: list[Published], copy_ns: float) -> list[float]:
    """``log(predicted / published)`` tokens/s/GPU of each row at ``copy_ns``."""
    out = []
    for row in rows:
        res = simulate(row.model, with_copy_ns(row.system, copy_ns), published_config(row), row.gpus)
        out.append(math.log(res.tokens_per_s_per_gpu / row.tokens_per_s_per_gpu))
    return out


def fit_copy_ns(rows: list[Published], hi: float = 2000.0, iters: int = 60) -> float:
    """``moe_copy_ns`` in [0, hi] minimising the summed squared log error over ``rows`` (all of one system).

    Golden-section search: the loss is unimodal because every row's predicted step time rises monotonically
    (and nearly linearly) with the per-copy time."""
    if not rows or len({r.system for r in rows}) != 1:
        raise ValueError("fit_copy_ns needs calibration rows of exactly one system")

    def loss(x: float) -> float:
        return sum(e * e for e in log_errors(rows, x))

    g = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = 0.0, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = loss(c), loss(d)
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = loss(d)
    return (a + b) / 2.0


def fitted_presets() -> dict[str, float]:
    """``{system: moe_copy_ns}`` fitted on each system's calibration rows (what ``hardware.py`` ships, rounded)."""
    return {system: fit_copy_ns(calibration_rows(system)[0]) for system in ("h100", "b200")}


def calibration_table() -> list[dict]:
    """Every candidate with its use, the shipped preset's prediction and error (the README's calibration table)."""
    out = []
    for system in ("h100", "b200"):
        used, left = calibration_rows(system)
        why = {id(r): w for r, w in left}
        for row in (r for r in CANDIDATES if r.system == system):
            res = simulate(row.model, row.system, published_config(row), row.gpus)
            out.append(
                {
                    "model": row.model,
                    "system": system,
                    "gpus": row.gpus,
                    "recipe": f"GBS {row.gbs} MBS {row.mbs} TP{row.tp} PP{row.pp} VP{row.vp} EP{row.ep}",
                    "published": row.tokens_per_s_per_gpu,
                    "predicted": res.tokens_per_s_per_gpu,
                    "error": res.tokens_per_s_per_gpu / row.tokens_per_s_per_gpu - 1.0,
                    "used": row in used,
                    "why_not": why.get(id(row), ""),
                }
            )
    return out
