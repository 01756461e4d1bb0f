"""Checks that run inside one launched job per (backend, world size); each returns a problem string or None.

Every expected value is computed locally from the same deterministic formulas the senders used, so a check can
fail on any rank. ``run_battery`` returns ``{check name: None | "rank r: what went wrong"}`` gathered from all
ranks, so the pytest side asserts on rank 0's result for every rank.
"""

from __future__ import annotations

import torch

from tests.distributed import run_checks

DTYPES = (torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.float16, torch.int16, torch.bool)


def value(src: int, dst: int, row: int, col: int) -> int:
    return (src * 1000 + dst * 100 + row * 7 + col) % 251


def split(src: int, dst: int, world: int, salt: int) -> int:
    """Rows ``src`` sends to ``dst``: uneven, with zero-length parts (including to itself on some ranks)."""
    return (src * 5 + dst * 3 + salt) % 4


def _rows_for(src: int, dst: int, n: int, width: int, dtype) -> torch.Tensor:
    t = torch.tensor([[value(src, dst, i, c) for c in range(width)] for i in range(n)], dtype=torch.int64)
    t = t.reshape(n, width)
    return (t % 2).to(dtype) if dtype == torch.bool else t.to(dtype)


def check_all_to_all(comm, dtype, salt: int, width: int = 3):
    w, r = comm.world_size, comm.rank
    ins = [split(r, j, w, salt) for j in range(w)]
    outs = [split(i, r, w, salt) for i in range(w)]
    inp = torch.cat([_rows_for(r, j, ins[j], width, dtype) for j in range(w)])
    out = torch.full((sum(outs), width), 0, dtype=dtype)
    comm.all_to_all_single(out, inp, outs, ins)
    want = torch.cat([_rows_for(i, r, outs[i], width, dtype) for i in range(w)])
    if not torch.equal(out, want):
        return f"all_to_all {dtype} salt={salt}: got {out.tolist()} want {want.tolist()}"
    return None


def check_even_all_to_all(comm):
    w, r = comm.world_size, comm.rank
    inp = torch.arange(w * 2 * 4, dtype=torch.float32).reshape(w * 2, 2, 2) + 1000 * r
    out = torch.empty_like(inp)
    comm.all_to_all_single(out, inp)
    want = torch.cat(
        [
            torch.arange(w * 2 * 4, dtype=torch.float32).reshape(w * 2, 2, 2)[2 * r : 2 * r + 2] + 1000 * i
            for i in range(w)
        ]
    )
    return None if torch.equal(out, want) else f"even all_to_all: {out.flatten().tolist()}"


def check_all_gather(comm, dtype):
    w, r = comm.world_size, comm.rank
    inp = _rows_for(r, r, 2, 5, dtype)
    out = torch.empty(2 * w, 5, dtype=dtype)
    comm.all_gather(out, inp)
    want = torch.cat([_rows_for(i, i, 2, 5, dtype) for i in range(w)])
    return None if torch.equal(out, want) else f"all_gather {dtype}: {out.tolist()}"


def check_all_reduce(comm, dtype, op):
    w, r = comm.world_size, comm.rank
    base = torch.tensor([1, 2, 3, 4], dtype=torch.float64)
    per_rank = [base * (i + 1) - 2 * i for i in range(w)]
    t = per_rank[r].to(dtype).clone()
    comm.all_reduce(t, op=op)
    stacked = torch.stack([x.to(dtype).double() for x in per_rank])
    want = {"sum": stacked.sum(0), "max": stacked.max(0).values, "min": stacked.min(0).values, "prod": stacked.prod(0)}[
        op
    ].to(dtype)
    return None if torch.equal(t, want) else f"all_reduce {op} {dtype}: {t.tolist()} want {want.tolist()}"


def check_reduce_scatter(comm):
    w, r = comm.world_size, comm.rank
    inp = torch.arange(3 * w, dtype=torch.float32).reshape(w, 3) * (r + 1)
    out = torch.empty(1, 3)
    comm.reduce_scatter(out, inp)
    want = torch.arange(3 * w, dtype=torch.float32).reshape(w, 3)[r : r + 1] * sum(i + 1 for i in range(w))
    return None if torch.equal(out, want) else f"reduce_scatter: {out.tolist()} want {want.tolist()}"


def check_broadcast(comm):
    for src in range(comm.world_size):
        t = torch.full((3,), float(comm.rank), dtype=torch.bfloat16)
        comm.broadcast(t, src=src)
        if not torch.equal(t, torch.full((3,), float(src), dtype=torch.bfloat16)):
            return f"broadcast from {src}: {t.tolist()}"
    return None


def check_ring(comm):
    w, r = comm.world_size, comm.rank
    if w == 1:
        return None
    mine = torch.full((4,), r, dtype=torch.int64)
    got = torch.empty(4, dtype=torch.int64)
    if r % 2 == 0:  # even ranks send first, odd ranks receive first: no deadlock on any world size
        comm.send(mine, (r + 1) % w)
        comm.recv(got, (r - 1) % w)
    else:
        comm.recv(got, (r - 1) % w)
        comm.send(mine, (r + 1) % w)
    return None if torch.equal(got, torch.full((4,), (r - 1) % w)) else f"ring: got {got.tolist()}"


