"""Field checks of the simulator's config dataclasses: a hand-written JSON profile fails on one line that names
the field (a wrong type, NaN, infinity, a negative size); and ``frozen_config``, their dataclass decorator (the
hash worked out once)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, TypeVar, dataclass_transform

T = TypeVar("T")

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


MAX_MAGNITUDE = 1e12
"""No number of a profile exceeds this in its own unit, and a positive one is at least its inverse: past that the
products the simulator forms overflow or underflow (``bf16_tflops`` 1e-300 was a ZeroDivisionError traceback,
``layer_overhead_s`` 1e300 an infinite step time written to the JSON)."""


def check_finite(obj: Any, names: tuple[str, ...], *, positive: bool = False) -> None:
    """Each named field of ``obj`` is a finite number ``>= 0`` (``> 0`` with ``positive``, then at least
    ``1 / MAX_MAGNITUDE``), at most ``MAX_MAGNITUDE``: ``ValueError`` naming the field otherwise (NaN and infinity
    from a hand-written JSON profile included)."""
    low = 1 / MAX_MAGNITUDE if positive else 0
    for name in names:
        v = getattr(obj, name)
        bad = isinstance(v, bool) or not isinstance(v, (int, float))
        if bad or not math.isfinite(v) or not low <= v <= MAX_MAGNITUDE or (positive and v == 0):
            raise ValueError(
                f"{type(obj).__name__}.{name} must be a finite number in [{low:g}, {MAX_MAGNITUDE:g}], got {v!r}"
            )


@dataclass_transform(kw_only_default=True, frozen_default=True)
def frozen_config(cls: type[T]) -> type[T]:
    """``@dataclass(kw_only=True, frozen=True)`` whose hash is worked out once per instance (``hash_once``): a
    search prices thousands of layouts through caches keyed on the same specs, and hashing ``ModelSpec``'s 60-odd
    fields on every lookup was a fifth of its time."""
    cls.__hash__ = hash_once  # set before dataclass() runs: it keeps an explicit __hash__
    cls.__getstate__ = state_without_hash
    return dataclass(kw_only=True, frozen=True)(cls)


def hash_once(obj: Any) -> int:
    """The hash dataclass would give (the tuple of the compared fields), kept on the instance outside its fields
    (``==``, ``replace`` and ``asdict`` do not see it)."""
    try:
        return obj.__dict__["_hash_once"]
    except KeyError:
        value = hash(tuple(getattr(obj, f.name) for f in fields(obj) if f.compare))
        object.__setattr__(obj, "_hash_once", value)  # frozen: the cache is not a field
        return value


def state_without_hash(obj: Any) -> dict:
    """Pickled state without ``hash_once``'s value: string hashes differ between processes."""
    return {k: v for k, v in obj.__dict__.items() if k != "_hash_once"}
