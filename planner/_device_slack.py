"""The slack pass on a CUDA device: one block running the same source as the CPU's ``planner.slack``.

The pass's functions are written for both targets; ``planner._cuda.device_functions`` re-binds them as numba-cuda
device functions calling each other, so the CPU kernel and this kernel run one source (the tests compare them
under numba's CUDA simulator and compile this kernel to PTX for sm_90). Threads sum the group loads; thread 0
makes the pairs (sequential by nature, O(R) per receiver).
"""

from __future__ import annotations

from planner import slack
from planner._cuda import cuda, device_functions

slack_caps = device_functions(slack, ("_slack_target", "_pick_receiver", "_slack_pairs", "slack_caps"))["slack_caps"]


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
