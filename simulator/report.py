"""Human tables and plots (matplotlib object API, Agg): timeline, memory bar, step time vs maxvio."""

from __future__ import annotations

import os
from dataclasses import replace

from moonep_base import write_json
from simulator.analytic import SimResult, pipeline_costs, simulate
from simulator.events import simulate_pipeline
from simulator.hardware import load_hardware
from simulator.network import ClusterSpec, cluster_tiers
from simulator.parallel import ParallelConfig
from simulator.specs import load_model


def format_result(res: SimResult | dict) -> str:
    """The ``moonep simulate run`` table."""
    d = res.to_dict() if isinstance(res, SimResult) else res
    p = d["parallel"]
    lines = [f"model {d['model']}  hardware {d['hardware']}  GPUs {d['gpus']}  engine {d['engine']}"]
    if p:
        lines.append(
            "  ".join(
                f"{k} {p[k]}"
                for k in (
                    "tp",
                    "pp",
                    "vpp",
                    "ep",
                    "cp",
                    "dp",
                    "micro_batch",
                    "seq_len",
                    "recompute",
                    "schedule",
                    "dispatcher",
                    "maxvio",
                    "precision",
                )
            )
        )
    if not d["feasible"]:
        lines.append(f"INFEASIBLE: {d['reason']}")
        if d["step_time_s"] != d["step_time_s"]:  # NaN: nothing was timed
            return "\n".join(lines)
    lines += [
        f"{'step time':<28}{d['step_time_s']:>12.3f} s",
        f"{'tokens/s/GPU':<28}{d['tokens_per_s_per_gpu']:>12.1f}",
        f"{'model TFLOP/s/GPU':<28}{d['tflops_per_gpu']:>12.1f} (full-square attention)",
        f"{'MFU (bf16 peak)':<28}{d['mfu']:>12.1%} (full-square attention)",
        *_causal_lines(d),
        f"{'memory/GPU (peak rank)':<28}{d['memory_gib_per_gpu']:>12.1f} GiB (rank {d['peak_memory_rank']})",
        f"{'GPU-hours per 1T tokens':<28}{d['gpu_hours_per_trillion_tokens']:>12.0f}",
        f"{'cost per 1T tokens':<28}{d['cost_usd_per_trillion_tokens']:>12,.0f} USD",
        "",
        f"{'time breakdown':<28}{'seconds':>12}{'share':>8}",
    ]
    step = d["step_time_s"]
    for k, v in d["breakdown"].items():
        if v:
            lines.append(f"  {k:<26}{v:>12.3f}{v / step:>8.1%}")
    ov = d.get("ep_overlap") or {}
    if ov.get("raw_s"):
        lines.append(
            f"  {'ep overlapped':<26}{ov['overlapped_fraction']:>12.1%} of {ov['raw_s']:.3f} s ({ov['model']})"
        )
    lines.append(f"{'memory breakdown':<28}{'GiB':>12}")
    for k, v in d["memory_breakdown_gib"].items():
        if v:
            lines.append(f"  {k:<26}{v:>12.2f}")
    return "\n".join(lines)


def _causal_lines(d: dict) -> list[str]:
    """Megatron's causal FLOP count (half the query-key pairs), labelled, when the result carries it."""
    c = (d.get("flops") or {}).get("causal")
    if not c:
        return []
    return [
        f"{'model TFLOP/s/GPU':<28}{c['tflops_per_gpu']:>12.1f} (causal attention, Megatron's count)",
        f"{'MFU (bf16 peak)':<28}{c['mfu']:>12.1%} (causal attention)",
    ]


def format_search(report: dict) -> str:
    """The ``moonep simulate search`` ranked table."""
    head = (
        f"{report['model']} on {report['gpus']} x {report['hardware']}: {report['evaluated']} configs in "
        f"{report['seconds']:.1f} s ({report['configs_per_s']:.0f}/s), {report['feasible']} feasible"
    )
    cols = (
        f"{'#':>3} {'tp':>3} {'pp':>3} {'vpp':>3} {'cp':>3} {'ep':>4} {'dp':>5} {'mb':>3} {'recompute':<14}"
        f"{'schedule':<12}{'step s':>9}{'tok/s/GPU':>11}{'MFU':>7}{'GiB':>7}{'event s':>9}"
    )
    lines = [head, cols]
    for i, r in enumerate(report["results"], 1):
        p = r["parallel"]
        ev = r.get("event_step_time_s")
        lines.append(
            f"{i:>3} {p['tp']:>3} {p['pp']:>3} {p['vpp']:>3} {p['cp']:>3} {p['ep']:>4} {p['dp']:>5} "
            f"{p['micro_batch']:>3} {p['recompute']:<14}{p['schedule']:<12}{r['step_time_s']:>9.2f}"
            f"{r['tokens_per_s_per_gpu']:>11.0f}{r['mfu']:>7.1%}{r['memory_gib_per_gpu']:>7.1f}"
            f"{ev if ev is not None else float('nan'):>9.2f}"
        )
    if report["infeasible_reasons"]:
        lines.append("infeasible: " + "; ".join(f"{k} x{v}" for k, v in report["infeasible_reasons"].items()))
    return "\n".join(lines)


