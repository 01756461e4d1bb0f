"""The runners that compute a ``TensorPlan`` (``planner.tensor_plan``) from a torch tensor of counts, and the CPU
kernel's host runs that ``planner.plan`` shares with numpy counts.

- CUDA: the numba-cuda kernels of ``planner._device_kernel`` and ``planner._device_slack`` (one launch, one
  block each) on torch's current stream; tensors cross into numba through ``__cuda_array_interface__``;
- CPU: the compiled CPU kernel (``planner._kernel``) on a zero-copy numpy view of the counts, its tables
  wrapped as tensors; or, for tests, the CUDA kernels under numba's CUDA simulator (``plan_with_device_kernel``);
- meta: the tables' shapes only (nothing is computed).

Topology-aware plans run on the host planner only (numpy counts). ``TensorPlan`` and ``flow_rows`` are
re-exported here (``planner.device.TensorPlan``).
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np

from planner import _kernel
from planner._errors import INFEASIBLE, NO_ERROR_POS
from planner.slack import CostModel, copies_per_rank, slack_caps, slack_num
from planner.tables import make_plan
from planner.tensor_plan import INT64_MAX, TensorPlan, empty_tables, flow_rows

__all__ = ["TensorPlan", "cheapest", "flow_rows", "host_plan", "plan_tensor", "plan_with_device_kernel", "slack_tables"]

SIM_THREADS = 4  # threads per block under numba's CUDA simulator (Python threads: few, but more than one)
GPU_THREADS = 256


def plan_tensor(
    T, caps, slots: int, pad: int, previous, defer_errors: bool, slack: int | None = None, cost=None, threads: int = 0
) -> TensorPlan:
    """``planner.plan`` for a torch tensor of counts [R, E] (shape, dtype and options already checked).

    slack: σ as ``planner.slack`` applies it (num / SLACK_DEN) or None; cost: a ``CostModel`` (its candidates
    are planned one by one and the cheapest kept: on the CPU from the kernel's arrays, on CUDA by tensor ops on
    the device; no host read either way)."""
    import torch  # heavy: torch, only for tensor input

    R, E = T.shape
    if T.device.type == "meta":
        return empty_tables(torch, T.device, R, E, slots, pad)
    if T.device.type == "cpu" and not threads:
        out = _run_cpu_kernel(T, caps, slots, pad, previous, slack, cost)
    elif cost is not None:
        num, n = slack_num(cost.max_slack, "CostModel.max_slack"), cost.candidates
        cands = [_plan_one(T, caps, slots, pad, previous, None, threads)]
        cands += [_plan_one(T, caps, slots, pad, previous, (num, k, n), threads) for k in range(1, n)]
        out = cheapest(cands, cost)
    else:
        out = _plan_one(T, caps, slots, pad, previous, None if not slack else (slack, 1, 2), threads)
    if not defer_errors:
        out.raise_if_invalid()
    return out


def _plan_one(T, caps, slots: int, pad: int, previous, slack, threads: int) -> TensorPlan:
    """One plan by the device kernels on T's CUDA device (or, with ``threads`` > 0, on the CPU under numba's
    CUDA simulator); slack = (num, k, n): the slack pass's candidate k of n first (None: exact)."""
    prev_donor, prev_copy = _previous_tables(previous, T.device, T.shape[0], slots)
    if slack is not None:
        caps, prev_donor, prev_copy = _device_slack(T, slack, prev_donor, prev_copy, slots, threads)
    return _run_device_kernel(T, caps, slots, pad, prev_donor, prev_copy, threads or GPU_THREADS)


