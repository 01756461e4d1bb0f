"""Micro-batches in flight per model chunk at a pipeline rank's activation peak, from the schedule's own op order.

A rank's chunks need not be alike: DualPipe rank 0 runs stage 0 of one direction (the embedding and, in
DeepSeek-V3, the three dense layers) and stage p-1 of the other (the last MoE layers, the MTP module and the
logits); an interleaved layout may give its first and last chunks fewer layers. The schedules keep different
numbers of them alive: DualPipe rank r holds ``p - h`` micro-batches of its first-direction stage and ``h + 1`` of
the other (``h = min(r, p - 1 - r)``; ``p + 1`` in all, DualPipe's table), interleaved rank 0 holds most of its
first chunk. So the peak is ``max over the walk of sum(count[j] x bytes[j])``, not the total count times the
chunks' mean.

The walk: forwards add one micro-batch to their chunk, backwards free one. A DualPipe pair (a forward and a
backward of the two directions overlapped) counts the forward first, which gives the published ``p + 1``. With
Megatron's EP all-to-all overlap (combined 1F1B) a steady-state forward runs beside a backward that frees layer
by layer, so the pair is counted once done (``ParallelConfig.warmup_passes`` already holds the forward ahead).
For equal chunks this is ``inflight_chunks``' closed form; the candidates kept per layout are the count
vectors no other one of the walk dominates, so a rank's peak for any bytes per chunk is a max over a few.
"""

from __future__ import annotations

from functools import lru_cache

from simulator.events import dualpipe_order, static_order
from simulator.parallel import ParallelConfig

_CANDIDATES: dict[tuple, tuple[tuple[float, ...], ...]] = {}
_CACHE_LIMIT = 4096


def peak_inflight(par: ParallelConfig, rank: int, chunk_bytes: tuple[float, ...]) -> tuple[float, ...]:
    """Micro-batches alive per local chunk (``parallel.rank_chunks`` order) where ``sum(count x chunk_bytes)`` peaks
    on pipeline rank ``rank``; ``chunk_bytes`` is one micro-batch's activations of each local chunk."""
    candidates = inflight_candidates(par, rank)
    if len(candidates) == 1:
        return candidates[0]
    return max(candidates, key=lambda counts: sum(n * b for n, b in zip(counts, chunk_bytes)))


@lru_cache(maxsize=8192)
def inflight_candidates(par: ParallelConfig, rank: int) -> tuple[tuple[float, ...], ...]:
    """The undominated per-chunk count vectors of ``rank``'s walk (module docstring): closed forms for one chunk
    and for DualPipe (``walk_candidates`` is their twin, a test holds them equal); interleaved layouts walk,
    kept per layout (a search prices many configurations with the same schedule, micro-batches and rank)."""
    p, m = par.pp, par.micro_batches
    if par.chunks == 1:
        return ((inflight_chunks(par, rank),),)
    if par.schedule == "dualpipe":
        if not has_dualpipe_order(par):  # ``infeasible_reason`` says why; the total, split evenly
            half = inflight_chunks(par, rank) / 2
            return ((half, half),)
        h = min(rank, p - 1 - rank)  # rank holds p - h of its first-direction stage, h + 1 of the other
        return ((float(p - h), float(h + 1)) if rank < p // 2 else (float(h + 1), float(p - h)),)
    key = (par.schedule, m, p, par.chunks, par.group_size, par.warmup_passes(rank), par.moe_a2a_overlap, rank)
    hit = _CANDIDATES.get(key)
    if hit is None:
        if len(_CANDIDATES) >= _CACHE_LIMIT:
            _CANDIDATES.clear()
        hit = _CANDIDATES[key] = walk_candidates(par, rank)
    return hit


def inflight_chunks(par: ParallelConfig, rank: int) -> float:
    """Chunks' activations alive at the peak on pipeline rank ``rank`` (unit: one chunk, one micro-batch), all
    chunks together (the count where alike chunks peak)."""
    m, p, v = par.micro_batches, par.pp, par.vpp
    if par.schedule == "dualpipe":
        return float(min(m, p + 1))  # p + 1 micro-batches, each through one of the rank's two chunks
    # Megatron's warm-up (``ParallelConfig.warmup_passes``) plus the pass that peaks. With EP A2A overlap the
    # warm-up holds that pass already: combined 1F1B runs each forward beside a backward that frees layer by layer
    peak = 0 if par.moe_a2a_overlap else 1
    return float(min(m * (v if par.schedule == "interleaved" else 1), par.warmup_passes(rank) + peak))


def has_dualpipe_order(par: ParallelConfig) -> bool:
    """DualPipe's order exists: an even PP and an even number of micro-batches >= 2 x PP."""
    p, m = par.pp, par.micro_batches
    return not (p % 2 or m < 2 * p or m % 2)


def dualpipe_ops(par: ParallelConfig, rank: int) -> tuple[tuple[str, int, int], ...]:
    """DualPipe's ops of ``rank`` as ``static_order`` gives Megatron's, ``(kind, 0, local_chunk)``, in the order
    the walk counts them (a pair's forward first); the micro-batch is left out (0)."""
    return tuple((kind, 0, j) for step in _steps(par, rank) for kind, j in step)


def walk_candidates(par: ParallelConfig, rank: int) -> tuple[tuple[float, ...], ...]:
    """The undominated per-chunk count vectors of the walk of ``rank``'s op order (module docstring)."""
    return _undominated(_walk_counts(par, rank))


def _walk_counts(par: ParallelConfig, rank: int) -> list[tuple[float, ...]]:
    """Per-chunk counts after each step of the rank's op order (a step: one op, or one overlapped pair)."""
    counts = [0] * par.chunks
    seen = []
    for step in _steps(par, rank):
        for kind, j in step:
            if kind == "F":
                counts[j] += 1
                seen.append(tuple(counts))
            else:
                counts[j] -= 1
        seen.append(tuple(counts))
    return seen


def _steps(par: ParallelConfig, rank: int) -> list[list[tuple[str, int]]]:
    """The rank's ops as ``[(kind, local_chunk)]`` steps; a step whose ops run together as one is one list."""
    p = par.pp
    if par.schedule == "dualpipe":
        flip = int(rank >= p // 2)  # phase 0 is the direction where this rank is stage min(r, p-1-r)
        return [[(kind, phase ^ flip) for kind, phase in entry] for entry in dualpipe_order(par, rank)]
    order = [(kind, j) for kind, _, j in static_order(par, rank)]
    if not par.moe_a2a_overlap:
        return [[op] for op in order]
    warm = par.warmup_passes(rank)
    steady = len(order) - 2 * warm  # after the warm-up: forward, backward, forward, ...; then the cool-down
    steps = [[op] for op in order[:warm]]
    steps += [[order[i + 1], order[i]] for i in range(warm, warm + steady, 2)]  # the backward frees first
    return steps + [[op] for op in order[warm + steady :]]


def _undominated(vectors: list[tuple[float, ...]]) -> tuple[tuple[float, ...], ...]:
    """The vectors no other one is >= in every entry (a max of non-negative weights is always among them), in a
    fixed order: a tie between two of them resolves the same way in every run."""
    out: list[tuple[float, ...]] = []
    for v in sorted(set(vectors), key=lambda v: (sum(v), v), reverse=True):
        if not any(all(a >= b for a, b in zip(w, v)) for w in out):
            out.append(v)
    return tuple(out)
