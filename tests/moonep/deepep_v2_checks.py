"""V2 ``ElasticBuffer`` checks run inside deepep_battery's launched job (see its docstring)."""

from __future__ import annotations

import torch

from tests.moonep.deepep_battery import EPN, H, K, T, routing, to_fp8

C = T + 2  # num_max_tokens_per_rank: every rank's token count is at most this; rank r has T - r tokens


def _inputs(rank: int, R: int):
    tokens = max(1, T - rank)  # uneven, as DeepEP's V2 test sends num_tokens - rank
    idx = routing(rank, R, tokens, seed=1)
    gen = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    w = torch.rand(tokens, K, generator=gen).masked_fill_(idx < 0, 0)
    return x, idx, w


def _gather(comm, t: torch.Tensor) -> torch.Tensor:
    """[n, ...] on every rank -> [R, C, ...] (zero padded to C rows)."""
    padded = torch.zeros(C, *t.shape[1:], dtype=t.dtype)
    padded[: t.shape[0]] = t
    out = torch.empty(comm.world_size * C, *t.shape[1:], dtype=t.dtype)
    comm.all_gather(out, padded)
    return out.view(comm.world_size, C, *t.shape[1:])


def _reference(comm, x, idx, w) -> dict:
    """What this rank receives: every source's tokens with an expert here, by source rank then token."""
    R, r = comm.world_size, comm.rank
    q, scales = to_fp8(x)
    gx, gq, gs = _gather(comm, x), _gather(comm, q.view(torch.uint8)), _gather(comm, scales)
    gidx, gw, gT = _gather(comm, idx), _gather(comm, w), _gather(comm, torch.tensor([[x.shape[0]]]))
    keep = {"x": [], "q": [], "s": [], "idx": [], "w": [], "src": []}
    for s in range(R):
        for t in range(int(gT[s, 0, 0])):
            mine = (gidx[s, t] >= r * EPN) & (gidx[s, t] < (r + 1) * EPN)
            if mine.any():
                keep["x"].append(gx[s, t]), keep["q"].append(gq[s, t]), keep["s"].append(gs[s, t])
                keep["idx"].append(torch.where(mine, gidx[s, t] - r * EPN, -1)), keep["w"].append(gw[s, t] * mine)
                keep["src"].append(torch.tensor(s * C + t))
    ref = {k: torch.stack(v) if v else None for k, v in keep.items()}
    ref["per_source"] = [sum(1 for v in keep["src"] if int(v) // C == s) for s in range(R)]
    ref["counts"] = torch.bincount(ref["idx"][ref["idx"] >= 0], minlength=EPN) if ref["idx"] is not None else None
    return ref


def _align(counts: torch.Tensor, a: int) -> torch.Tensor:
    return -(-counts // a) * a


def compact(comm) -> str | None:
    """Compact dispatch, BF16 and FP8, alignment 1 and 4, with and without handle copies: bitwise vs reference."""
    from moonep.compat.deepep_v2 import ElasticBuffer

    x, idx, w = _inputs(comm.rank, comm.world_size)
    ref = _reference(comm, x, idx, w)
    buf = ElasticBuffer(comm, num_max_tokens_per_rank=C, hidden=H, num_topk=K)
    for fp8, a, copy in ((False, 1, True), (True, 4, False), (False, 4, True)):
        stats = torch.zeros(EPN, dtype=torch.int32)
        recv_x, recv_idx, recv_w, h, event = buf.dispatch(
            to_fp8(x) if fp8 else x, topk_idx=idx, topk_weights=w, num_experts=EPN * comm.world_size,
            expert_alignment=a, do_handle_copy=copy, cumulative_local_expert_recv_stats=stats,
        )  # fmt: skip
        event.current_stream_wait()
        if fp8:
            ok_x = torch.equal(recv_x[0].view(torch.uint8), ref["q"]) and torch.equal(recv_x[1], ref["s"])
        else:
            ok_x = torch.equal(recv_x, ref["x"])
        if not (ok_x and torch.equal(recv_idx, ref["idx"]) and torch.equal(recv_w, ref["w"])):
            return f"fp8={fp8}: received rows / ids / weights differ from the reference"
        if not torch.equal(h.recv_src_metadata[:, 0], ref["src"]) or h.num_recv_tokens != ref["x"].shape[0]:
            return "recv_src_metadata[:, 0] is not the source's global token index"
        if h.psum_num_recv_tokens_per_scaleup_rank.tolist() != torch.tensor(ref["per_source"]).cumsum(0).tolist():
            return "psum_num_recv_tokens_per_scaleup_rank differs"
        aligned = _align(ref["counts"], a)
        if h.num_recv_tokens_per_expert_list != aligned.tolist() or not torch.equal(stats.long(), ref["counts"]):
            return f"alignment {a}: per-expert counts {h.num_recv_tokens_per_expert_list}, want {aligned.tolist()}"
        if h.psum_num_recv_tokens_per_expert.tolist() != aligned.cumsum(0).tolist():
            return "psum_num_recv_tokens_per_expert differs"
        if (h.topk_idx.data_ptr() != idx.data_ptr()) != copy or not torch.equal(h.topk_idx, idx):
            return f"do_handle_copy={copy} not honoured"
    return None


def expanded(comm) -> str | None:
    """do_expand=True: expert-major segments aligned to 4 with zero padding, one weight per row; cached expand."""
    from moonep.compat.deepep_v2 import ElasticBuffer

    x, idx, w = _inputs(comm.rank, comm.world_size)
    ref = _reference(comm, x, idx, w)
    buf, E = ElasticBuffer(comm, num_max_tokens_per_rank=C), EPN * comm.world_size
    ex, ex_idx, ex_w, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=4,
                                          do_expand=True)  # fmt: skip
    aligned = _align(ref["counts"], 4)
    if ex_idx is not None or ex.shape[0] != int(aligned.sum()) or h.num_expanded_tokens != ex.shape[0]:
        return f"expanded output has {ex.shape[0]} rows (ids {ex_idx is not None}), want {int(aligned.sum())}"
    start = 0
    for e in range(EPN):
        rows, k = (ref["idx"] == e).nonzero(as_tuple=True)
        n = rows.numel()
        if not torch.equal(ex[start : start + n], ref["x"][rows]) or not torch.equal(
            ex_w[start : start + n], ref["w"][rows, k]
        ):
            return f"expert {e}'s segment differs from the reference rows"
        if ex[start + n : start + int(aligned[e])].any() or int(h.psum_num_recv_tokens_per_expert[e]) != start + n:
            return f"expert {e}: padding not zero or psum not start + count"
        start += int(aligned[e])
    slots = h.recv_src_metadata[:, 2:]
    rows = torch.arange(slots.shape[0])[:, None].expand_as(slots)
    if not torch.equal(ex[slots[slots >= 0]], ref["x"][rows[slots >= 0]]):
        return "recv_src_metadata[:, 2:] does not point at each slot's expanded row"
    again, _, again_w, _, _ = buf.dispatch(x, topk_weights=w, handle=h, do_expand=True, do_zero_padding=True)
    return None if torch.equal(again, ex) and torch.equal(again_w, ex_w) else "cached expanded dispatch differs"


def cached(comm) -> str | None:
    from moonep.compat.deepep_v2 import ElasticBuffer

    x, idx, w = _inputs(comm.rank, comm.world_size)
    buf = ElasticBuffer(comm, num_max_tokens_per_rank=C)
    recv_x, recv_idx, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=EPN * comm.world_size)
    again_x, again_idx, again_w, again_h, _ = buf.dispatch(x, handle=h)
    if not (torch.equal(again_x, recv_x) and torch.equal(again_idx, recv_idx)) or again_w is not None:
        return "cached dispatch differs from the fresh one"
    return None if again_h is h else "cached dispatch did not return its handle"


def _g(src_global: torch.Tensor, k: int) -> torch.Tensor:
    """Small integers per (token, slot), times a pattern over H: sums stay exact in BF16."""
    return ((src_global * 7 + k) % 5 + 1).view(-1, 1).float() * (torch.arange(H) % 3 + 1).float()


def combine(comm) -> str | None:
    """Integer-valued expert outputs, compact and expanded: combine equals the per-token sum exactly (+ biases)."""
    from moonep.compat.deepep_v2 import ElasticBuffer

    x, idx, w = _inputs(comm.rank, comm.world_size)
    buf, E, mine = ElasticBuffer(comm, num_max_tokens_per_rank=C), EPN * comm.world_size, comm.rank * C
    gen = torch.Generator().manual_seed(3 + comm.rank)
    b1, b2 = (torch.randint(-4, 5, (x.shape[0], H), generator=gen).bfloat16() for _ in range(2))
    want = sum(_g(mine + torch.arange(x.shape[0]), k) * (idx[:, k : k + 1] >= 0) for k in range(K))
    recv_x, recv_idx, recv_w, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    src = h.recv_src_metadata[:, 0]
    y = sum(_g(src, k) * (recv_idx[:, k : k + 1] >= 0) for k in range(K)).bfloat16()
    out, cw, _ = buf.combine(y, h, topk_weights=recv_w, bias=b1)
    if not torch.equal(out, (want + b1.float()).bfloat16()) or not torch.equal(cw, w):
        return "compact combine: sum or combined weights differ"
    ex, _, ex_w, eh, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=2, do_expand=True
    )
    per_slot = torch.zeros(ex.shape[0], H)
    slots = eh.recv_src_metadata[:, 2:]
    for k in range(K):
        here = slots[:, k] >= 0
        per_slot[slots[here, k]] = _g(src[here], k)
    out, cw, _ = buf.combine(per_slot.bfloat16(), eh, topk_weights=ex_w, bias=(b1, b2))
    if not torch.equal(out, (want + b1.float() + b2.float()).bfloat16()) or not torch.equal(cw, w):
        return "expanded combine: sum or combined weights differ"
    return None


