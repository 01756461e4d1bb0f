"""Checks run inside one launched job per (backend, world size); each returns None or a problem string.

Every rank regenerates every rank's inputs from the same seed, so expected values come from naive twins
computed locally (no plan logic): a received row decodes to (source rank, token), its segment names the expert,
and combine's output is checked against the per-token formula. ``tests.distributed.run_checks`` merges all ranks'
verdicts.
"""

from __future__ import annotations

import torch

import moonep
from moonep.buffer import Buffer
from tests.distributed import run_checks

H, EPN = 6, 2


def num_experts(R: int) -> int:
    """E for a world of R ranks: 2 per rank, at least 4 (so K = 3 fits at R = 1)."""
    return max(EPN * R, 4)


def routing(kind: str, R: int, rank: int, s: int, K: int, E: int, seed: int = 0):
    """(hidden [s, H] tagged, topk_weights [s, K], topk_idx [s, K]) for rank ``rank``; deterministic."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if kind == "random":
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)])
    elif kind == "one_expert":  # every slot of every token to expert 0 (duplicates inside a token when K > 1)
        idx = torch.zeros(s, K, dtype=torch.long)
    elif kind == "dup_rank":  # a token's K slots go to distinct experts of one rank (wire dedup)
        base = torch.randint(0, R, (s, 1), generator=g) * (E // R)
        idx = base + torch.arange(K) % (E // R)
    elif kind == "masked":  # random ids with about a third masked (-1)
        idx = torch.randint(0, E, (s, K), generator=g)
        idx[torch.rand(s, K, generator=g) < 0.35] = -1
    elif kind == "skew":  # most slots to the experts of rank 0
        idx = torch.randint(0, E, (s, K), generator=g)
        idx[torch.rand(s, K, generator=g) < 0.7] = 0
    else:
        raise ValueError(kind)
    hidden = torch.randn(s, H, generator=g)
    hidden[:, 0] = rank * 1000 + torch.arange(s)  # tag: source rank and token
    weights = torch.rand(s, K, generator=g) + 0.5
    return hidden, weights, idx


def expert_of_segments(plan, rank: int) -> list[int]:
    """Expert id of each of the [2*epn] segments on ``rank`` (-1 = empty slot)."""
    gp = plan.global_plan
    return list(range(rank * gp.experts_per_rank, (rank + 1) * gp.experts_per_rank)) + gp.experts_to_copy[rank].tolist()


def check_dispatch(
    comm, kind: str, K: int, E: int, tp: int, sizes: list[int], seed: int = 0, static: bool = False
) -> str | None:
    """Dispatch layout, weights, padding, combine, weight gather and plan reuse against naive twins."""
    R, r = comm.world_size, comm.rank
    S = max(sizes)
    buf = Buffer(comm, S=S, H=H, K=K, E=E, token_padding=tp, static_rows=static)
    ins = [routing(kind, R, q, sizes[q], K, E, seed) for q in range(R)]
    x, w, idx = ins[r]
    total = sum(sizes) if len(set(sizes)) > 1 else None
    recv, recv_w, cu, plan = buf.dispatch(x, topk_idx=idx, topk_weights=w, total_num_tokens=total)
    # every collective runs on every rank whatever a local check finds (an early return would desync ranks)
    layout_problem, seen, real = _layout_problem(kind, ins, recv, recv_w, cu, plan, r, K, tp)
    everyone = gather_rows(comm, torch.tensor(sorted(seen), dtype=torch.int64).reshape(-1, 4))
    scale = torch.zeros(recv.shape[0], 1)  # combine twin: expert e multiplies its rows by (e + 1)
    start = 0
    for e, end in zip(expert_of_segments(plan, r), cu.tolist()):
        scale[start:end] = e + 1
        start = end
    out, gw = buf.combine(plan, recv * scale, recv_w)
    again, again_w, cu2, plan2 = buf.redispatch(plan, x * 2, topk_weights=w, zero_copy=True)
    # static receive rows: the routing never changes them (equal token counts: the Buffer's allocation, whose
    # value is checked against MoonEP's worked example in test_moonep.py); they hold the padded layout.
    # Otherwise exactly the padded layout: this rank's last segment end
    if static:
        rows = buf.max_recv_rows if len(set(sizes)) == 1 and sizes[0] == S else plan.recv_rows
    else:
        rows = int(plan.global_plan.cu_seqlens[r, -1])
    if recv.shape != (rows, H) or recv_w.shape != (rows,) or cu.shape != (2 * (E // R),) or int(cu[-1]) > rows:
        return f"{kind}: shapes {tuple(recv.shape)}, {tuple(recv_w.shape)}, {tuple(cu.shape)}; rows={rows}"
    if layout_problem:
        return layout_problem
    # every routed slot arrives exactly once somewhere, and every rank computes its fair share
    want = sorted((q, t, int(e)) for q in range(R) for t in range(sizes[q]) for e in ins[q][2][t] if e >= 0)
    if sorted(tuple(v[:3]) for v in everyone.tolist()) != want:
        return f"{kind}: the union of received slots differs from the routed slots"
    n_valid = len(want)
    if real not in (n_valid // R, -(-n_valid // R)):
        return f"{kind}: rank {r} computes {real} rows, not floor/ceil of {n_valid}/{R}"
    mask = idx >= 0
    want_out = x * ((idx + 1) * mask).sum(1, keepdim=True)  # combine = UNWEIGHTED sum of the K copies
    if not torch.allclose(out, want_out, rtol=1e-6, atol=1e-4):
        return f"{kind}: combine differs from sum_k (e_k + 1) * x by {(out - want_out).abs().max()}"
    if not torch.equal(gw, torch.where(mask, w, torch.zeros_like(w))):
        return f"{kind}: gathered weights differ from topk_weights"
    if plan2 is not plan or not torch.equal(again, recv * 2) or not torch.equal(again_w, recv_w):
        return f"{kind}: plan-reuse dispatch differs from the fresh one"
    # wire dedup: unique rows sent = distinct (token, destination rank) pairs of this rank's slots
    pairs = {(t, d) for (q, t, _, d) in everyone.tolist() if q == r}
    if sum(plan.send_uniq_splits) != len(pairs):
        return f"{kind}: {sum(plan.send_uniq_splits)} unique rows sent, want {len(pairs)} (token, rank) pairs"
    if kind == "dup_rank" and K > 1 and len(pairs) >= int(mask.sum()):
        return f"{kind}: no wire dedup although a token's K experts share a rank"
    return None


def _layout_problem(kind, ins, recv, recv_w, cu, plan, r, K, tp):
    """(problem | None, received (src, token, expert, rank) tuples, real rows) of one rank's receive rows."""
    seen, start, real = [], 0, 0
    for g, (e, end) in enumerate(zip(expert_of_segments(plan, r), cu.tolist())):
        n = int(plan.global_plan.alloc[e, r]) if e >= 0 else 0
        if (end - start) % tp or end - start < n or end - start >= n + tp:
            return f"{kind}: segment {g} (expert {e}) spans {end - start} rows for {n} slots, tp={tp}", seen, real
        for row in range(start, end):
            if row >= start + n:
                if recv[row].abs().sum() or recv_w[row]:
                    return f"{kind}: padding row {row} is not zero", seen, real
                continue
            src, t = divmod(int(recv[row, 0]), 1000)
            ks = [k for k in range(K) if int(ins[src][2][t, k]) == e]
            if not ks or not torch.equal(recv[row], ins[src][0][t]):
                return f"{kind}: row {row} holds (src {src}, token {t}), not routed to expert {e}", seen, real
            if not any(float(recv_w[row]) == float(ins[src][1][t, k]) for k in ks):
                return f"{kind}: row {row} has weight {float(recv_w[row])}, not a slot weight", seen, real
            seen.append((src, t, e, r))
        start, real = end, real + n
    if recv[start:].abs().sum() or recv_w[start:].abs().sum():
        return f"{kind}: tail rows after the last segment are not zero", seen, real
    return None, seen, real


