"""Software fault injection for tests and demos: delayed links, and the fault specs of training jobs.

A link delay ``src=A,dst=B,ms=M`` makes every all-to-all and point-to-point send from global rank A that carries
data to global rank B take M milliseconds longer on A, inside the traced op (A enters on time, its data arrives
late: the signature of a slow link, not of slow compute). Delays come from
``Communicator.inject_link_delay`` or from the environment variable ``MOONEP_INJECT_LINK_DELAY``
(``src=0,dst=1,ms=5;src=2,dst=3,ms=1``), which spawned ranks inherit. Compute slowdowns belong to the
workload (the training loop), not to communication.

The fault *specs* of training jobs live here too, so that both the trainer (``k3``, which may not import
``tools``) and the synthetic workload (``tools``) read one grammar, from here
(comma-separated ``key=value`` items; ``;`` separates several specs of one kind):

- ``rank=R,factor=F[,from_step=N]`` (``Slowdown``): rank R's compute takes F x as long from step N (default 0).
- ``rank=R,ms=M[,from_step=N]`` (``DataDelay``): rank R's data loading takes M ms longer from step N.
- ``src=A,dst=B,ms=M[,from_step=N]`` (``LinkDelay``): the delay above; the job calls ``inject_link_delay``
  when step N starts.

Every parser raises ``ValueError`` naming the bad part, so a typo never silently runs a clean job; factors and
delays must be finite and at most ``MAX_FACTOR`` / ``MAX_MS`` (``inf`` hung a job or overflowed a timestamp).
Applying a slowdown or data delay is the job's business (time-based: see ``tools/workload.py`` and
``k3/train.py``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

LINK_DELAY_ENV = "MOONEP_INJECT_LINK_DELAY"
MAX_FACTOR = 1000.0
"""Largest slowdown factor: beyond it a "slow" rank is a hung job (``inf`` never finished a step)."""
MAX_MS = 3_600_000.0
"""Largest injected delay, in ms (one hour): larger values overflow the timestamps the delays are added to."""


def _check_range(what: str, value: float, low: float, high: float) -> None:
    """ValueError naming ``what`` unless ``low <= value <= high`` (the chained compare also refuses nan)."""
    if not low <= value <= high:
        raise ValueError(f"{what} must be >= {low:.0f} and <= {high:.0f}, got {value}")


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
        if src < 0 or dst < 0 or src == dst or not 0 <= ms <= MAX_MS:
            raise ValueError(f"link delay {part!r}: needs two different ranks >= 0 and ms >= 0 and <= {MAX_MS:.0f}")
        delays[(src, dst)] = ms / 1000.0
    return delays


def link_delays_from_env() -> dict[tuple[int, int], float]:
    spec = os.environ.get(LINK_DELAY_ENV, "")
    return parse_link_delays(spec) if spec else {}


@dataclass(frozen=True, kw_only=True, slots=True)
class Slowdown:
    """One rank's compute runs ``factor`` x slower from ``from_step`` on."""

    rank: int
    """Global rank that is slowed."""
    factor: float
    """Compute-time multiplier, 1 to ``MAX_FACTOR`` (1.2 = 20% slower)."""
    from_step: int = 0
    """First step (0-based) that is slow."""

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"slowdown rank must be >= 0, got {self.rank}")
        _check_range("slowdown factor", self.factor, 1.0, MAX_FACTOR)
        if self.from_step < 0:
            raise ValueError(f"slowdown from_step must be >= 0, got {self.from_step}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataDelay:
    """One rank's data loading takes ``ms`` longer from ``from_step`` on."""

    rank: int
    """Global rank whose data loader is slow."""
    ms: float
    """Extra milliseconds per step, 0 to ``MAX_MS``."""
    from_step: int = 0
    """First step (0-based) that is slow."""

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"data delay rank must be >= 0, got {self.rank}")
        _check_range("data delay ms", self.ms, 0.0, MAX_MS)
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
    """Extra milliseconds per transfer, 0 to ``MAX_MS``."""
    from_step: int = 0
    """First step (0-based) that is delayed."""

    def __post_init__(self):
        if self.src < 0 or self.dst < 0 or self.src == self.dst:
            raise ValueError(f"link delay needs two different ranks >= 0, got src={self.src} dst={self.dst}")
        _check_range("link delay ms", self.ms, 0.0, MAX_MS)
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
        raise ValueError(
            f"{what} {part!r}: needs {sorted(required)}"
            f"{' (optional ' + str(sorted(optional)) + ')' if optional else ''}; "
            f"missing {sorted(missing)}, unknown {sorted(unknown)}"
        )
    return fields


