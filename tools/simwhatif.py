"""What-if through the simulator, when the job's model and parallel layout are known.

The trace-only estimate (``Finding.what_if_step_time_s``) subtracts the seconds the cause added in the measured
steps. When the model config is known, ``simulated_what_if`` asks ``simulator.whatif`` instead: the measured
compute ratio of a ``slow_compute`` rank becomes ``rank_slowdown={rank: ratio}``, a ``slow_link`` pair becomes a
NIC bandwidth factor on both ends (``reference / (reference + excess)``: the measured transfer slowdown), and
the simulator's predicted slowdown scales the measured step time back to the healthy one. Causes the simulator
does not model (data loading, routing, stage partitioning) return ``None``.
"""

from __future__ import annotations

from simulator import whatif


def simulator_inputs(finding: dict) -> tuple[dict[int, float], list[dict]] | None:
    """``(rank_slowdown, links)`` for ``simulator.whatif`` from one finding's JSON, or None if not modelled."""
    ev = finding.get("evidence", {})
    if finding["kind"] == "slow_compute" and ev.get("ratio", 0) >= 1.0:
        return {int(finding["ranks"][0]): float(ev["ratio"])}, []
    if finding["kind"] == "slow_link" and ev.get("reference_s") and ev.get("excess_s"):
        factor = ev["reference_s"] / (ev["reference_s"] + ev["excess_s"])
        return {}, [{"rank": int(r), "tier": "nic", "factor": max(1e-3, factor)} for r in finding["ranks"][:2]]
    return None


def simulated_what_if(
    finding: dict,
    model,
    hardware,
    par,
    gpus: int | None = None,
    cluster=None,
    *,
    measured_step_s: float | None = None,
    engine: str = "analytic",
) -> dict | None:
    """``{"slowdown", "step_s", "baseline_step_s", "what_if_step_time_s"}`` or None when not modelled.

    ``what_if_step_time_s`` is ``measured_step_s / slowdown`` when the measured step time is given (the
    simulator's relative impact applied to the real run), else the simulator's healthy step time.
    """
    inputs = simulator_inputs(finding)
    if inputs is None:
        return None
    rank_slowdown, links = inputs
    res = whatif(
        model, hardware, par, gpus, cluster, rank_slowdown=rank_slowdown, links=links, engine=engine, attribute=False
    )
    if "slowdown" not in res:
        return {
            "slowdown": None,
            "step_s": None,
            "baseline_step_s": res.get("baseline_step_s"),
            "what_if_step_time_s": None,
            "reason": res.get("reason"),
        }
    healthy = measured_step_s / res["slowdown"] if measured_step_s is not None else res["baseline_step_s"]
    return {
        "slowdown": res["slowdown"],
        "step_s": res["step_s"],
        "baseline_step_s": res["baseline_step_s"],
        "what_if_step_time_s": healthy,
    }