def check_split(comm):
    w, r = comm.world_size, comm.rank
    members = [i for i in range(w) if i % 2 == r % 2]
    if comm.split_can_reorder:
        sub = comm.split(r % 2, key=-r)  # key reverses the order inside each colour
        want_order = sorted(members, key=lambda i: -i)
    else:
        if w > 2:  # a reordering key (some colour has 2+ ranks) must be refused on every rank, not ignored
            problem = _expect_value_error(lambda: comm.split(r % 2, key=-r), "not supported")
            if problem:
                return problem
        sub = comm.split(r % 2)
        want_order = members
    if sub.world_size != len(members) or sub.rank != want_order.index(r):
        return f"split: size {sub.world_size} rank {sub.rank}, want {len(members)} {want_order.index(r)}"
    if list(sub.group_ranks) != want_order:
        return f"split group_ranks {sub.group_ranks} want {want_order}"
    t = torch.tensor([float(r)])
    sub.all_reduce(t)
    if t.item() != sum(members):
        return f"split all_reduce {t.item()} want {sum(members)}"
    nested = sub.split(0)
    t2 = torch.tensor([1.0])
    nested.all_reduce(t2)
    if t2.item() != len(members):
        return f"nested split all_reduce {t2.item()}"
    none = comm.split(None if r == 0 else 1)
    if (none is None) != (r == 0) or (none is not None and none.world_size != w - 1):
        return f"split(None): got {none}"
    comm.barrier()
    return None


def _expect_value_error(fn, needle: str):
    try:
        fn()
    except ValueError as exc:
        return None if needle in str(exc) else f"ValueError without {needle!r}: {exc}"
    return f"no ValueError (wanted one mentioning {needle!r})"


def check_bad_input(comm):
    """Bad arguments on one rank fail on every rank with a ValueError, and the group keeps working."""
    w, r = comm.world_size, comm.rank
    problems = []
    x = torch.zeros(w, 2)
    bad_splits = [1] * w if r != 0 else [2] + [1] * (w - 1)  # rank 0's do not add up to its rows
    problems.append(
        _expect_value_error(
            lambda: comm.all_to_all_single(x.clone(), x, [1] * w, bad_splits), "rank 0" if r else "in_splits sums to"
        )
    )
    problems.append(
        _expect_value_error(lambda: comm.all_gather(torch.zeros(w, 2, dtype=torch.float64), x[:1]), "dtype mismatch")
    )
    problems.append(
        _expect_value_error(lambda: comm.all_to_all_single(torch.empty(w, 2, device="meta"), x), "device mismatch")
    )
    if w > 1:  # consistent per rank, inconsistent across ranks: only the header exchange can see it
        ins = [0] * w
        ins[(r + 1) % w] = w
        outs = [0] * w
        outs[(r + 1) % w] = w  # wrong: the rows come from r-1, not r+1 (unless w == 2)
        if w > 2:
            problems.append(
                _expect_value_error(
                    lambda: comm.all_to_all_single(torch.zeros(w, 2), x, outs, ins), "split sizes do not match"
                )
            )
        dtype = torch.float32 if r == 0 else torch.float64
        problems.append(
            _expect_value_error(lambda: comm.all_reduce(torch.zeros(2, dtype=dtype)), "ranks disagree on dtype")
        )
    problems.append(_expect_value_error(lambda: comm.all_reduce(x, op="mean"), "op must be one of"))
    problems.append(_expect_value_error(lambda: comm.send(x, w), "dst="))
    problems.append(check_all_to_all(comm, torch.float32, salt=9))  # nothing was exchanged: still consistent
    return "; ".join(p for p in problems if p) or None


def run_battery(comm) -> dict:
    checks = {
        "even_all_to_all": lambda: check_even_all_to_all(comm),
        "reduce_scatter": lambda: check_reduce_scatter(comm),
        "broadcast": lambda: check_broadcast(comm),
        "ring": lambda: check_ring(comm),
        "split": lambda: check_split(comm),
        "bad_input": lambda: check_bad_input(comm),
    }
    for dtype in DTYPES:
        name = str(dtype).replace("torch.", "")
        checks[f"all_to_all_{name}"] = lambda d=dtype: check_all_to_all(comm, d, 0) or check_all_to_all(comm, d, 1)
        checks[f"all_gather_{name}"] = lambda d=dtype: check_all_gather(comm, d)
    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.int64):
        for op in ("sum", "max", "min", "prod"):
            checks[f"all_reduce_{op}_{str(dtype).replace('torch.', '')}"] = lambda d=dtype, o=op: check_all_reduce(
                comm, d, o
            )
    return run_checks(comm, checks, limit=4)
