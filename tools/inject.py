"""Software fault injection specs shared by the synthetic workload and ``moonep train``.

Grammar (comma-separated ``key=value`` items; ``;`` separates several specs of one kind):

- ``--inject-slowdown rank=R,factor=F[,from_step=N]``: rank R's compute takes F x as long from step N (default 0).
- ``--inject-data-delay rank=R,ms=M[,from_step=N]``: rank R's data loading takes M ms longer from step N.
- ``--inject-link-delay src=A,dst=B,ms=M[,from_step=N]``: data A sends to B arrives M ms late (spent by
  ``collectives`` inside the op, see ``collectives/faults.py``); ``from_step`` is ours: the workload calls
  ``comm.inject_link_delay`` when that step starts.

Every parser raises ``ValueError`` naming the bad part, so a typo never silently runs a clean job. The specs and
parsers live in ``collectives.faults`` (``k3`` reads them too and may not import ``tools``); this module is
their name on the tools side.
"""
from __future__ import annotations

from collectives.faults import DataDelay, LinkDelay, Slowdown, parse_data_delays, parse_slowdowns
from collectives.faults import parse_link_delay_specs as parse_link_delays

__all__ = ["DataDelay", "LinkDelay", "Slowdown", "parse_data_delays", "parse_link_delays", "parse_slowdowns"]
