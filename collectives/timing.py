"""Timing of the ``Communicator``'s calls: timeouts, injected link delays and trace records.

Every primitive a public call reaches runs through ``timed``: with this call's timeout (the communicator's
default unless the caller gave one), after the injected link delay of the peers it sends to (fault injection:
``Communicator.inject_link_delay``, ``$MOONEP_INJECT_LINK_DELAY``), and recorded in the per-rank trace
(``collectives.trace``) when tracing is on. A started collective (``all_to_all_single_start``) is recorded when
its ``wait()`` finishes it (``traced_finish``). With tracing off and no delay injected the cost is one
``is None`` test per call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from collectives.core import CommunicatorCore


def call_timeout(comm: CommunicatorCore, timeout: float | None) -> float:
    """Seconds this call may take: ``timeout`` when given, else the communicator's default."""
    return comm.timeout if timeout is None else float(timeout)


def link_delay(comm: CommunicatorCore, peers: Iterable[int]) -> float:
    """Seconds the slowest injected link from this rank to ``peers`` (group ranks) adds; 0.0 when none."""
    if not comm.link_delays:
        return 0.0
    return max((comm.link_delays.get((comm.global_rank, comm.group_ranks[j]), 0.0) for j in peers), default=0.0)


def timed(
    comm: CommunicatorCore,
    op: str,
    nbytes: int,
    fn: Callable[..., Any],
    *args: Any,
    delay: float = 0.0,
    peer: int | None = None,
) -> Any:
    """Run a backend primitive with this call's timeout, recording it in the trace when tracing is on.

    Args:
        comm: the communicator the call runs on.
        op: the op's name in the trace (``all_to_all_single``, ``validate``, ...).
        nbytes: payload bytes this rank contributes, for the trace.
        fn: the primitive; called as ``fn(*args[:-1], timeout)``.
        *args: the primitive's arguments, the last one this call's timeout (None: the communicator's).
        delay: injected link delay in seconds, spent inside the op as a slow link would spend it.
        peer: group rank of the other side (``send``/``recv``), recorded as its global rank.

    Returns:
        What ``fn`` returns.
    """
    *head, timeout = args
    timeout = call_timeout(comm, timeout)
    tracer = comm.tracer
    if tracer is None:
        if delay:
            time.sleep(delay)
        return fn(*head, timeout)
    t_enter = time.time()
    ok = False
    try:
        if delay:
            time.sleep(delay)
        result = fn(*head, timeout)
        ok = True
        return result
    finally:
        other = None if peer is None else comm.group_ranks[peer]
        tracer.record(op, nbytes, comm.group_ranks, t_enter, time.time(), ok, peer=other)


def traced_finish(
    comm: CommunicatorCore,
    op: str,
    nbytes: int,
    t_enter: float,
    finish: Callable[[], None] | None,
    delay: float = 0.0,
) -> Callable[[], None] | None:
    """The ``finish`` of a started collective, made to spend ``delay`` seconds first (an injected slow link delays
    its completion) and to record the op from ``t_enter`` to its end; ``finish`` itself when there is neither a
    tracer nor a delay (``None``: the backend already finished it)."""
    tracer = comm.tracer
    if tracer is None and not delay:
        return finish

    def traced() -> None:
        ok = False
        try:
            time.sleep(delay)
            if finish is not None:
                finish()
            ok = True
        finally:
            if tracer is not None:
                tracer.record(op, nbytes, comm.group_ranks, t_enter, time.time(), ok)

    return traced


def as_timedelta(seconds: float) -> timedelta:
    """``seconds`` as a ``datetime.timedelta`` (what torch.distributed's timeouts take)."""
    return timedelta(seconds=seconds)
