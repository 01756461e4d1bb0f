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
    """``planner.plan`` for a torch tensor of counts (shape, dtype and options already checked).

    Args:
        T: [R, E] integer tensor of counts on any device. caps: [R] int64 array or None (floor/ceil of total / R).
        slots, pad: replica slots per rank and token padding. previous: a sticky plan (Plan or TensorPlan) or None.
        defer_errors: leave an invalid plan's error in ``err`` (no host read) instead of raising.
        slack: σ as ``planner.slack`` applies it (num / SLACK_DEN) or None.
        cost: a ``CostModel``: its candidates are planned one by one and the cheapest kept (on the CPU from the
            kernel's arrays, on CUDA by tensor ops on the device; no host read either way).
        threads: > 0 runs the CUDA kernels with that many threads a block, also on the CPU (numba's simulator).
    Returns:
        The ``TensorPlan`` on T's device (shapes only on the meta device).
    """
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
    prev_donor, prev_copy, sticky = _previous_tables(previous, T.device, T.shape[0], slots)
    if slack is not None:  # the slack pass's pairs become the kernel's sticky hint
        caps, prev_donor = _device_slack(T, slack, prev_donor, sticky, threads)
        sticky = True
    return _run_device_kernel(T, caps, slots, pad, prev_donor, prev_copy, sticky, threads or GPU_THREADS)


def _device_slack(T, slack, prev_donor, sticky: bool, threads: int):
    """The slack pass on T's CUDA device -> (caps [R], sticky hint [R]) as int64 tensors."""
    import torch  # heavy: torch, only for tensor input

    from planner._device_slack import slack_kernel  # optional: numba-cuda, compiled on first launch

    R, dev = T.shape[0], T.device
    i64 = {"dtype": torch.int64, "device": dev}
    g, caps, hint, room = (torch.zeros(R, **i64) for _ in range(4))
    ok = torch.zeros(1, **i64)
    counts = T.detach().contiguous().to(torch.int64)
    _launch(slack_kernel, dev, (counts, *slack, prev_donor, sticky, g, caps, hint, room, ok), threads or GPU_THREADS)
    return caps, hint


def cheapest(cands: list[TensorPlan], cost) -> TensorPlan:
    """The candidate with the least predicted layer time, picked by tensor ops on the plans' device (no host read).

    Args:
        cands: plans of one shape on one device. cost: the ``CostModel`` that prices them.
    Returns:
        The cheapest plan (the first on ties, invalid plans last), its tables stacked from the candidates'.
    """
    import torch  # heavy: torch, only for tensor input

    secs = []
    for c in cands:
        copies = torch.as_tensor(copies_per_rank(c.donor, c.experts_to_copy), dtype=torch.float64)
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
    """(prev_donor [R], prev_copy [R, slots], sticky) on ``device``: a sticky plan's tables, or -1 everywhere."""
    import torch  # heavy: torch, only for tensor input

    if previous is None:
        i64 = {"dtype": torch.int64, "device": device}
        return torch.full((R,), -1, **i64), torch.full((R, slots), -1, **i64), False
    tables = (previous.donor, previous.experts_to_copy)  # a numpy Plan's arrays are read-only: copy those
    donor, copy = (
        t.to(device, torch.int64)
        if isinstance(t, torch.Tensor)
        else torch.tensor(np.asarray(t, np.int64), device=device)
        for t in tables
    )
    return donor, copy, True


def host_plan(T, caps_in, slots, pad, prev_donor, prev_copy, node, num_nodes, weight_rows, num, cost):
    """The CPU kernel's run for ``planner.plan``, shared by numpy counts and CPU tensors.

    Args:
        T: [R, E] int64 counts. caps_in: [R] int64, or [0] (floor/ceil). slots, pad: replica slots per rank,
            token padding. prev_donor: [R] int64 and prev_copy: [R, slots] int64, or [0] / [0, slots] (not sticky).
        node: [R] int64 and num_nodes > 0 for a topology, else [0] and 0; weight_rows: a copy's cost in rows.
        num: σ as ``slack_num`` (a slack plan) or None; cost: a ``CostModel`` (its candidates planned, the
            cheapest kept, the exact plan on ties) or None.
    Returns:
        ``_kernel.plan_arrays``'s tuple (T copy, caps, alloc, donor, experts_to_copy, cu_seqlens, send_counts,
        flows, err) of the plan chosen.
    """
    # numba compiles the kernel once per argument type, and a read-only array (a numpy Plan's tables, a user's
    # counts) is a type of its own: 3 s more compiling and one more cache entry to load per variant (a previous
    # numpy Plan, slack with one). Writable C int64 everywhere keeps one.
    T, caps_in, prev_donor, prev_copy, node = (
        np.require(a, np.int64, ("C", "W")) for a in (T, caps_in, prev_donor, prev_copy, node)
    )
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
    # the kernel's own output arrays become the tensors (no copy), in TensorPlan's field order; no one shares them
    tables = (counts, caps_out, alloc, donor, copy, send, cu, flows_pad, pieces_pad, totals, err)
    return TensorPlan(*(torch.from_numpy(a) for a in tables), token_padding=pad)