def gather_rows(comm, t: torch.Tensor) -> torch.Tensor:
    """All ranks' [n_r, C] int64 rows, concatenated in rank order (n_r may differ)."""
    n = torch.tensor([t.shape[0]])
    ns = torch.empty(comm.world_size, dtype=torch.int64)
    comm.all_gather(ns, n)
    m = int(ns.max())
    pad = torch.zeros(m, t.shape[1], dtype=torch.int64)
    pad[: t.shape[0]] = t
    out = torch.empty(comm.world_size * m, t.shape[1], dtype=torch.int64)
    comm.all_gather(out, pad)
    return torch.cat([out[i * m : i * m + int(ns[i])] for i in range(comm.world_size)])


def check_weights(comm, E: int) -> str | None:
    """prefetch_weight fills exactly the named slots; reduce_grad sums slot grads home and clears them."""
    R, r, epn = comm.world_size, comm.rank, E // comm.world_size
    buf = Buffer(comm, S=8, H=H, K=2, E=E)
    ins = [routing("skew", R, q, 8, 2, E, 3) for q in range(R)]
    x, w, idx = ins[r]
    _, _, _, plan = buf.dispatch(x, topk_idx=idx, topk_weights=w)

    def tag(e: int) -> torch.Tensor:
        return torch.arange(12.0).reshape(3, 4) + 100 * e

    local = torch.stack([tag(r * epn + j) for j in range(epn)])
    slots = torch.full((epn, 3, 4), -7.0)
    buf.prefetch_weight(plan, [local, local * 2], [slots, slots2 := slots.clone()])
    grads = torch.ones(epn, 3, 4) * (r + 1)
    red = torch.stack([torch.full((3, 4), 10.0 * (r + 1) + b) for b in range(epn)])
    buf.reduce_grad(plan, grads, red)  # before any verdict: every rank must make the same collectives
    table = plan.global_plan.experts_to_copy
    for b, e in enumerate(table[r].tolist()):
        want = tag(e) if e >= 0 else torch.full((3, 4), -7.0)
        if not torch.equal(slots[b], want) or not torch.equal(slots2[b], want * 2 if e >= 0 else want):
            return f"prefetch: slot {b} (expert {e}) holds the wrong weights"
    for j in range(epn):
        e = r * epn + j
        want = float(r + 1) + sum(10.0 * (d + 1) + b for d in range(R) for b in range(epn) if table[d, b] == e)
        if not torch.allclose(grads[j], torch.full((3, 4), want)):
            return f"reduce_grad: expert {e} grad {float(grads[j, 0, 0])}, want {want}"
    for b, e in enumerate(table[r].tolist()):
        if (e >= 0 and red[b].abs().sum()) or (e < 0 and float(red[b, 0, 0]) != 10.0 * (r + 1) + b):
            return f"reduce_grad: slot {b} (expert {e}) not cleared / unused slot touched"
    if R > 1 and plan.global_plan.num_replicas == 0:
        return "skewed routing produced no replicas: the check would be vacuous"
    return None