def _device_slack(T, slack, prev_donor, prev_copy, slots: int, threads: int):
    """The slack pass on T's CUDA device -> (caps [R], sticky hint [R], prev_copy [R, slots]) as tensors."""
    import torch  # heavy: torch, only for tensor input

    from planner._device_slack import slack_kernel  # optional: numba-cuda, compiled on first launch

    R, dev = T.shape[0], T.device
    i64 = {"dtype": torch.int64, "device": dev}
    sticky = prev_donor is not None
    if not sticky:
        prev_donor, prev_copy = torch.full((R,), -1, **i64), torch.full((R, slots), -1, **i64)
    g, caps, hint, room = (torch.zeros(R, **i64) for _ in range(4))
    ok = torch.zeros(1, **i64)
    counts = T.detach().contiguous().to(torch.int64)
    _launch(slack_kernel, dev, (counts, *slack, prev_donor, sticky, g, caps, hint, room, ok), threads or GPU_THREADS)
    return caps, hint, prev_copy


def cheapest(cands: list[TensorPlan], cost) -> TensorPlan:
    """The candidate with the least predicted layer time (``CostModel``; first on ties, invalid plans last),
    picked by tensor ops on the plans' device: no host read."""
    import torch  # heavy: torch, only for tensor input

    secs = []
    for c in cands:
        copies = copies_per_rank(c.donor, c.experts_to_copy).to(torch.float64)
        t = (c.cu_seqlens[:, -1].to(torch.float64) * cost.row_seconds + copies * cost.copy_seconds).max()
        secs.append(torch.where(c.err[0] != 0, torch.inf, t))
    best = torch.argmin(torch.stack(secs)).view(1)
    pick = {
        f.name: torch.stack([getattr(c, f.name) for c in cands]).index_select(0, best).squeeze(0)
        for f in fields(TensorPlan)
        if f.name != "token_padding"
    }
    return TensorPlan(**pick, token_padding=cands[0].token_padding)


def _previous_tables(previous, device, R: int, slots: int):
    """(prev_donor [R], prev_copy [R, slots]) of a sticky plan on ``device``, or (None, None)."""
    if previous is None:
        return None, None
    import torch  # heavy: torch, only for tensor input

    tables = (previous.donor, previous.experts_to_copy)  # a numpy Plan's arrays are read-only: copy those
    return tuple(
        t.to(device, torch.int64)
        if isinstance(t, torch.Tensor)
        else torch.tensor(np.asarray(t, np.int64), device=device)
        for t in tables
    )


def host_plan(T, caps_in, slots, pad, prev_donor, prev_copy, node, num_nodes, weight_rows, num, cost):
    """The CPU kernel's arrays (``_kernel.plan_arrays``'s tuple) of the exact plan, the slack plan (``num``:
    σ as ``slack_num``) or the cost-aware choice (``cost``: its candidates planned, the cheapest kept, the
    exact plan on ties). Shared by numpy counts and CPU tensors."""
    args = (T, caps_in, slots, pad, prev_donor, prev_copy, node, num_nodes, weight_rows)
    if cost is None:
        return _plan_arrays(*args, (num, 1, 2) if num else None)
    n, top = cost.candidates, slack_num(cost.max_slack, "CostModel.max_slack")
    cands = [_plan_arrays(*args, None)] + [_plan_arrays(*args, (top, k, n)) for k in range(1, n)]
    return min(cands, key=lambda c: _predicted(c, cost))  # min keeps the first (exact) on ties


def _plan_arrays(T, caps_in, slots, pad, prev_donor, prev_copy, node, num_nodes, weight_rows, slack):
    """One run of the CPU kernel; slack = (num, k, n) runs the slack pass first. A topology plan takes the
    slack caps but makes its own pairs; if those caps prove too uneven for it, the exact plan is kept."""
    R, E = T.shape
    cap_in, donor_in, copy_in = caps_in, prev_donor, prev_copy
    if slack is not None:
        cap_in, hint, hint_copy = slack_tables(T, slack, prev_donor, prev_copy, slots)
        if num_nodes <= 1:
            donor_in, copy_in = hint, hint_copy
    # the three large tables come from numpy: it maps big arrays with huge pages (far fewer page faults)
    keep, alloc, send = np.empty((R, E), np.int32), np.zeros((E, R), np.int32), np.zeros((R, R), np.int64)
    out = _kernel.plan_arrays(T, keep, alloc, send, cap_in, slots, pad, donor_in, copy_in, node, num_nodes, weight_rows)
    if slack is not None and out[-1][0] == INFEASIBLE:
        return _plan_arrays(T, caps_in, slots, pad, prev_donor, prev_copy, node, num_nodes, weight_rows, None)
    return out


