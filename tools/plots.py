"""Pictures of a diagnosis: the rank x step timeline, the compute heatmap and the wait matrix (matplotlib, Agg).

Every picture is drawn from ``Tables``, so it looks the same whatever format the trace came in.
"""

from __future__ import annotations

import os

import numpy as np

from tools.analysis import Tables

PHASE_COLOURS = {"compute": "#4c72b0", "data loading": "#dd8452", "idle": "#c44e52", "collectives / other": "#8c8c8c"}


def _figure(size):
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy: matplotlib (~0.4 s), only when plotting
    from matplotlib.figure import Figure  # heavy: matplotlib, as above

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    return fig


def phase_shares(t: Tables) -> dict[str, np.ndarray]:
    """``{phase: [R, S] seconds}``: compute, data loading, idle, and the rest of the step (collectives, waits)."""
    step = np.broadcast_to(t.step_time_s, t.compute_s.shape)
    idle = t.idle_s if t.idle_s is not None else np.zeros_like(t.compute_s)
    parts = {
        "compute": np.nan_to_num(t.compute_s),
        "data loading": np.nan_to_num(t.data_s),
        "idle": np.nan_to_num(idle),
    }
    parts["collectives / other"] = np.clip(np.nan_to_num(step) - sum(parts.values()), 0.0, None)
    return parts


def timeline(t: Tables, path: str, findings: list[dict] | None = None) -> str:
    """Ranks as rows, steps as columns; each cell splits its step into phase colours (as shares of the step's
    wall time), the blamed ranks are outlined from the onset on and each onset is a dashed line."""
    parts = phase_shares(t)
    total = np.maximum(sum(parts.values()), 1e-12)
    fig = _figure((max(6.0, 0.12 * len(t.steps) + 3), 1.2 + 0.5 * max(1, len(t.ranks))))
    ax = fig.add_subplot()
    for i in range(len(t.ranks)):
        left = np.arange(len(t.steps), dtype=float)
        for name, seconds in parts.items():
            width = seconds[i] / total[i]
            ax.barh(i, width, left=left, height=0.8, color=PHASE_COLOURS[name], label=name if i == 0 else None)
            left = left + width
    for f in findings or []:
        if f.get("onset_step") is None or f["onset_step"] not in t.steps:
            continue
        j = t.steps.index(f["onset_step"])
        ax.axvline(j, color="black", linestyle="--", linewidth=1)
        ax.text(j + 0.15, -0.7, f"{f['kind']} from step {f['onset_step']}", fontsize=8, va="bottom")
        for r in f["ranks"]:
            if r in t.ranks:
                i = t.ranks.index(r)
                ax.add_patch(_outline(j, i, len(t.steps) - j))
    ax.set_yticks(range(len(t.ranks)), [str(r) for r in t.ranks])
    ticks = list(range(0, len(t.steps), max(1, len(t.steps) // 15)))
    ax.set_xticks([k + 0.5 for k in ticks], [str(t.steps[k]) for k in ticks])
    ax.set_xlim(0, max(1, len(t.steps)))
    ax.set_ylim(len(t.ranks) - 0.4, -1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("rank")
    ax.set_title("where each rank's step went (blamed ranks outlined from the onset)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def _outline(x: float, row: int, width: float):
    from matplotlib.patches import Rectangle  # heavy: matplotlib, as above

    return Rectangle((x, row - 0.45), width, 0.9, fill=False, edgecolor="red", linewidth=2)


def plot(t: Tables, out_dir: str | os.PathLike, findings: list[dict] | None = None) -> list[str]:
    """``timeline.png`` (``timeline``), ``rank_step_heatmap.png`` (normalised compute over the step median)
    and ``wait_matrix.png``; ``findings`` (report JSON entries) mark the blamed ranks and onsets."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [timeline(t, os.path.join(out_dir, "timeline.png"), findings)]
    with np.errstate(all="ignore"):
        ratio = t.norm_compute_s / np.nanmedian(t.norm_compute_s, axis=0)
    fig = _figure((max(6.0, 0.08 * len(t.steps) + 3), 1.0 + 0.4 * max(1, len(t.ranks))))
    ax = fig.add_subplot()
    im = ax.imshow(
        ratio,
        aspect="auto",
        cmap="viridis",
        interpolation="nearest",
        vmin=0.8,
        vmax=max(1.3, float(np.nanmax(ratio)) if np.isfinite(ratio).any() else 1.3),
        extent=(t.steps[0] - 0.5, t.steps[-1] + 0.5, len(t.ranks) - 0.5, -0.5) if t.steps else None,
    )
    ax.set_yticks(range(len(t.ranks)), [str(r) for r in t.ranks])
    ax.set_xlabel("step")
    ax.set_ylabel("rank")
    ax.set_title("compute / step median (routing load factored out)")
    fig.colorbar(im, ax=ax)
    paths.append(os.path.join(out_dir, "rank_step_heatmap.png"))
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")

    fig = _figure((5, 4))
    ax = fig.add_subplot()
    im = ax.imshow(t.wait_matrix_s, cmap="magma", interpolation="nearest")
    ax.set_xticks(range(len(t.ranks)), [str(r) for r in t.ranks])
    ax.set_yticks(range(len(t.ranks)), [str(r) for r in t.ranks])
    ax.set_xlabel("waited for (last arriver)")
    ax.set_ylabel("waiting rank")
    ax.set_title("wait matrix (s)")
    fig.colorbar(im, ax=ax)
    paths.append(os.path.join(out_dir, "wait_matrix.png"))
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    return paths