def _dot(comm, a: torch.Tensor, b: torch.Tensor) -> float:
    total = (a.double() * b.double()).sum().view(1)
    comm.all_reduce(total)
    return float(total)


def torchtitan_pattern(comm) -> str | None:
    """torchtitan's calls (size hint, buffer, dispatch, combine as dispatch's backward, async combine, cached
    dispatch as combine's backward); combine must be dispatch's adjoint: <dispatch(x), y> == <x, combine(y)>."""
    from moonep.compat.deepep_v2 import ElasticBuffer

    x, idx, w = _inputs(comm.rank, comm.world_size)
    x, E = x.float(), EPN * comm.world_size
    size = ElasticBuffer.get_buffer_size_hint(comm, C, H, num_topk=K, use_fp8_dispatch=False)
    buf = ElasticBuffer(comm, num_bytes=size, num_max_tokens_per_rank=C, hidden=H, num_topk=K, explicitly_destroy=True)
    if buf.num_bytes < size:
        return "the buffer is smaller than its own size hint"
    num_sms = buf.get_theoretical_num_sms(E, K)
    recv_x, recv_idx, recv_s, h, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=E, num_max_tokens_per_rank=C,
        num_sms=num_sms, do_expand=False, do_cpu_sync=True,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(11 + comm.rank)
    y, gs = torch.randn(recv_x.shape, generator=gen), torch.randn(recv_s.shape, generator=gen)
    gs = gs * (recv_idx >= 0)  # a slot of another rank's expert never reaches an output here: no gradient
    grad_x, grad_s, _ = buf.combine(y, handle=h, topk_weights=gs)
    if (
        abs(_dot(comm, recv_x, y) - _dot(comm, x, grad_x)) > 1e-3
        or abs(_dot(comm, recv_s, gs) - _dot(comm, w, grad_s)) > 1e-3
    ):
        return "combine is not the adjoint of dispatch"
    out, _, event = buf.combine(y, handle=h, topk_weights=None, async_with_compute_stream=True)
    event.current_stream_wait()
    g = torch.randn(out.shape, generator=gen)
    back, *_ = buf.dispatch(g, handle=h, num_sms=h.num_sms, do_cpu_sync=False)
    if abs(_dot(comm, out, g) - _dot(comm, y, back)) > 1e-3:
        return "the cached dispatch is not the adjoint of combine"
    return None


