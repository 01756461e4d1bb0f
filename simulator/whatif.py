"""What-if: per-rank compute slowdowns and per-link degradations in, step-time impact out.

The straggler tools call ``whatif(...)`` with what they measured (``rank_slowdown={rank: 1.3}``: that GPU's
kernels take 1.3 x; ``links=[{"rank": 5, "tier": "nic", "factor": 0.5}]``: that GPU's NIC runs at half speed;
``{"leaf": 2, "factor": 0.5}``: leaf 2's spine uplinks at half capacity) and get back the predicted step time,
the slowdown against the healthy cluster, and each perturbation's own slowdown (attribution).

Coupling rule (why the max): a pipeline stage's ranks meet in TP/CP collectives every layer, and with EP > 1
the EP all-to-all couples the DP replicas of a stage too, so a stage runs at the pace of its slowest member;
with EP = 1 the replicas only meet at the gradient reduction, so each replica is simulated and the slowest
wins. Global ranks are numbered TP fastest, then CP, DP, PP (``network`` module).
"""

from __future__ import annotations

import math
from numbers import Integral, Real

from simulator.analytic import Perturbation, simulate
from simulator.hardware import load_hardware
from simulator.network import ClusterSpec
from simulator.parallel import ParallelConfig

TIERS = {"nvlink": 0, "nic": 1, "spine": 2}


def _locate(par: ParallelConfig, rank: int) -> tuple[int, int]:
    """(pipeline stage, DP replica) of global ``rank``."""
    per_stage = par.tp * par.cp * par.dp
    return rank // per_stage, (rank % per_stage) // (par.tp * par.cp)