def check_autograd(comm, kind: str, K: int, E: int) -> str | None:
    """Grads of x and topk_weights through dispatch -> expert side -> combine equal the per-token twin."""
    R, r = comm.world_size, comm.rank
    buf = Buffer(comm, S=10, H=H, K=K, E=E, token_padding=2)
    x, w, idx = routing(kind, R, r, 10, K, E, 5)
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(r)).requires_grad_()
    w = w.clone().requires_grad_()
    recv, recv_w, cu, plan = moonep.dispatch(buf, x, topk_idx=idx, topk_weights=w)
    scale = torch.zeros(recv.shape[0], 1)
    start = 0
    for e, end in zip(expert_of_segments(plan, r), cu.tolist()):
        scale[start:end] = e + 1
        start = end
    out = moonep.combine(buf, plan, recv * scale * recv_w[:, None])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + r))
    (out * g).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    mask = (idx >= 0).float()
    ref = x2 * (w2 * (idx + 1) * mask).sum(1, keepdim=True)
    (ref * g).sum().backward()
    if not torch.allclose(out, ref, rtol=1e-5, atol=1e-5):
        return f"{kind}: forward differs by {(out - ref).abs().max()}"
    if not torch.allclose(x.grad, x2.grad, rtol=1e-5, atol=1e-5):
        return f"{kind}: hidden grad differs by {(x.grad - x2.grad).abs().max()}"
    if not torch.allclose(w.grad, w2.grad, rtol=1e-5, atol=1e-5):
        return f"{kind}: weight grad differs by {(w.grad - w2.grad).abs().max()}"
    return None


def run(comm, checks: tuple[str, ...] = ("dispatch", "weights", "autograd", "moe", "bad")) -> dict:
    """Every selected group of checks; returns the merged verdicts of all ranks."""
    from tests.moonep import battery_moe

    R = comm.world_size
    E = num_experts(R)
    todo: dict = {}
    if "dispatch" in checks:
        for kind in ("random", "one_expert", "dup_rank", "masked", "skew"):
            todo[f"dispatch_{kind}"] = lambda k=kind: check_dispatch(comm, k, 3, E, 1, [7] * R)
        todo["dispatch_padding"] = lambda: check_dispatch(comm, "skew", 2, E, 3, [9] * R, seed=1)
        todo["dispatch_static"] = lambda: check_dispatch(comm, "skew", 2, E, 3, [9] * R, seed=1, static=True)
        todo["dispatch_varlen"] = lambda: check_dispatch(comm, "random", 2, E, 2, [5 + 3 * q for q in range(R)])
        todo["dispatch_k1"] = lambda: check_dispatch(comm, "one_expert", 1, E, 1, [4] * R)
    if "weights" in checks:
        todo["prefetch_reduce"] = lambda: check_weights(comm, E)
    if "autograd" in checks:
        for kind in ("random", "masked", "one_expert"):
            todo[f"autograd_{kind}"] = lambda k=kind: check_autograd(comm, k, 3, E)
    if "moe" in checks:
        todo.update(battery_moe.moe_checks(comm))
    if "bad" in checks:
        todo.update(battery_moe.bad_input_checks(comm))
    return run_checks(comm, todo)
