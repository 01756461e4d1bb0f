"""Software fault injection for tests and demos: delayed links.

A link delay ``src=A,dst=B,ms=M`` makes every all-to-all and point-to-point send from global rank A that carries
data to global rank B take M milliseconds longer on A, inside the traced op (A enters on time, its data arrives
late: the signature of a slow link, not of slow compute). Delays come from
``Communicator.inject_link_delay`` or from the environment variable ``MOONEP_INJECT_LINK_DELAY``
(``src=0,dst=1,ms=5;src=2,dst=3,ms=1``), which spawned ranks inherit. Compute slowdowns belong to the
workload (the training loop), not to communication.
"""
from __future__ import annotations

import os

LINK_DELAY_ENV = "MOONEP_INJECT_LINK_DELAY"


def parse_link_delays(spec: str) -> dict[tuple[int, int], float]:
    """``"src=A,dst=B,ms=M[;...]"`` -> ``{(A, B): M / 1000}`` (seconds). Raises ValueError naming the bad part."""
    delays: dict[tuple[int, int], float] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        fields = {}
        for item in part.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"link delay {part!r}: expected key=value items, got {item!r}")
            fields[key.strip()] = value.strip()
        if set(fields) != {"src", "dst", "ms"}:
            raise ValueError(f"link delay {part!r}: needs exactly src=, dst= and ms= (got {sorted(fields)})")
        try:
            src, dst, ms = int(fields["src"]), int(fields["dst"]), float(fields["ms"])
        except ValueError as exc:
            raise ValueError(f"link delay {part!r}: src and dst must be integers, ms a number") from exc
        if src < 0 or dst < 0 or src == dst or not ms >= 0:
            raise ValueError(f"link delay {part!r}: needs two different ranks >= 0 and ms >= 0")
        delays[(src, dst)] = ms / 1000.0
    return delays


def link_delays_from_env() -> dict[tuple[int, int], float]:
    spec = os.environ.get(LINK_DELAY_ENV, "")
    return parse_link_delays(spec) if spec else {}