def _predicted(out, cost: CostModel) -> float:
    """Predicted layer seconds of one kernel result (inf for a refused plan)."""
    donor, copy, cu, err = out[3], out[4], out[5], out[8]
    return float("inf") if err[0] else float(cost.rank_seconds(cu[:, -1], donor, copy).max())


def _run_cpu_kernel(T, caps, slots: int, pad: int, previous, num=None, cost=None) -> TensorPlan:
    """The compiled CPU kernel on a zero-copy view of ``T``; its tables become tensors (no copy), padded.
    num / cost: a slack plan or the cost-aware choice (``host_plan``); the candidates are chosen on the host
    from the kernel's own arrays (nothing read from a tensor), and only the one kept gets route pieces."""
    import torch  # heavy: torch, only for tensor input

    R, E = T.shape
    Tn = T.detach().contiguous().to(torch.int64).numpy()  # the kernel's zero-copy entry (int64 input: a view)
    caps_in = np.zeros(0, np.int64) if caps is None else np.ascontiguousarray(caps, dtype=np.int64)
    prev_donor = np.zeros(0, np.int64) if previous is None else np.asarray(previous.donor, np.int64)
    prev_copy = np.zeros((0, slots), np.int64) if previous is None else np.asarray(previous.experts_to_copy, np.int64)
    counts, caps_out, alloc, donor, copy, cu, send, flows, err = host_plan(
        Tn, caps_in, slots, pad, prev_donor, prev_copy, np.zeros(0, np.int64), 0, 0, num, cost
    )
    F = flow_rows(R, E, slots)
    flows_pad, pieces_pad = np.zeros((F, 4), np.int64), np.full((E + F, 4), INT64_MAX, np.int64)
    totals = np.zeros(2, np.int64)
    if err[0] == 0:
        flows_pad[: flows.shape[0]] = flows
        end, start, dest, row0 = make_plan(
            counts, caps_out, alloc, donor, copy, send, cu, flows, pad, E // R, freeze=False
        )._pieces
        pieces_pad[: end.size] = np.stack((end, start, dest, row0), axis=1)
        totals[:] = flows.shape[0], end.size
    # the kernel's own output arrays become the tensors (no copy); they are not shared with anyone else
    t = torch.from_numpy
    out = TensorPlan(
        slots_per_expert=t(counts),
        caps=t(caps_out),
        alloc=t(alloc),
        donor=t(donor),
        experts_to_copy=t(copy),
        send_counts=t(send),
        cu_seqlens=t(cu),
        flows=t(flows_pad),
        pieces=t(pieces_pad),
        totals=t(totals),
        err=t(err),
        token_padding=pad,
    )
    return out