def _figure(w: float, h: float):
    from matplotlib.figure import Figure  # heavy: matplotlib (~0.4 s), only when plotting

    return Figure(figsize=(w, h), layout="constrained")


def plot_timeline(model, hardware, par: ParallelConfig, gpus: int, path: str, cluster=None) -> str:
    """One pipeline's event-level schedule: a row per pipeline rank, forward blue, backward orange.

    The ops also go to ``<path>.json`` (``[rank, kind, micro_batch, stage, start_s, end_s]`` rows).
    """
    spec, hw = load_model(model), load_hardware(hardware)
    tiers = cluster_tiers(gpus, hw, cluster or ClusterSpec())
    tl = simulate_pipeline(par, pipeline_costs(spec, hw, par, tiers))
    write_json(os.path.splitext(path)[0] + ".json", {"makespan_s": tl.makespan, "ops": [list(o) for o in tl.ops]})
    fig = _figure(12, 0.35 * par.pp + 1.5)
    ax = fig.add_subplot()
    colors = {"F": "tab:blue", "B": "tab:orange", "FB": "tab:purple", "BF": "tab:purple"}
    for r, kind, _mb, _, s, e in tl.ops:
        ax.barh(r, e - s, left=s, color=colors.get(kind, "gray"), edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(par.pp))
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_ylabel("pipeline rank")
    ax.set_title(
        f"{spec.name} {par.schedule}: pp {par.pp}, {par.micro_batches} micro-batches "
        f"(blue F, orange B, purple F&B pair)"
    )
    fig.savefig(path, dpi=110)
    return path


def plot_memory(res: SimResult, path: str) -> str:
    """Stacked bar of the peak rank's memory against the device size."""
    fig = _figure(4.5, 5)
    ax = fig.add_subplot()
    bottom = 0.0
    for k, v in res.memory_breakdown_gib.items():
        if v:
            ax.bar(0, v, bottom=bottom, label=f"{k} {v:.1f}")
            bottom += v
    ax.set_xticks([])
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{res.model}: {res.memory_gib_per_gpu:.1f} GiB on rank {res.peak_memory_rank}")
    ax.legend(fontsize=8, loc="upper right")
    fig.savefig(path, dpi=110)
    return path


def maxvio_sweep(
    model, hardware, par: ParallelConfig, gpus: int, values=(0.0, 0.1, 0.2, 0.4, 0.8, 1.6), cluster=None
) -> dict:
    """Step time of both dispatchers over routing skew ``maxvio`` (JSON next to the plot)."""
    most = load_model(model).max_maxvio(par.ep)
    values = [v for v in values if v <= most]  # past it no routing exists
    out = {"maxvio": list(values)}
    for disp in ("moonep", "classic"):
        out[disp] = [
            simulate(model, hardware, replace(par, dispatcher=disp, maxvio=v), gpus, cluster).step_time_s
            for v in values
        ]
    return out


def plot_maxvio(sweep: dict, path: str, title: str = "") -> str:
    fig = _figure(6, 4)
    ax = fig.add_subplot()
    for disp in ("moonep", "classic"):
        ax.plot(sweep["maxvio"], sweep[disp], marker="o", label=disp)
    ax.set_xlabel("maxvio (busiest EP rank load / mean - 1)")
    ax.set_ylabel("step time (s)")
    ax.set_title(title or "step time vs routing skew")
    ax.legend()
    fig.savefig(path, dpi=110)
    return path


def write_plots(model, hardware, par: ParallelConfig, gpus: int, res: SimResult, folder: str, cluster=None) -> dict:
    """Timeline, memory bar and maxvio sweep (PNG + JSON) into ``folder``; returns the paths."""
    os.makedirs(folder, exist_ok=True)
    paths = {
        "timeline": plot_timeline(model, hardware, par, gpus, os.path.join(folder, "timeline.png"), cluster),
        "memory": plot_memory(res, os.path.join(folder, "memory.png")),
    }
    if load_model(model).is_moe:
        sweep = maxvio_sweep(model, hardware, par, gpus, cluster=cluster)
        write_json(os.path.join(folder, "maxvio.json"), sweep)
        paths["maxvio"] = plot_maxvio(sweep, os.path.join(folder, "maxvio.png"), f"{res.model} on {gpus} GPUs")
    return paths