def errors(comm) -> str | None:
    """Bad calls raise a ValueError naming the problem (on every rank: each is symmetric or checked after the
    layout all-gather)."""
    from moonep.compat.deepep_v2 import ElasticBuffer

    x, idx, w = _inputs(comm.rank, comm.world_size)
    buf, E = ElasticBuffer(comm, num_max_tokens_per_rank=C), EPN * comm.world_size
    _, _, _, h, _ = buf.dispatch(x, topk_idx=idx, num_experts=E)
    for call, needle in (
        (lambda: buf.dispatch(x, topk_idx=idx, num_experts=E, previous_event=buf.capture()), "allocate_on_comm_stream"),
        (lambda: buf.dispatch(x, topk_idx=idx, handle=h), "takes no topk_idx"),
        (lambda: buf.dispatch(x, handle=h, do_cpu_sync=True), "no do_cpu_sync"),
        (lambda: buf.dispatch(x, handle=h, num_experts=E + comm.world_size), "differs from the handle"),
        (lambda: buf.dispatch(x, topk_idx=idx), "needs topk_idx and num_experts"),
        (lambda: buf.dispatch(x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=T - 1), "more than"),
        (lambda: buf.combine((x, x), h), "no FP8 input"),
    ):
        try:
            call()
            return f"no error for {needle!r}"
        except ValueError as exc:
            if needle not in str(exc):
                return f"wrong error for {needle!r}: {exc}"
    return None


CHECKS = {
    "v2_compact": compact,
    "v2_expanded": expanded,
    "v2_cached": cached,
    "v2_combine": combine,
    "v2_torchtitan_pattern": torchtitan_pattern,
    "v2_errors": errors,
}
