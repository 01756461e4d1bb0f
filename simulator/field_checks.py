"""Field checks of the simulator's config dataclasses: a hand-written JSON profile fails on one line that names
the field (a wrong type, NaN, infinity, a negative size)."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

_SCALARS = {"float": (int, float), "int": (int,), "bool": (bool,), "str": (str,)}


def check_types(obj: Any) -> None:
    """Every scalar field of a config dataclass has its annotated type (``bool`` is no number): ``ValueError``
    naming the field otherwise, so a hand-written JSON profile fails on one clear line."""
    for f in fields(obj):
        want = _SCALARS.get(f.type)
        v = getattr(obj, f.name)
        if want is None:
            continue
        if not isinstance(v, want) or (bool not in want and isinstance(v, bool)):
            raise ValueError(f"{type(obj).__name__}.{f.name} must be of type {f.type}, got {v!r}")


def check_finite(obj: Any, names: tuple[str, ...], *, positive: bool = False) -> None:
    """Each named field of ``obj`` is a finite number ``>= 0`` (``> 0`` with ``positive``): ``ValueError`` naming
    the field otherwise (NaN and infinity from a hand-written JSON profile included)."""
    for name in names:
        v = getattr(obj, name)
        bad = isinstance(v, bool) or not isinstance(v, (int, float))
        if bad or not math.isfinite(v) or v < 0 or (positive and v == 0):
            raise ValueError(
                f"{type(obj).__name__}.{name} must be a finite number {'>' if positive else '>='} 0, got {v!r}"
            )
