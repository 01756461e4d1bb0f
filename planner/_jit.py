"""numba's ``njit`` when numba is installed (and ``MOONEP_PLANNER_NUMBA`` is not ``0``), else an identity
decorator: the planner's kernels are written in the subset of Python that numba compiles, so they also run as
plain Python (correct but slow). Shared by ``_kernel`` and ``_topology`` so both switch together."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import Any

HAS_NUMBA = False
if os.environ.get("MOONEP_PLANNER_NUMBA", "1") != "0":
    try:
        from numba import njit

        HAS_NUMBA = True
    except ImportError:  # numba is optional: the same code runs as Python
        pass
if not HAS_NUMBA:

    def njit(*args, **kwargs):  # an identity decorator
        return lambda f: f


def refresh_cache(namespace: dict[str, Any], sources: Iterable[str], stamp_name: str) -> bool:
    """Flush the numba caches of the jitted functions in ``namespace`` when any file of ``sources`` changed.

    numba keys a cached function on its own file's time stamp only, yet the cached machine code also holds
    the jitted functions it calls from other files (``_kernel`` calls ``_topology``): after an edit to those
    alone, a fresh process would load stale code. A digest of all ``sources`` is kept beside the cache; when
    it differs, every cached function of ``namespace`` recompiles once. Returns True when it flushed.
    Concurrent first imports at worst flush twice (numba replaces its cache files atomically).
    """
    if not HAS_NUMBA:
        return False
    jitted = [f for f in namespace.values() if hasattr(f, "py_func") and hasattr(f, "_cache")]
    if not jitted or jitted[0].stats.cache_path is None:
        return False
    digest = hashlib.sha256()
    for path in sources:
        with open(path, "rb") as f:
            digest.update(f.read())
    stamp = os.path.join(jitted[0].stats.cache_path, stamp_name)
    try:
        with open(stamp) as f:
            if f.read() == digest.hexdigest():
                return False
    except OSError:  # first run, or a fresh cache directory
        pass
    for f in jitted:
        f._cache.flush()  # an empty index: the next call compiles afresh (numba's own invalidation, forced)
    try:
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        tmp = f"{stamp}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(digest.hexdigest())
        os.replace(tmp, stamp)  # the stamp is written after the flush, so no reader trusts a stale index
    except OSError:  # a read-only cache: numba does not cache there either
        pass
    return True