def _run_device_kernel(T, caps, slots: int, pad: int, prev_donor, prev_copy, threads: int) -> TensorPlan:
    """Launch ``plan_kernel`` on T's device (CUDA, or the CPU under numba's CUDA simulator)."""
    import torch  # heavy: torch, only for tensor input

    from planner._device_kernel import plan_kernel  # optional: compiles for numba's CUDA target on first launch

    R, E = T.shape
    dev = T.device
    out = empty_tables(torch, dev, R, E, slots, pad, fill=True)
    i64 = {"dtype": torch.int64, "device": dev}
    sticky = prev_donor is not None
    if not sticky:
        prev_donor, prev_copy = torch.full((R,), -1, **i64), torch.full((R, slots), -1, **i64)
    caps_in = torch.zeros(R, **i64) if caps is None else torch.as_tensor(caps, **i64)
    scratch = [
        torch.zeros(E, **i64),
        torch.zeros(R, **i64),
        torch.zeros(R, **i64),
        torch.zeros(R, E // R, **i64),
        torch.zeros(R, R, **i64),
        torch.zeros(R, **i64),
        torch.zeros(E, **i64),
        torch.zeros(E, **i64),
        torch.zeros(E, **i64),
        torch.zeros(E, **i64),
        torch.zeros(E, **i64),
        torch.full((1,), NO_ERROR_POS, **i64),
    ]
    args = [
        T.detach().contiguous().to(torch.int64),
        caps_in,
        caps is not None,
        pad,
        prev_donor,
        prev_copy,
        sticky,
        out.slots_per_expert,
        out.alloc,
        out.send_counts,
        out.caps,
        out.donor,
        out.experts_to_copy,
        out.cu_seqlens,
        out.flows,
        out.pieces,
        out.totals,
        out.err,
        *scratch,
    ]
    _launch(plan_kernel, dev, args, threads)
    return out


def _launch(kernel, dev, args, threads: int = GPU_THREADS) -> None:
    """One block of ``kernel`` on torch's current stream of ``dev`` (CUDA), or under numba's CUDA simulator."""
    import torch  # heavy: torch, only for tensor input
    from numba import cuda  # optional: numba-cuda (the gpu and dev extras)

    if dev.type == "cuda":
        stream = cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)
        # sync=False: the tensors were made on this stream, and the kernel runs on it; numba's default would
        # synchronise the stream each array interface names (a host wait per argument)
        args = [cuda.as_cuda_array(a, sync=False) if isinstance(a, torch.Tensor) else a for a in args]
        with torch.cuda.device(dev):
            kernel[1, threads, stream](*args)
    else:  # numba's CUDA simulator: kernels take numpy arrays (views of the CPU tensors: results land in them)
        args = [a.numpy() if isinstance(a, torch.Tensor) else a for a in args]
        kernel[1, threads](*args)


def slack_tables(T: np.ndarray, slack, prev_donor: np.ndarray, prev_copy: np.ndarray, slots: int):
    """The slack pass on the host: (caps [R], sticky hint [R], prev_copy [R, slots]) for ``plan_arrays``.
    T [R, E] int64; slack = (num, k, n); prev_* [0] when not sticky."""
    R, E = T.shape
    g = np.ascontiguousarray(T.sum(0).reshape(R, E // R).sum(1), dtype=np.int64)
    sticky = prev_donor.shape[0] == R
    donor_in = prev_donor if sticky else np.full(R, -1, np.int64)
    caps, hint, room = np.zeros(R, np.int64), np.zeros(R, np.int64), np.zeros(R, np.int64)
    slack_caps(g, *slack, donor_in, sticky, caps, hint, room)
    return caps, hint, prev_copy if sticky else np.full((R, slots), -1, np.int64)


def plan_with_device_kernel(
    slots_per_expert,
    *,
    caps=None,
    slots_per_rank: int | None = None,
    token_padding: int = 1,
    previous=None,
    slack: float | None = None,
    cost=None,
    threads: int | None = None,
) -> TensorPlan:
    """Run the numba-cuda kernel whatever the counts' device: the CPU runs it under numba's CUDA simulator
    (``NUMBA_ENABLE_CUDASIM=1`` set before numba is imported). For tests and for comparing with the CPU kernel;
    ``planner.plan`` picks the kernel by device. Errors are raised."""
    import torch  # heavy: torch, only for tensor input

    T = torch.as_tensor(slots_per_expert)
    R, E = T.shape
    slots = E // R if slots_per_rank is None else int(slots_per_rank)
    nt = threads or (GPU_THREADS if T.device.type == "cuda" else SIM_THREADS)
    num = None if slack is None else slack_num(slack)
    return plan_tensor(T, caps, slots, token_padding, previous, False, num, cost, nt)
