"""Agreeing on a call's arguments before its payload moves: the header each rank contributes, and what a difference
between two ranks' headers means.

A header is a small int64 row: status (1 when the call is already bad on this rank), op, dtype, elements per row,
rows in, rows out, src, reduce op, then split sizes per peer (collectives) or the shape (point-to-point). The
headers of the ranks involved are exchanged and compared, so that every one of them raises the same
``ValueError`` naming the difference. Three exchanges carry them:

- a validated collective (``validate=True``) all-gathers them over the group (``agreement.agree``), after
  writing the arrival count that names a rank which never came;
- an unchecked all-to-all (``validate=False``) on tensors whose exchange the host waits for anyway (CPU: gloo, MPI)
  exchanges them too, through host memory and without arrival count or trace record (``gather_on_host``): gloo
  aborts the receiving process (SIGABRT, from its own thread, so nothing can catch it) when a peer sends more
  bytes than it expects, and silently leaves the tail of the receive buffer when fewer, so the sizes must be
  agreed before the payload is posted. On CUDA tensors this would put a host round trip on the hot path, so there
  they are not agreed (the functions' first docstring lines say so);
- a checked ``send``/``recv`` (``validate=True``) swaps them between the two ranks, the lower rank sending first,
  so two ranks that both called ``send`` still finish the swap and are told so.
"""

from __future__ import annotations

import math
from array import array

import torch

from collectives.core import CommunicatorCore

REDUCE_OPS = ("sum", "max", "min", "prod")
OPS = (
    "all_to_all_single",
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "broadcast",
    "split",
    "barrier",
    "send",
    "recv",
)
OP_CODE = {name: i + 1 for i, name in enumerate(OPS)}
DTYPES = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int32,
    torch.int64,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(DTYPES)}
HEADER = 8  # status, op, dtype, row numel, rows in, rows out, src, reduce op; then in/out splits per peer
P2P_DIMS = 8  # shape slots of a point-to-point header; a deeper tensor folds its trailing dims into the last one


def row_numel(t: torch.Tensor) -> int:
    """Elements per row (dim 0); 1 for a 0-d tensor."""
    return math.prod(t.shape[1:])


def rows(t: torch.Tensor) -> int:
    return int(t.shape[0]) if t.dim() > 0 else 1


def call_header(op: str, problem, out, inp, world: int, splits, src: int, reduce_op: str, extra: int) -> list[int]:
    """This rank's header of a collective: ``HEADER + 2 * world`` ints."""
    if problem is None and inp is not None:
        ins, outs = splits if splits is not None else ([0] * world, [0] * world)
        fields = [0, OP_CODE[op], DTYPE_CODE[inp.dtype], row_numel(inp), rows(inp), rows(out), src]
        return fields + [REDUCE_OPS.index(reduce_op), *map(int, ins), *map(int, outs)]
    return [0 if problem is None else 1, OP_CODE[op], 0, 0, 0, 0, src, extra] + [0] * (2 * world)


def gather_on_host(comm: CommunicatorCore, mine: list[int], timeout: float) -> list[list[int]]:
    """Every rank's header, for an unchecked all-to-all of host tensors: an all-to-all that sends ``mine`` to each
    peer (an all-gather in effect; gloo's all-to-all is the cheaper of the two), through two host buffers held
    here. The tensors are views lent to the backend and the answer is read from the buffer, not through a tensor:
    this runs only where the payload is host memory already (never for CUDA tensors), so it is no device read,
    and a host-read count that lets CPU tensors stand in for GPU ones (``moonep.hostreads``) rightly does not see
    it: on the GPU path this exchange does not happen."""
    w, n = comm.world_size, len(mine)
    sent, got = array("q", mine * w), array("q", bytes(8 * w * n))
    sent_t, got_t = (torch.frombuffer(buf, dtype=torch.int64).view(w, n) for buf in (sent, got))
    comm._all_to_all_single(got_t, sent_t, [1] * w, [1] * w, timeout)
    return [got[r * n : (r + 1) * n].tolist() for r in range(w)]


def _dtype_name(code: int) -> str:
    return str(DTYPES[code - 1]) if 0 < code <= len(DTYPES) else f"code {code}"


def _differing_column(table: list[list[int]], names) -> str | None:
    """The first of dtype, elements per row and reduce op on which the headers in ``table`` (one list per rank)
    differ, said with values; ``names[i]`` is how row i's rank is named."""
    for col, what in ((2, "dtype"), (3, "elements per row"), (7, "reduce op")):
        values = [row[col] for row in table]
        if len(set(values)) > 1:
            if col == 2:  # names, not the header's internal codes
                values = [_dtype_name(c) for c in values]
            elif col == 7:
                values = [REDUCE_OPS[c] if 0 <= c < len(REDUCE_OPS) else f"code {c}" for c in values]
            return f"ranks disagree on {what}: " + ", ".join(f"rank {r} {v}" for r, v in zip(names, values))
    return None


