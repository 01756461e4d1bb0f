"""Run-folder plots from ``metrics.jsonl``: loss (train + validation), expert balance (max violation per layer)
and what MoonEP buys: routed rows on the busiest EP rank per step, ours vs the classic dispatcher on the same counts.

Matplotlib object API with the Agg canvas: no pyplot state, no display needed.
"""

from __future__ import annotations

import json
import os


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_plots(run_dir: str) -> list[str]:
    """Write ``loss.png``, ``balance.png`` and ``rows.png`` into run_dir; returns their paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy: only when plots are written
    from matplotlib.figure import Figure  # heavy: matplotlib

    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    if not rows:
        return []
    steps = [r["step"] for r in rows]
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.plot(steps, [r["loss"] for r in rows], label="train", lw=1)
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.legend()
    ax.grid(alpha=0.3)
    loss_png = os.path.join(run_dir, "loss.png")
    FigureCanvasAgg(fig).print_png(loss_png)

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    per_layer = [r.get("max_violation_per_layer", []) for r in rows]
    for j in range(max((len(p) for p in per_layer), default=0)):
        ax.plot(steps, [p[j] if j < len(p) else None for p in per_layer], lw=0.8, label=f"MoE layer {j + 1}")
    ax.set_xlabel("step")
    ax.set_ylabel("max violation (max load / mean - 1)")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    balance_png = os.path.join(run_dir, "balance.png")
    FigureCanvasAgg(fig).print_png(balance_png)
    return [loss_png, balance_png] + _rows_plot(rows, steps, run_dir, Figure, FigureCanvasAgg)


def _rows_plot(rows: list[dict], steps: list[int], run_dir: str, Figure, FigureCanvasAgg) -> list[str]:
    """``rows.png``: the busiest EP rank's routed rows per step, worst MoE layer: MoonEP's balanced plan vs
    what the classic dispatcher computes from the same counts (each rank its own experts). [] without EP."""
    ours = [max(r.get("rows_moonep_per_layer") or [0]) for r in rows]
    classic = [max(r.get("rows_classic_per_layer") or [0]) for r in rows]
    if not any(classic):
        return []
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.plot(steps, classic, lw=0.8, label="classic all-to-all (hottest home rank)")
    ax.plot(steps, ours, lw=1.2, label="MoonEP (balanced plan)")
    ax.set_xlabel("step")
    ax.set_ylabel("routed rows on the busiest rank (worst MoE layer)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    path = os.path.join(run_dir, "rows.png")
    FigureCanvasAgg(fig).print_png(path)
    return [path]


__all__ = ["write_plots", "read_metrics"]
