"""The error every layer of ``collectives`` raises when a collective fails (the bottom module: imports nothing of
the package, so the facade, the header agreement and the backends can all raise it without an import cycle)."""

from __future__ import annotations

from collections.abc import Sequence


class CollectiveError(RuntimeError):
    """A collective failed on this rank: it timed out, or a peer died or reported an error.

    Args:
        message: what happened, naming the op and this rank.
        op: the collective that failed (``""`` when unknown).
        failed_ranks: global ranks known to have failed or never arrived.
    """

    def __init__(self, message: str, *, op: str = "", failed_ranks: Sequence[int] = ()):
        super().__init__(message)
        self.op = op
        self.failed_ranks = tuple(failed_ranks)