def _run_device_kernel(T, caps, slots: int, pad: int, prev_donor, prev_copy, sticky: bool, threads: int) -> TensorPlan:
    """Launch ``plan_kernel`` on T's device (CUDA, or the CPU under numba's CUDA simulator)."""
    import torch  # heavy: torch, only for tensor input

    from planner._device_kernel import plan_kernel  # optional: compiles for numba's CUDA target on first launch

    R, E = T.shape
    dev = T.device
    out = empty_tables(torch, dev, R, E, slots, pad, fill=True)
    i64 = {"dtype": torch.int64, "device": dev}
    caps_in = torch.zeros(R, **i64) if caps is None else torch.as_tensor(caps, **i64)
    # scratch: cnt [E], bal [R], gift [R], rem [R, epn], recv [R, R], lay_err [R], split, nflow, base, foff,
    # poff [E]; then errpos [1]
    shapes = ((E,), (R,), (R,), (R, E // R), (R, R), (R,), (E,), (E,), (E,), (E,), (E,))
    scratch = [torch.zeros(shape, **i64) for shape in shapes] + [torch.full((1,), NO_ERROR_POS, **i64)]
    counts = T.detach().contiguous().to(torch.int64)
    tables = (out.slots_per_expert, out.alloc, out.send_counts, out.caps, out.donor, out.experts_to_copy)
    tables += (out.cu_seqlens, out.flows, out.pieces, out.totals, out.err)
    args = [counts, caps_in, caps is not None, pad, prev_donor, prev_copy, sticky, *tables, *scratch]
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
    """The slack pass on the host, for ``plan_arrays``.

    Args:
        T: [R, E] int64 counts. slack: (num, k, n), candidate k of n at σ = num / SLACK_DEN.
        prev_donor: [R] int64 and prev_copy: [R, slots] int64 of a sticky plan, or [0] / [0, slots].
    Returns:
        (caps [R] int64, sticky hint [R] int64 (receiver -> donor, -1 = none), prev_copy [R, slots] int64).
    """
    R, E = T.shape
    g = np.ascontiguousarray(T.sum(0).reshape(R, E // R).sum(1), dtype=np.int64)
    sticky = prev_donor.shape[0] == R
    donor_in = prev_donor if sticky else np.full(R, -1, np.int64)
    caps, hint, room = np.zeros(R, np.int64), np.zeros(R, np.int64), np.zeros(R, np.int64)
    num, k, n = slack
    slack_caps(g, num, k, n, donor_in, sticky, caps, hint, room)
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
    """Run the numba-cuda kernels whatever the counts' device: the CPU runs them under numba's CUDA simulator
    (``NUMBA_ENABLE_CUDASIM=1`` set before numba is imported). For tests and for comparing with the CPU kernel;
    ``planner.plan`` picks the kernel by device.

    Args:
        slots_per_expert: [R, E] integer counts (tensor, or anything ``torch.as_tensor`` takes).
        caps, slots_per_rank, token_padding, previous, slack, cost: as ``planner.plan``'s.
        threads: threads a block (default 256 on CUDA, 4 under the simulator).
    Returns:
        The ``TensorPlan`` on the counts' device. Errors are raised.
    """
    import torch  # heavy: torch, only for tensor input

    T = torch.as_tensor(slots_per_expert)
    R, E = T.shape
    slots = E // R if slots_per_rank is None else int(slots_per_rank)
    nt = threads or (GPU_THREADS if T.device.type == "cuda" else SIM_THREADS)
    num = None if slack is None else slack_num(slack)
    return plan_tensor(T, caps, slots, token_padding, previous, False, num, cost, nt)