def header_problem(op: str, table: list[list[int]]) -> str | None:
    """What the exchanged headers of one collective (``table[r]``: rank r's) disagree on, else None."""
    w = len(table)
    bad = [r for r in range(w) if table[r][0] != 0]
    if bad:
        return f"rank {bad[0]} passed invalid arguments (its own error says which); no data was exchanged"
    ops = [row[1] for row in table]
    if len(set(ops)) > 1:
        names = {r: OPS[c - 1] for r, c in enumerate(ops)}
        return f"ranks called different collectives at the same time: {names}"
    if op == "split":
        return None
    differing = _differing_column(table, range(w))
    if differing:
        return differing
    column = {c: [row[c] for row in table] for c in (4, 6)}
    if op == "all_to_all_single":
        ins, outs = [row[HEADER : HEADER + w] for row in table], [row[HEADER + w :] for row in table]
        pair = next(((i, j) for i in range(w) for j in range(w) if ins[i][j] != outs[j][i]), None)
        if pair is not None:
            i, j = pair
            return (
                f"split sizes do not match across ranks: rank {i} sends {ins[i][j]} rows to rank {j}, "
                f"which expects {outs[j][i]}"
            )
    elif op in ("all_gather", "reduce_scatter") and len(set(column[4])) > 1:
        return f"ranks disagree on inp rows: {column[4]}"
    elif op in ("all_reduce", "broadcast") and len(set(column[4])) > 1:
        return f"ranks disagree on tensor rows: {column[4]}"
    if op == "broadcast" and len(set(column[6])) > 1:
        return f"ranks disagree on src: {column[6]}"
    return None


# ------------------------------------------------------------------------------------------- point-to-point
def p2p_header(op: str, tensor, problem: str | None) -> torch.Tensor:
    """This rank's header of a checked ``send``/``recv``: the collective layout with the shape after it."""
    mine = torch.zeros(HEADER + P2P_DIMS, dtype=torch.int64)
    mine[:2] = torch.tensor([0 if problem is None else 1, OP_CODE[op]])
    if problem is None:
        shape = list(tensor.shape)
        if len(shape) > P2P_DIMS:
            shape = shape[: P2P_DIMS - 1] + [math.prod(shape[P2P_DIMS - 1 :])]
        mine[2:6] = torch.tensor([DTYPE_CODE[tensor.dtype], row_numel(tensor), rows(tensor), tensor.dim()])
        mine[HEADER : HEADER + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    return mine


def _shape(row: list[int]) -> tuple[int, ...]:
    return tuple(row[HEADER : HEADER + min(row[5], P2P_DIMS)])


def p2p_problem(header: torch.Tensor, ranks: tuple[int, int]) -> str | None:
    """What the swapped headers ``[2, HEADER + P2P_DIMS]`` of ``ranks`` (lower rank first) disagree on, else None."""
    table = header.tolist()
    bad = [ranks[i] for i in range(2) if table[i][0] != 0]
    if bad:
        return f"rank {bad[0]} passed invalid arguments (its own error says which); nothing was sent"
    ops = [OPS[row[1] - 1] for row in table]
    if ops[0] == ops[1]:
        return f"ranks {ranks[0]} and {ranks[1]} both called {ops[0]}: a send pairs with a recv on the peer"
    at = 0 if ops[0] == "send" else 1  # the sender's row
    sender, receiver = table[at], table[1 - at]
    said = (f"rank {ranks[at]} sends", f"rank {ranks[1 - at]} receives into")
    if sender[2] != receiver[2]:
        return (
            f"send and recv disagree on dtype: {said[0]} {_dtype_name(sender[2])}, {said[1]} {_dtype_name(receiver[2])}"
        )
    if _shape(sender) != _shape(receiver):
        return f"send and recv disagree on shape: {said[0]} {_shape(sender)}, {said[1]} {_shape(receiver)}"
    return None


def swap_p2p_headers(comm: CommunicatorCore, mine: torch.Tensor, peer: int, timeout: float) -> torch.Tensor:
    """Both headers ``[2, ...]``, lower rank's first, swapped over the pair with the backend's own send/recv.

    The lower rank sends first and the higher one receives first, whatever each of them called, so the swap ends
    even when both called ``send`` (or ``recv``): that mistake is then named instead of left to time out."""
    device = comm._header_device()
    mine = mine.to(device)
    theirs = torch.empty_like(mine)
    if comm.rank < peer:
        comm._send(mine, peer, timeout)
        comm._recv(theirs, peer, timeout)
    else:
        comm._recv(theirs, peer, timeout)
        comm._send(mine, peer, timeout)
    pair = (mine, theirs) if comm.rank < peer else (theirs, mine)
    return torch.stack(pair).cpu()
