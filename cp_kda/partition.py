"""Which sequences each rank holds, and which ranks it must hear from: pure bookkeeping, no tensors moved.

Rank r holds global tokens ``[r*T_local, (r+1)*T_local)``. With packed sequences (global ``cu_seqlens``,
identical on every rank) a rank sees local sub-sequences; only its **first** may have started on an earlier
rank (it receives a state) and only its **last** may continue onto later ranks (it sends a state). Without
``cu_seqlens`` every batch row is one sequence spanning all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RankPlan:
    """One rank's view of the packed sequence (all positions in tokens).

    Attributes:
        rank, world_size: this rank and the group size.
        start, length: global offset and number (T_local) of this rank's tokens.
        local_bounds: local cu_seqlens ``[n_local+1]`` (0 .. length), or None for dense batches.
        seq_ids: global index of each local sub-sequence (``range(B)`` entries are not listed for dense input).
        first_from: rank where the first local sequence began, if that is an earlier rank; else None.
        last_to: last rank holding the last local sequence, if that is a later rank; else None.
        first_end: local end of the first local sequence.
        last_start: local start of the last local sequence.
        first_offset: tokens of the first local sequence that lie before ``start`` (0 if it starts here).
    """

    rank: int
    world_size: int
    start: int
    length: int
    local_bounds: tuple[int, ...] | None
    seq_ids: tuple[int, ...]
    first_from: int | None
    last_to: int | None
    first_end: int
    last_start: int
    first_offset: int

    @property
    def dense(self) -> bool:
        return self.local_bounds is None

    def halo(self, width: int) -> int:
        """How many of the ``width`` tokens before ``start`` belong to the first local sequence."""
        return min(width, self.first_offset)


def plan_rank(rank: int, world_size: int, length: int, bounds: list[int] | None) -> RankPlan:
    """Plan for ``rank`` given T_local = ``length`` and the global boundaries ``bounds`` (or None).

    Raises ValueError (naming ``cu_seqlens``) when the boundaries do not cover ``world_size * length`` tokens.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size, got {rank} of {world_size}")
    if length < 1:
        raise ValueError(f"q: each rank needs at least one token, got T_local={length}")
    start, end = rank * length, (rank + 1) * length
    if bounds is None:
        return RankPlan(
            rank,
            world_size,
            start,
            length,
            None,
            (),
            0 if rank > 0 else None,
            world_size - 1 if rank < world_size - 1 else None,
            length,
            0,
            start,
        )
    total = world_size * length
    if bounds[-1] != total:
        raise ValueError(f"cu_seqlens: must end at the global T = world_size * T_local = {total}, ends at {bounds[-1]}")
    first = max(i for i in range(len(bounds) - 1) if bounds[i] <= start)
    last = max(i for i in range(len(bounds) - 1) if bounds[i] <= end - 1)
    local = (0, *(b - start for b in bounds[first + 1 : last + 1]), length)
    seq_start, seq_end = bounds[first], bounds[last + 1]
    return RankPlan(
        rank,
        world_size,
        start,
        length,
        local,
        tuple(range(first, last + 1)),
        first_from=seq_start // length if seq_start < start else None,
        last_to=(seq_end - 1) // length if seq_end > end else None,
        first_end=min(bounds[first + 1], end) - start,
        last_start=max(bounds[last], start) - start,
        first_offset=start - seq_start,
    )


def plan_ranks(world_size: int, length: int, bounds: list[int] | None) -> list[RankPlan]:
    """Plans of all ranks (every rank can compute all of them from the same global boundaries)."""
    return [plan_rank(r, world_size, length, bounds) for r in range(world_size)]
