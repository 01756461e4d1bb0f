"""One launched job per world size running the DeepEP adapter checks (V1 ``Buffer`` and V2 ``ElasticBuffer``),
read by test_deepep_compat.py and test_deepep_v2.py.

The V1 checks follow what DeepEP's own ``tests/legacy/test_intranode.py`` asserts, in our words: the layout against
a Python reference; for BF16 rows valued by their source rank, random rows and FP8 ``(rows, scales)`` pairs, with
and without top-k, fresh dispatch (row count and per-expert counts against all-reduced globals, each source's block
where ``rank_prefix_matrix`` puts it, local ids in range, ``-1`` slots' weights zero, padded ``num_worst_tokens``
outputs), cached-handle dispatch and combine (``combine / ranks visited == x``; combined weights equal to the
original ones). The V2 checks follow ``tests/elastic/test_ep.py``: every received row, id, weight and source index
bitwise equal to a reference built from all-gathered inputs (uneven tokens per rank, masked slots), expanded and
cached layouts, integer-valued combine equal exactly, and the call pattern of torchtitan's DeepEP path.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed

from collectives import launch
from tests.distributed import run_checks

EPN, K, T, H = 3, 3, 11, 256  # local experts, top-k, tokens on rank 0, hidden (two 128-wide FP8 scale blocks)


def routing(rank: int, R: int, tokens: int = T, seed: int = 0):
    """topk_idx [tokens, K] int64 with holes (-1), from random scores as DeepEP's tests draw them."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    scores = torch.rand(tokens, EPN * R, generator=gen) + 1
    idx = scores.topk(K, dim=-1, sorted=False).indices
    idx[::4, -1] = -1
    return idx


def to_fp8(x: torch.Tensor):
    """[n, H] -> (float8_e4m3fn [n, H], fp32 scales [n, H/128]): one scale per 128-wide block of a row."""
    blocks = x.float().view(x.shape[0], -1, 128)
    amax = blocks.abs().amax(-1).clamp(min=1e-4)
    return (blocks * (448.0 / amax[..., None])).to(torch.float8_e4m3fn).view(x.shape[0], -1), amax / 448.0


def from_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (q.float().view(q.shape[0], -1, 128) * scales[..., None]).view(q.shape[0], -1).bfloat16()


