"""``EPGeometry``: the sizes an expert-parallel group's buffers are built for, shared by ``Buffer``, ``MoE`` and
the adapters (keyword-only, checked once, compared as one object)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True)
class EPGeometry:
    """Static sizes of one EP group; every buffer shape on the data path follows from these and R."""

    S: int
    """token capacity per rank and call (a call may bring s <= S tokens)."""
    H: int
    """hidden size of the rows that move (the expert input width)."""
    K: int
    """routed experts per token (top-k)."""
    E: int
    """routed experts in the EP group (a multiple of its rank count)."""
    token_padding: int = 1
    """each non-empty expert segment is padded to a multiple of this many rows (the grouped-GEMM tile)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f.name} must be a positive int, got {v!r}")


__all__ = ["EPGeometry"]
