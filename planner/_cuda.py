"""One source, two targets: target-neutral planner functions re-bound as numba-cuda device functions.

``planner._stages`` and ``planner.slack`` write their kernel steps once, compiled with numba's ``njit`` for the
CPU. A CPU dispatcher cannot be called from CUDA code (nor take the simulator's arrays), so the device kernels
re-bind each step's Python source as a ``cuda.jit(device=True)`` function in one namespace, where a call by
bare name reaches the other re-bound steps: the CPU and the CUDA kernels then run the same lines. Imports
numba-cuda: only the device kernels (optional, compiled on first launch) import this module.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

from numba import cuda as _numba_cuda

# numba-cuda for kernel code, as Any: its device API (syncthreads, atomic, threadIdx) is typed as the stubs numba
# lowers, so pyright reads a barrier as a call missing a typing context and skips all code after it as unreachable
cuda: Any = _numba_cuda


def device_functions(module: types.ModuleType, names: Iterable[str] | None = None) -> dict[str, Any]:
    """The steps of ``module`` as numba-cuda device functions that call each other.

    Args:
        module: a module of target-neutral functions (``njit`` dispatchers, or plain functions without numba).
        names: the functions to re-bind; None: every function defined in ``module``.
    Returns:
        A copy of the module's namespace with those names bound to device functions (the rest unchanged).
    """
    ns = dict(vars(module))
    if names is None:
        names = [k for k, v in ns.items() if getattr(getattr(v, "py_func", v), "__module__", None) == module.__name__]
    for name in names:
        py = getattr(ns[name], "py_func", ns[name])
        ns[name] = _numba_cuda.jit(device=True)(types.FunctionType(py.__code__, ns, name, py.__defaults__))
    return ns
