"""numba's ``njit`` when numba is installed (and ``MOONEP_PLANNER_NUMBA`` is not ``0``), else an identity
decorator: the planner's kernels are written in the subset of Python that numba compiles, so they also run as
plain Python (correct but slow). Shared by ``_kernel`` and ``_topology`` so both switch together."""
from __future__ import annotations

import os

HAS_NUMBA = False
if os.environ.get("MOONEP_PLANNER_NUMBA", "1") != "0":
    try:
        from numba import njit

        HAS_NUMBA = True
    except ImportError:  # numba is optional: the same code runs as Python
        pass
if not HAS_NUMBA:
    def njit(*args, **kwargs):  # noqa: D103 - identity decorator
        return lambda f: f