def _index(value, what: str, stop: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or not 0 <= value < stop:
        raise ValueError(f"{what} must be an integer in [0, {stop}), got {value!r}")
    return value


def check_slowdown(rank: int, factor: float, gpus: int) -> None:
    """A compute slowdown: ``rank`` a GPU of the job, ``factor`` a finite number >= 1; ``ValueError`` otherwise."""
    _index(rank, "rank", gpus)
    if isinstance(factor, bool) or not isinstance(factor, Real) or not (math.isfinite(factor) and factor >= 1):
        raise ValueError(f"slowdown factor must be a finite number >= 1, got {factor!r}")


def check_link(link: dict, par: ParallelConfig, gpus_per_node: int, cluster: ClusterSpec) -> None:
    """A link degradation: a GPU's ``rank`` and ``tier`` (nvlink, nic, spine) or a ``leaf`` index (with an optional
    ``rail``) of the job's cluster, and a bandwidth ``factor`` in (0, 1]; ``ValueError`` naming the key otherwise."""
    if not isinstance(link, dict) or ("rank" in link) == ("leaf" in link):
        raise ValueError(f"a link names one of 'rank' or 'leaf', got {link!r}")
    unknown = sorted(set(link) - {"rank", "tier", "leaf", "rail", "factor"})
    if unknown:
        raise ValueError(f"unknown link key(s) {unknown}")
    factor = link.get("factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, Real) or not 0 < factor <= 1:
        raise ValueError(f"link factor must be a number in (0, 1], got {factor!r}")
    if "rank" in link:
        _index(link["rank"], "link rank", par.gpus)
        if link.get("tier", "nic") not in TIERS:
            raise ValueError(f"link tier must be one of {', '.join(TIERS)}, got {link['tier']!r}")
        return
    span = gpus_per_node * cluster.nodes_per_leaf
    _index(link["leaf"], "leaf", -(-par.gpus // span))
    if "rail" in link:
        _index(link["rail"], "rail", gpus_per_node)


def _link_ranks(link: dict, par: ParallelConfig, gpus_per_node: int, cluster: ClusterSpec) -> list[int]:
    if "rank" in link:
        return [int(link["rank"])]
    leaf = int(link["leaf"])
    span = gpus_per_node * cluster.nodes_per_leaf
    ranks = range(leaf * span, min(par.gpus, (leaf + 1) * span))
    if cluster.topology == "rail" and "rail" in link:
        return [r for r in ranks if r % gpus_per_node == int(link["rail"])]
    return list(ranks)


def perturbations(
    par: ParallelConfig, rank_slowdown: dict[int, float], links: list[dict], gpus_per_node: int, cluster: ClusterSpec
) -> dict[int | None, Perturbation]:
    """Per-replica (None = all replicas coupled) per-stage perturbations."""
    coupled = par.ep > 1
    out: dict[int | None, Perturbation] = {}

    def get(replica):
        key = None if coupled else replica
        if key not in out:
            out[key] = Perturbation(compute=[1.0] * par.pp, comm=[(1.0, 1.0, 1.0)] * par.pp)
        return out[key]

    for rank, factor in rank_slowdown.items():
        try:
            check_slowdown(rank, factor, par.gpus)
        except ValueError as exc:
            raise ValueError(f"rank_slowdown: {exc}") from None
        stage, replica = _locate(par, int(rank))
        pert = get(replica)
        pert.compute[stage] = max(pert.compute[stage], float(factor))
    for link in links:
        check_link(link, par, gpus_per_node, cluster)
        factor = float(link.get("factor", 1.0))
        tiers = [2] if "leaf" in link else [TIERS[link.get("tier", "nic")]]
        for rank in _link_ranks(link, par, gpus_per_node, cluster):
            stage, replica = _locate(par, rank)
            pert = get(replica)
            cs = list(pert.comm[stage])
            for t in tiers:
                cs[t] = min(cs[t], factor)
            pert.comm[stage] = tuple(cs)
    return out


def whatif(
    model,
    hardware,
    par: ParallelConfig,
    gpus: int | None = None,
    cluster: ClusterSpec | None = None,
    *,
    rank_slowdown: dict[int, float] | None = None,
    links: list[dict] | None = None,
    engine: str = "event",
    attribute: bool = True,
) -> dict:
    """Step time with the perturbations, the healthy baseline, the slowdown and per-perturbation attribution."""
    hw = load_hardware(hardware)
    cluster = cluster or ClusterSpec()
    rank_slowdown, links = dict(rank_slowdown or {}), list(links or [])
    gpus = par.gpus if gpus is None else gpus
    base = simulate(model, hw, par, gpus, cluster, engine=engine)
    out = {"feasible": base.feasible, "reason": base.reason, "baseline_step_s": base.step_time_s}
    if not base.feasible and not base.reason.startswith("out of memory"):
        return out
    try:
        step = _perturbed(model, hw, par, gpus, cluster, rank_slowdown, links, engine)
    except (ValueError, KeyError) as exc:
        return {**out, "feasible": False, "reason": f"bad what-if input: {exc}"}
    out.update(step_s=step, slowdown=step / base.step_time_s)
    if attribute:
        parts = [{"rank": r, "compute_factor": f} for r, f in rank_slowdown.items()] + [dict(x) for x in links]
        for item in parts:
            if "compute_factor" in item:
                alone = _perturbed(model, hw, par, gpus, cluster, {item["rank"]: item["compute_factor"]}, [], engine)
            else:
                alone = _perturbed(model, hw, par, gpus, cluster, {}, [item], engine)
            item["slowdown_alone"] = alone / base.step_time_s
        out["attribution"] = sorted(parts, key=lambda x: -x["slowdown_alone"])
    return out


def _perturbed(model, hw, par, gpus, cluster, rank_slowdown, links, engine) -> float:
    perts = perturbations(par, rank_slowdown, links, hw.gpus_per_node, cluster)
    if not perts:
        return simulate(model, hw, par, gpus, cluster, engine=engine).step_time_s
    return max(simulate(model, hw, par, gpus, cluster, engine=engine, pert=p).step_time_s for p in perts.values())