def _number(part: str, what: str, fields: dict[str, str], key: str, kind):
    try:
        return kind(fields[key])
    except ValueError:
        wanted = "an integer" if kind is int else "a number"
        raise ValueError(f"{what} {part!r}: {key}={fields[key]!r} is not {wanted}") from None


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


def _build(cls, part: str, what: str, fields: dict[str, str], kinds: dict[str, type]):
    """``cls`` from one spec's ``fields``, each converted to its kind (a range error names ``part``)."""
    return cls(**{k: _number(part, what, fields, k, t) for k, t in kinds.items()})


def _parse_specs(spec: str, what: str, cls, kinds: dict[str, type]) -> list:
    """``spec`` ("k=v,...;...") -> list of ``cls``: ``kinds`` are the required keys with their types, plus an
    optional ``from_step`` (default 0)."""
    kinds = {**kinds, "from_step": int}
    out = []
    for part in _parts(spec):
        f = _fields(part, what, set(kinds) - {"from_step"}, {"from_step"})
        f.setdefault("from_step", "0")
        out.append(_checked(part, what, functools.partial(_build, cls, part, what, f, kinds)))
    return out


def parse_slowdowns(spec: str) -> list[Slowdown]:
    """``"rank=R,factor=F[,from_step=N][;...]"`` -> list of ``Slowdown``."""
    return _parse_specs(spec, "slowdown", Slowdown, {"rank": int, "factor": float})


def parse_data_delays(spec: str) -> list[DataDelay]:
    """``"rank=R,ms=M[,from_step=N][;...]"`` -> list of ``DataDelay``."""
    return _parse_specs(spec, "data delay", DataDelay, {"rank": int, "ms": float})


def parse_link_delay_specs(spec: str) -> list[LinkDelay]:
    """``"src=A,dst=B,ms=M[,from_step=N][;...]"`` -> list of ``LinkDelay`` (the env grammar above + from_step)."""
    return _parse_specs(spec, "link delay", LinkDelay, {"src": int, "dst": int, "ms": float})


def check_fault_ranks(world_size: int, slowdowns=(), data_delays=(), link_delays=()) -> None:
    """ValueError naming every injected rank that is not below ``world_size`` (a typo must not run clean)."""
    bad = [
        f"{name} rank {s.rank}"
        for name, specs in (("slowdown", slowdowns), ("data delay", data_delays))
        for s in specs
        if s.rank >= world_size
    ]
    bad += [f"link delay rank {r}" for d in link_delays for r in (d.src, d.dst) if r >= world_size]
    if bad:
        raise ValueError(f"injected faults outside world_size={world_size}: {', '.join(bad)}")


def faults_at(job, rank: int, step: int) -> tuple[float, float, list[LinkDelay]]:
    """Faults of ``job`` (anything with ``slowdowns``, ``data_delays``, ``link_delays``) in force at ``step``:
    (rank's compute factor, the largest of overlapping slowdowns; its extra data-loading ms; link delays)."""
    factor = max((s.factor for s in job.slowdowns if s.rank == rank and step >= s.from_step), default=1.0)
    data_ms = sum(d.ms for d in job.data_delays if d.rank == rank and step >= d.from_step)
    return factor, data_ms, [d for d in job.link_delays if step >= d.from_step]