def _globals(comm, idx, E):
    """All-reduced tokens per rank [R] and per expert [E], as DeepEP's test computes them."""
    R = comm.world_size
    in_rank = torch.zeros(idx.shape[0], R, dtype=torch.bool)
    for t, row in enumerate(idx.tolist()):
        for e in row:
            if e >= 0:
                in_rank[t, e // EPN] = True
    per_rank = in_rank.sum(0).long()
    per_expert = torch.bincount(idx[idx >= 0], minlength=E).long()
    comm.all_reduce(per_rank)
    comm.all_reduce(per_expert)
    return in_rank, per_rank, per_expert


def _blocks_hold_sources(rows: torch.Tensor, prefix: torch.Tensor, rank: int) -> str | None:
    """Rows valued by their source rank sit in the source's block of ``rank_prefix_matrix``; rows are constant."""
    rows = rows.float()
    if rows.numel() and not torch.equal(rows.amin(1), rows.amax(1)):
        return "a received row is not constant"
    start = 0
    for src in range(prefix.shape[0]):
        end = int(prefix[src, rank])
        if not torch.all(rows[start:end].round() == src):
            return f"rows [{start}, {end}) are not all from rank {src}"
        start = end
    return None


def v1_dispatch_cases(comm) -> str | None:
    """Every (input kind, with/without top-k, sync/async with previous event) dispatch + cached + combine."""
    from moonep.compat import deepep as deep_ep

    R, r = comm.world_size, comm.rank
    buf = deep_ep.Buffer(comm)
    idx, E = routing(r, R), EPN * R
    gen = torch.Generator().manual_seed(7 + r)
    x_rank = torch.full((T, H), float(r), dtype=torch.bfloat16)
    x_rand = torch.randn(T, H, generator=gen).bfloat16()
    w_rank, w_rand = torch.full((T, K), float(r)), torch.randn(T, K, generator=gen)
    in_rank_ref, g_rank, g_expert = _globals(comm, idx, E)
    n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    config = deep_ep.Config(buf.num_sms, 8, 256)
    for kind, x in (("rand", x_rand), ("rank", x_rank), ("fp8", to_fp8(x_rank))):
        for with_topk in (False, True):
            for previous in (False, True):
                case = {
                    "x": x,
                    "num_tokens_per_rank": n_rank,
                    "is_token_in_rank": in_rank,
                    "num_tokens_per_expert": n_expert,
                }
                case.update(config=config, async_finish=previous)
                if with_topk:
                    case.update(topk_idx=idx, topk_weights=w_rand if kind == "rand" else w_rank)
                if previous:
                    case["previous_event"] = buf.capture()
                ctx = {
                    "buf": buf,
                    "r": r,
                    "kind": kind,
                    "x": x_rand if kind == "rand" else x_rank,
                    "idx": idx,
                    "in_rank": in_rank,
                }
                ctx.update(g_rank=g_rank, g_expert=g_expert, w=case.get("topk_weights"), previous=previous)
                problem = _v1_case(case, ctx)
                if problem:
                    return f"{kind}, top-k={with_topk}, async={previous}: {problem}"
    return None


def _v1_case(case: dict, c: dict) -> str | None:
    buf, r, with_topk = c["buf"], c["r"], "topk_idx" in case
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(**case)
    if c["previous"]:
        event.current_stream_wait()
    rows = from_fp8(*recv_x) if isinstance(recv_x, tuple) else recv_x
    if rows.shape[0] != int(c["g_rank"][r]) or rows.device != c["x"].device:
        return f"received {rows.shape[0]} rows on {rows.device}, expected {int(c['g_rank'][r])}"
    if counts != c["g_expert"].view(buf.group_size, -1)[r].tolist():
        return f"per-expert counts {counts} differ from the senders' totals"
    if c["kind"] != "rand" and (problem := _blocks_hold_sources(rows, handle[0], r)):
        return problem
    if with_topk and (problem := _v1_worst(case, recv_x, recv_idx, recv_w, buf)):
        return problem
    if with_topk and (problem := _v1_topk(recv_idx, recv_w, counts, handle, c)):  # refills recv_w's -1 slots
        return problem
    if not with_topk:  # cached dispatch carries no top-k, as in DeepEP
        again = buf.dispatch(case["x"], handle=handle, config=case["config"])
        same = again[0] if not isinstance(again[0], tuple) else torch.cat([a.view(torch.uint8) for a in again[0]], 1)
        first = recv_x if not isinstance(recv_x, tuple) else torch.cat([a.view(torch.uint8) for a in recv_x], 1)
        if not torch.equal(same, first) or again[1:5] != (None, None, None, None):
            return "cached dispatch differs from the fresh one"
    combined, combined_w, _ = buf.combine(rows, handle, topk_weights=recv_w if with_topk else None)
    visits = c["in_rank"].sum(1, keepdim=True).float()
    if not torch.allclose(combined.float() / visits.clamp(min=1), c["x"].float() * (visits > 0), rtol=2e-2, atol=2e-2):
        return "combine(dispatch(x)) / ranks visited != x"
    if with_topk:
        want = c["w"] * (c["idx"] >= 0)  # each weight comes back once, from the rank owning its expert
        if c["kind"] != "rand":
            want = c["w"] * visits  # DeepEP's check: -1 slots refilled with the row's weight, summed per visit
        if not torch.equal(combined_w, want):
            return f"combined weights off (max error {float((combined_w - want).abs().max()):.3g})"
    return None


def _v1_topk(recv_idx, recv_w, counts, handle, c) -> str | None:
    epn = len(counts)
    if ((recv_idx < -1) | (recv_idx >= epn)).any():
        return "recv_topk_idx outside [-1, local experts)"
    if [int((recv_idx == e).sum()) for e in range(epn)] != counts:
        return "recv_topk_idx disagrees with the per-expert counts"
    if not torch.all(recv_w[recv_idx == -1] == 0):
        return "recv_topk_weights not zero where recv_topk_idx == -1"
    if c["kind"] != "rand":  # as DeepEP: fill the -1 slots with the row's max, then every weight is its source rank
        recv_w[recv_idx == -1] = recv_w.amax(1, keepdim=True).expand_as(recv_w)[recv_idx == -1]
        return _blocks_hold_sources(recv_w, handle[0], c["r"])
    return None


def _v1_worst(case, recv_x, recv_idx, recv_w, buf) -> str | None:
    worst = T * buf.group_size
    px, pidx, pw, empty, handle, _ = buf.dispatch(**dict(case, num_worst_tokens=worst, previous_event=None))
    pr = px[0] if isinstance(px, tuple) else px
    first = recv_x[0] if isinstance(recv_x, tuple) else recv_x
    n = first.shape[0]
    if empty != [] or pr.shape[0] != worst or pidx.shape[0] != worst or pw.shape[0] != worst:
        return "num_worst_tokens outputs are not padded to the worst count"
    if not (torch.equal(pr[:n].view(torch.uint8), first.view(torch.uint8)) and torch.equal(pidx[:n], recv_idx)):
        return "num_worst_tokens rows differ from the exact dispatch"
    if not (torch.equal(pw[:n], recv_w) and torch.all(pidx[n:] == -1)):
        return "num_worst_tokens weights differ or padding ids are not -1"
    return None


def v1_surface(comm) -> str | None:
    """Config, SM knobs, events, the handle contract and bad input that must fail on every rank."""
    from moonep.compat import deepep as deep_ep

    buf, R = deep_ep.Buffer(comm, explicitly_destroy=True), comm.world_size
    before = deep_ep.Buffer.num_sms
    deep_ep.Buffer.set_num_sms(24)
    try:
        if deep_ep.Buffer.get_dispatch_config(R).num_sms != 24 or deep_ep.Buffer.get_combine_config(R).num_sms != 24:
            return "configs do not carry set_num_sms"
    finally:
        deep_ep.Buffer.set_num_sms(before)
    for bad in (lambda: deep_ep.Buffer.set_num_sms(5), lambda: deep_ep.Config(3), lambda: deep_ep.Config(0)):
        try:
            bad()
            return "an odd or zero SM count was accepted"
        except ValueError:
            pass
    with buf.capture():  # EventOverlap as a context manager waits on exit
        pass
    idx, E = routing(comm.rank, R), EPN * R
    n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    x = torch.zeros(T, H)
    _, _, _, _, handle, _ = buf.dispatch(x, None, n_rank, None, in_rank, n_expert, idx)
    for call, needle in (
        (lambda: buf.get_dispatch_layout(torch.tensor([[0, E]]), E), "outside"),
        (lambda: buf.get_dispatch_layout(torch.tensor([[0.0, 1.0]]), E), "integer"),
        (lambda: buf.dispatch(x, handle=handle, topk_idx=idx), "takes no topk_idx"),
        (lambda: buf.combine((x, x), handle), "no FP8 input"),
        (lambda: buf.dispatch(x), "fresh dispatch needs"),
        (lambda: buf.dispatch(x, None, n_rank + (comm.rank == 0), None, in_rank, n_expert), "does not match"),
    ):
        try:
            call()
            return f"no error for {needle!r}"
        except ValueError as exc:
            if needle not in str(exc):
                return f"wrong error for {needle!r}: {exc}"
    return None


def v1_layout_and_round_trip(comm) -> str | None:
    """The layout against a Python reference, then experts applying the received weights: combine returns
    2 * x * (sum of the token's weights) on every token."""
    from moonep.compat import deepep as deep_ep

    R, buf = comm.world_size, deep_ep.Buffer(torch.distributed.group.WORLD)  # a ProcessGroup, as DeepEP callers pass
    idx, E = routing(comm.rank, R), EPN * R
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(comm.rank))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(9 + comm.rank))
    in_rank_ref, _, _ = _globals(comm, idx, E)
    n_rank, n_rdma, n_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    if n_rdma is not None or not torch.equal(in_rank, in_rank_ref) or not torch.equal(n_rank, in_rank_ref.sum(0).int()):
        return "layout differs from the Python reference"
    if not torch.equal(n_expert, torch.bincount(idx[idx >= 0], minlength=E).int()):
        return "num_tokens_per_expert differs"
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(x, None, n_rank, None, in_rank, n_expert, idx, weights)
    y = torch.zeros_like(recv_x)
    for k in range(K):
        here = recv_idx[:, k] >= 0
        y[here] += recv_w[here, k : k + 1] * 2 * recv_x[here]
    out, _, _ = buf.combine(y, handle)
    want = 2 * x * (weights * (idx >= 0)).sum(1, keepdim=True)
    return None if torch.allclose(out, want, atol=1e-5) else "weighted expert round trip wrong"


@functools.cache
def job(world_size: int) -> dict:
    return launch(_battery, world_size, timeout=30, job_timeout=240)


def _battery(comm) -> dict:
    from tests.moonep import deepep_v2_checks as v2

    checks = {
        "v1_layout_and_round_trip": lambda: v1_layout_and_round_trip(comm),
        "v1_dispatch": lambda: v1_dispatch_cases(comm),
        "v1_surface": lambda: v1_surface(comm),
    }
    checks.update({name: functools.partial(fn, comm) for name, fn in v2.CHECKS.items()})
    return run_checks(comm, checks)
