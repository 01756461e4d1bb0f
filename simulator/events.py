"""The event-level engine: one pipeline's schedule op by op, with each rank's network port a shared resource.

Every rank runs its forward (F) and backward (B) chunk ops in schedule order on its GPU. An op is its compute
(GEMMs, attention, TP/CP collectives) followed by its exposed EP all-to-all, which must hold the rank's network
port; stage-to-stage sends queue on the same port (FIFO), so a send waiting behind an all-to-all delays the
next stage. Symmetry reduction: the DP replicas run the same pipeline, so one pipeline stands for all;
perturbations (``whatif``) enter through the per-rank costs.

Schedules are static per-rank op orders: Megatron's for ``1f1b`` and ``interleaved``; for ``dualpipe`` the
eight-step order of DeepSeek's DualPipe (warm-up forwards of both directions, then forward/backward pairs of
opposite directions whose EP all-to-alls hide under each other's compute, then cool-down), written here from
its published description without the zero-bubble weight/input split (a backward includes its weight
gradient). Micro-batches 0..m/2-1 enter at rank 0, m/2..m-1 at rank p-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from simulator.costs import ChunkCost
from simulator.parallel import ParallelConfig


@dataclass
class Timeline:
    """Executed ops: ``(rank, kind, micro_batch, chunk, start_s, end_s)``; kind F, B or FB (DualPipe pair)."""

    ops: list[tuple] = field(default_factory=list)
    makespan: float = 0.0

    def busy(self, rank: int) -> float:
        return sum(e - s for r, _, _, _, s, e in self.ops if r == rank)


def static_order(par: ParallelConfig, rank: int) -> list[tuple[str, int, int]]:
    """``[(kind, micro_batch, local_chunk)]`` of ``rank`` for 1F1B / interleaved (Megatron's orders): interleaved
    forwards run micro-batches in groups of N contiguous ones through each local chunk in turn (Megatron's
    ``get_schedule_table``; the last group takes what is left), backwards the same table with the chunks
    reversed; ``ParallelConfig.warmup_passes`` forwards first, then one forward and one backward in turn."""
    m = par.micro_batches
    v = par.vpp if par.schedule == "interleaved" else 1
    table = _schedule_table(m, v, par.group_size) if v > 1 else tuple((k, 0) for k in range(m))
    total, warm = m * v, par.warmup_passes(rank)
    fwd = [("F", mb, j) for mb, j in table]
    bwd = [("B", mb, v - 1 - j) for mb, j in table]
    order = fwd[:warm]
    for i in range(total - warm):
        order += [fwd[warm + i], bwd[i]]
    return order + bwd[total - warm :]


def _schedule_table(m: int, v: int, n: int) -> tuple[tuple[int, int], ...]:
    """``(micro_batch, chunk)`` in forward order: groups of ``n`` micro-batches, each group through every chunk."""
    out = []
    for g in range(0, m, n):
        end = m if g + n >= m else g + n
        out += [(mb, j) for j in range(v) for mb in range(g, end)]
    return tuple(out)


def dualpipe_order(par: ParallelConfig, rank: int) -> list[list[tuple[str, int]]]:
    """DualPipe entries of ``rank``: each a list of ``(kind, phase)``; two items = one overlapped pair.

    Phase 0 is the direction in which this rank is stage ``min(rank, p-1-rank)``, phase 1 the other.
    """
    p, half = par.pp, par.micro_batches // 2
    hr, nh = min(rank, p - 1 - rank), p // 2
    out: list[list[tuple[str, int]]] = []
    out += [[("F", 0)]] * ((nh - hr - 1) * 2)
    out += [[("F", 0)], [("F", 1)]] * (hr + 1)
    out += [[("B", 1)], [("F", 1)]] * (nh - hr - 1)
    for i in range(half - p + hr + 1):
        out += [[("F", 0)], [("B", 1)]] if i == 0 and hr == nh - 1 else [[("F", 0), ("B", 1)]]
        out += [[("F", 1), ("B", 0)]]
    out += [[("B", 1)], [("F", 1), ("B", 0)]] * (nh - hr - 1)
    out += [[("B", 1)], [("B", 0)]] * (hr + 1)
    out += [[("B", 0)]] * (nh - hr - 1)
    return out


def _entries(par: ParallelConfig, rank: int) -> list[list[tuple[str, int, int, int]]]:
    """Op entries ``[(kind, direction, micro_batch, stage)]`` of ``rank`` in execution order."""
    p = par.pp
    if par.schedule != "dualpipe":
        return [[(k, 0, mb, rank + j * p)] for k, mb, j in static_order(par, rank)]
    half = par.micro_batches // 2
    second = rank >= p // 2
    count: dict = {}
    out = []
    for entry in dualpipe_order(par, rank):
        ops = []
        for kind, phase in entry:
            d = phase ^ int(second)
            n = count.get((kind, d), 0)
            count[(kind, d)] = n + 1
            ops.append((kind, d, n + (half if d else 0), rank if d == 0 else p - 1 - rank))
        out.append(ops)
    return out


def _locate(par: ParallelConfig, d: int, stage: int) -> tuple[int, int]:
    """(rank, local chunk) running ``stage`` of direction ``d``."""
    p = par.pp
    if par.schedule == "dualpipe":
        return (stage, 0) if d == 0 else (p - 1 - stage, 1)
    return stage % p, stage // p


def _deps(kind: str, d: int, mb: int, s: int, last: int):
    if kind == "F":
        return ("F", d, mb, s - 1) if s > 0 else None
    return ("B", d, mb, s + 1) if s < last else ("F", d, mb, s)


def _duration(entry, costs_r, par) -> tuple[float, float]:
    """(compute, exposed EP) seconds of an entry; a pair hides one op's all-to-all under the other's compute."""
    loc = [(k, costs_r[_locate(par, d, s)[1]]) for k, d, _, s in entry]
    if len(loc) == 1:
        k, c = loc[0]
        return (c.tf - c.fwd["ep"], c.fwd["ep"]) if k == "F" else (c.tb - c.bwd["ep"], c.bwd["ep"])
    comp = sum((c.tf - c.fwd["ep"]) if k == "F" else (c.tb - c.bwd["ep"]) for k, c in loc)
    ep = sum(c.ep_raw_fwd if k == "F" else c.ep_raw_bwd for k, c in loc)
    solo = max(
        ((c.tf - c.fwd["ep"] + c.ep_raw_fwd) if k == "F" else (c.tb - c.bwd["ep"] + c.ep_raw_bwd)) for k, c in loc
    )
    return max(comp, ep, solo), 0.0


def simulate_pipeline(par: ParallelConfig, costs: list[list[ChunkCost]]) -> Timeline:
    """Run one step's pipeline; ``costs[rank][local_chunk]`` from ``analytic.pipeline_costs``."""
    p = par.pp
    last = p * (par.vpp if par.schedule == "interleaved" else 1) - 1
    orders = [_entries(par, r) for r in range(p)]
    pos = [0] * p
    gpu_free, port_free = [0.0] * p, [0.0] * p
    arrive: dict = {}  # (kind, direction, mb, stage) -> time its output is on the consuming rank
    tl = Timeline()
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                entry = orders[r][pos[r]]
                deps = [_deps(k, d, mb, s, last) for k, d, mb, s in entry]
                if any(x is not None and x not in arrive for x in deps):
                    break
                ready = max([arrive[x] for x in deps if x is not None], default=0.0)
                comp, ep = _duration(entry, costs[r], par)
                start = max(gpu_free[r], ready)
                end = start + comp
                if ep > 0:  # the exposed all-to-all needs this rank's network port
                    end = max(end, port_free[r]) + ep
                    port_free[r] = end
                gpu_free[r] = end
                tl.ops.append((r, "".join(k for k, *_ in entry), entry[0][2], entry[0][3], start, end))
                for k, d, mb, s in entry:
                    nxt = s + 1 if k == "F" else s - 1
                    if 0 <= nxt <= last and _locate(par, d, nxt)[0] != r:
                        t0 = max(end, port_free[r])  # stage-to-stage send queues on the port (FIFO)
                        port_free[r] = arrive[(k, d, mb, s)] = t0 + costs[r][_locate(par, d, s)[1]].p2p
                    else:
                        arrive[(k, d, mb, s)] = end
                pos[r] += 1
                progressed = True
    if any(pos[r] < len(orders[r]) for r in range(p)):
        raise RuntimeError("pipeline schedule deadlocked (a dependency never arrives)")
    tl.makespan = max(e for *_, e in tl.ops)
    return tl
