"""Software fault injection specs shared by the synthetic workload and (later) ``moonep train``.

Grammar (comma-separated ``key=value`` items; ``;`` separates several specs of one kind):

- ``--inject-slowdown rank=R,factor=F[,from_step=N]``: rank R's compute takes F x as long from step N (default 0).
- ``--inject-data-delay rank=R,ms=M[,from_step=N]``: rank R's data loading takes M ms longer from step N.
- ``--inject-link-delay src=A,dst=B,ms=M[,from_step=N]``: data A sends to B arrives M ms late (spent by
  ``collectives`` inside the op, see ``collectives/faults.py``); ``from_step`` is ours: the workload calls
  ``comm.inject_link_delay`` when that step starts.

Every parser raises ``ValueError`` naming the bad part, so a typo never silently runs a clean job.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Slowdown:
    """One rank's compute runs ``factor`` x slower from ``from_step`` on."""

    rank: int
    """Global rank that is slowed."""
    factor: float
    """Compute-time multiplier, >= 1 (1.2 = 20% slower)."""
    from_step: int = 0
    """First step (0-based) that is slow."""

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"slowdown rank must be >= 0, got {self.rank}")
        if not self.factor >= 1.0:
            raise ValueError(f"slowdown factor must be >= 1, got {self.factor}")
        if self.from_step < 0:
            raise ValueError(f"slowdown from_step must be >= 0, got {self.from_step}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataDelay:
    """One rank's data loading takes ``ms`` longer from ``from_step`` on."""

    rank: int
    """Global rank whose data loader is slow."""
    ms: float
    """Extra milliseconds per step, >= 0."""
    from_step: int = 0
    """First step (0-based) that is slow."""

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"data delay rank must be >= 0, got {self.rank}")
        if not self.ms >= 0:
            raise ValueError(f"data delay ms must be >= 0, got {self.ms}")
        if self.from_step < 0:
            raise ValueError(f"data delay from_step must be >= 0, got {self.from_step}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkDelay:
    """Data global rank ``src`` sends to ``dst`` arrives ``ms`` late, from ``from_step`` on."""

    src: int
    """Sending global rank."""
    dst: int
    """Receiving global rank (!= src)."""
    ms: float
    """Extra milliseconds per transfer, >= 0."""
    from_step: int = 0
    """First step (0-based) that is delayed."""

    def __post_init__(self):
        if self.src < 0 or self.dst < 0 or self.src == self.dst:
            raise ValueError(f"link delay needs two different ranks >= 0, got src={self.src} dst={self.dst}")
        if not self.ms >= 0:
            raise ValueError(f"link delay ms must be >= 0, got {self.ms}")
        if self.from_step < 0:
            raise ValueError(f"link delay from_step must be >= 0, got {self.from_step}")


def _fields(part: str, what: str, required: set[str], optional: set[str]) -> dict[str, str]:
    fields: dict[str, str] = {}
    for item in part.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{what} {part!r}: expected key=value items, got {item!r}")
        if key in fields:
            raise ValueError(f"{what} {part!r}: {key}= given twice")
        fields[key] = value.strip()
    missing, unknown = required - set(fields), set(fields) - required - optional
    if missing or unknown:
        raise ValueError(f"{what} {part!r}: needs {sorted(required)}"
                         f"{' (optional ' + str(sorted(optional)) + ')' if optional else ''}; "
                         f"missing {sorted(missing)}, unknown {sorted(unknown)}")
    return fields


def _number(part: str, what: str, fields: dict[str, str], key: str, kind):
    try:
        return kind(fields[key])
    except ValueError:
        raise ValueError(f"{what} {part!r}: {key}={fields[key]!r} is not {'an integer' if kind is int else 'a number'}") \
            from None


def _parts(spec: str) -> list[str]:
    return [p.strip() for p in (spec or "").split(";") if p.strip()]


def _checked(part: str, what: str, build):
    """Build the dataclass, re-raising its range errors with the offending text."""
    try:
        return build()
    except ValueError as exc:
        if repr(part) in str(exc):
            raise
        raise ValueError(f"{what} {part!r}: {exc}") from None


def parse_slowdowns(spec: str) -> list[Slowdown]:
    """``"rank=R,factor=F[,from_step=N][;...]"`` -> list of ``Slowdown``."""
    out = []
    for part in _parts(spec):
        f = _fields(part, "slowdown", {"rank", "factor"}, {"from_step"})
        f.setdefault("from_step", "0")
        out.append(_checked(part, "slowdown", lambda: Slowdown(
            rank=_number(part, "slowdown", f, "rank", int), factor=_number(part, "slowdown", f, "factor", float),
            from_step=_number(part, "slowdown", f, "from_step", int))))
    return out


def parse_data_delays(spec: str) -> list[DataDelay]:
    """``"rank=R,ms=M[,from_step=N][;...]"`` -> list of ``DataDelay``."""
    out = []
    for part in _parts(spec):
        f = _fields(part, "data delay", {"rank", "ms"}, {"from_step"})
        f.setdefault("from_step", "0")
        out.append(_checked(part, "data delay", lambda: DataDelay(
            rank=_number(part, "data delay", f, "rank", int), ms=_number(part, "data delay", f, "ms", float),
            from_step=_number(part, "data delay", f, "from_step", int))))
    return out


def parse_link_delays(spec: str) -> list[LinkDelay]:
    """``"src=A,dst=B,ms=M[,from_step=N][;...]"`` -> list of ``LinkDelay`` (collectives' grammar + from_step)."""
    out = []
    for part in _parts(spec):
        f = _fields(part, "link delay", {"src", "dst", "ms"}, {"from_step"})
        f.setdefault("from_step", "0")
        out.append(_checked(part, "link delay", lambda: LinkDelay(
            src=_number(part, "link delay", f, "src", int), dst=_number(part, "link delay", f, "dst", int),
            ms=_number(part, "link delay", f, "ms", float),
            from_step=_number(part, "link delay", f, "from_step", int))))
    return out
