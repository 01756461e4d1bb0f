"""The slack pass on a CUDA device: one block running the same source as the CPU's ``planner.slack``.

The pass's functions are written for both targets; here each is re-bound as a numba-cuda device function whose
calls resolve to the other device functions (the CPU ``njit`` dispatchers cannot take the simulator's arrays),
so the CPU kernel and this kernel run one source (the tests compare them under numba's CUDA simulator and
compile this kernel to PTX for sm_90). Threads sum the group loads; thread 0 makes the pairs (sequential by
nature, O(R) per receiver).
"""

from __future__ import annotations

import types

from numba import cuda

from planner import slack

_PASS = ("_slack_target", "_pick_receiver", "_slack_pairs", "slack_caps")


def _device_functions() -> dict:
    """The slack pass's functions as device functions that call each other (one namespace, same code)."""
    ns = dict(vars(slack))
    for name in _PASS:
        py = getattr(getattr(slack, name), "py_func", getattr(slack, name))
        ns[name] = cuda.jit(device=True)(types.FunctionType(py.__code__, ns, name, py.__defaults__))
    return ns


slack_caps = _device_functions()["slack_caps"]


@cuda.jit
def slack_kernel(T, num, k, n, prev_donor, sticky, g, caps, hint, room, ok):
    """T [R, E] int64 counts -> g [R] group loads, caps [R], hint [R] (receiver -> donor, -1 = none), ok [1]
    (1: the slack pass made the pairs; 0: exact caps and last step's donors). room [R] is scratch."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    R, E = T.shape
    epn = E // R
    for h in range(tid, R, nt):
        s = 0
        for r in range(R):
            for j in range(epn):
                s += T[r, h * epn + j]
        g[h] = s
    cuda.syncthreads()
    if tid == 0:
        ok[0] = slack_caps(g, num, k, n, prev_donor, sticky, caps, hint, room)
