"""The header-agreement protocol: before a collective's payload moves, its ranks agree on its arguments.

Each rank first checks its own arguments (``tensor_problem``, ``pair_problem``, ``a2a_problem``, ...: a message,
or None when fine). Then ``agree`` exchanges every rank's header (``peer_checks.call_header``: op, dtype, row size,
split sizes, and whether this rank's arguments were already bad) and compares them, so that a bad argument on one
rank, or two ranks calling different collectives, is the same ``ValueError`` on *every* rank, naming the rank and
the problem, rather than a hang or garbage on the others.

Which calls exchange headers (``agree``):

- a validated collective (``validate=True``, the default; ``split`` always): all-gathered over the group
  (``exchange``), after writing this rank's arrival count, so a timeout in the exchange names the ranks whose
  count is behind, the ones that never reached the call (``name_absent``); traced as ``validate``;
- an unchecked all-to-all (``validate=False``) whose exchange the host waits for anyway (CPU tensors, every
  tensor under MPI: the backend's ``_sizes_agreed_on_host``): through host memory, without arrival count or
  trace record (``peer_checks.gather_on_host`` says why gloo needs it), unless the caller's splits are agreed
  by construction (``splits_agreed=True``);
- everything else unchecked: only this rank's own problem is raised, on this rank alone.

Checked ``send``/``recv`` (both sides ``validate=True``) swap their headers between the two ranks instead
(``p2p_check``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from collectives import peer_checks
from collectives.core import CommunicatorCore
from collectives.errors import CollectiveError
from collectives.peer_checks import DTYPE_CODE, REDUCE_OPS
from collectives.peer_checks import rows as _rows
from collectives.timing import call_timeout, timed


# ------------------------------------------------------------------------------------------- local checks
def check_splits(name: str, splits: Sequence[int], world: int, rows: int) -> list[int] | str:
    """The split list as ints, or a message saying what is wrong with it (length, sign, or sum vs ``rows``)."""
    splits = [int(s) for s in splits]
    if len(splits) != world:
        return f"{name} has {len(splits)} entries, expected world_size={world}"
    if any(s < 0 for s in splits):
        return f"{name} has a negative size: {splits}"
    if sum(splits) != rows:
        return f"{name} sums to {sum(splits)} but the tensor has {rows} rows along dim 0"
    return splits


def even_splits(name: str, world: int, rows: int) -> list[int] | str:
    """Equal parts of ``rows`` for ``world`` ranks, or a message when they do not divide evenly."""
    if rows % world:
        return f"{name} is None, so dim 0 ({rows} rows) must divide evenly by world_size={world}"
    return [rows // world] * world


def _splits(name: str, given: Sequence[int] | None, world: int, rows: int) -> list[int] | str:
    return even_splits(name, world, rows) if given is None else check_splits(name, given, world, rows)


def tensor_problem(t: object, name: str) -> str | None:
    """What makes ``t`` unfit for a collective (not a tensor, unsupported dtype, not contiguous), else None."""
    if not isinstance(t, torch.Tensor):
        return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if t.dtype not in DTYPE_CODE:
        return f"{name} has unsupported dtype {t.dtype}"
    if not t.is_contiguous():
        return f"{name} must be contiguous"
    return None


def pair_problem(out: torch.Tensor, inp: torch.Tensor) -> str | None:
    """What makes ``out`` and ``inp`` unfit as one collective's pair (dtype, device or row shape differ)."""
    problem = tensor_problem(inp, "inp") or tensor_problem(out, "out")
    if problem:
        return problem
    if out.dtype != inp.dtype:
        return f"dtype mismatch: out is {out.dtype}, inp is {inp.dtype}"
    if out.device != inp.device:
        return f"device mismatch: out is on {out.device}, inp is on {inp.device}"
    if out.shape[1:] != inp.shape[1:]:
        return f"row shape mismatch: out rows are {tuple(out.shape[1:])}, inp rows are {tuple(inp.shape[1:])}"
    return None


def shape_problem(t: torch.Tensor, expected: Sequence[int], name: str, rule: str) -> str | None:
    """A message when ``t``'s shape is not ``expected`` (``rule`` says where that comes from), else None."""
    if tuple(t.shape) != tuple(expected):
        return f"{name} has shape {tuple(t.shape)}, expected {tuple(expected)} ({rule})"
    return None


def op_problem(op: str) -> str | None:
    """A message unless ``op`` is one of ``REDUCE_OPS``."""
    return None if op in REDUCE_OPS else f"op must be one of {REDUCE_OPS}, got {op!r}"


def a2a_problem(
    world: int,
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: Sequence[int] | None,
    in_splits: Sequence[int] | None,
) -> tuple[str | None, list[int], list[int]]:
    """This rank's check of an all-to-all: ``(problem, in_splits, out_splits)``, the splits as ints (equal parts
    where None was passed) or all zeros when there is a problem.

    Args:
        world: ranks in the group.
        out: receive buffer ``[sum(out_splits), ...]``.
        inp: send buffer ``[sum(in_splits), ...]``, same dtype, device and row shape as ``out``.
        out_splits: rows received from each rank (None: equal parts of ``out``).
        in_splits: rows sent to each rank (None: equal parts of ``inp``).
    """
    problem = pair_problem(out, inp)
    if problem:
        return problem, [0] * world, [0] * world
    ins = _splits("in_splits", in_splits, world, _rows(inp))
    outs = _splits("out_splits", out_splits, world, _rows(out))
    if isinstance(ins, str):
        return ins, [0] * world, [0] * world
    if isinstance(outs, str):
        return outs, [0] * world, [0] * world
    return None, ins, outs


# ------------------------------------------------------------------------------------------- the exchange
def agree(
    comm: CommunicatorCore,
    op: str,
    problem: str | None,
    out: torch.Tensor | None,
    inp: torch.Tensor | None,
    *,
    splits: tuple[list[int], list[int]] | None = None,
    src: int = 0,
    reduce_op: str = "sum",
    validate: bool | None = None,
    timeout: float | None = None,
    agreed: bool = False,
) -> list[list[int]] | None:
    """Check a collective on every rank; raise the same ``ValueError`` everywhere if any rank's call is bad.

    Args:
        comm: the group the collective runs on.
        op: the collective (``peer_checks.OPS``).
        problem: what is wrong with this rank's own arguments, or None.
        out: the call's output tensor (None for ``barrier``).
        inp: the call's input tensor (None for ``barrier``).
        splits: ``(in_splits, out_splits)`` of an all-to-all, as ints.
        src: ``broadcast``'s source rank.
        reduce_op: the reduction of ``all_reduce`` / ``reduce_scatter``.
        validate: the call's ``validate`` (None: the communicator's default).
        timeout: the call's timeout in seconds (None: the communicator's default).
        agreed: the caller's splits are agreed by construction (``splits_agreed``): no host-side exchange.

    Returns:
        Every rank's header (``world_size`` lists of ``8 + 2 * world_size`` ints) when they were exchanged,
        else None (an unchecked call whose own arguments are fine).
    """
    checked = comm.validate if validate is None else validate
    on_host = not checked and not agreed and op == "all_to_all_single" and comm._sizes_agreed_on_host(inp)
    if not checked and not on_host:
        if problem:
            raise ValueError(f"{op} on rank {comm.rank}: {problem}")
        return None
    return exchange(
        comm, op, problem, out, inp, splits=splits, src=src, reduce_op=reduce_op, timeout=timeout, on_host=on_host
    )


def exchange(
    comm: CommunicatorCore,
    op: str,
    problem: str | None,
    out: torch.Tensor | None,
    inp: torch.Tensor | None,
    *,
    splits: tuple[list[int], list[int]] | None = None,
    src: int = 0,
    reduce_op: str = "sum",
    extra: int = 0,
    timeout: float | None = None,
    on_host: bool = False,
) -> list[list[int]]:
    """Exchange the headers of one call and compare them (``agree``'s arguments; ``extra``: ``split``'s key).

    ``on_host``: the unchecked all-to-all's exchange through host memory, else a validated one. Returns every
    rank's header; raises ``ValueError`` (the same on every rank) when a rank's call is bad or they disagree,
    ``CollectiveError`` naming the ranks that never came when the exchange times out.
    """
    mine = peer_checks.call_header(op, problem, out, inp, comm.world_size, splits, src, reduce_op, extra)
    comm._header_of = op
    try:
        if on_host:
            table = peer_checks.gather_on_host(comm, mine, call_timeout(comm, timeout))
        else:
            table = gather_validated(comm, mine, timeout)
    except CollectiveError as exc:
        raise name_absent(comm, exc, op) from exc
    finally:
        comm._header_of = ""
    if problem:
        raise ValueError(f"{op} on rank {comm.rank}: {problem}")
    disagreement = peer_checks.header_problem(op, table)
    if disagreement:
        raise ValueError(f"{op} on rank {comm.rank}: {disagreement}")
    return table


def gather_validated(comm: CommunicatorCore, mine: list[int], timeout: float | None) -> list[list[int]]:
    """A validated call's header exchange: after the arrival count that names a rank which never comes; traced."""
    comm._validated += 1
    comm._mark_arrival(comm._validated)
    device = comm._header_device()
    header = torch.empty(comm.world_size, len(mine), dtype=torch.int64, device=device)
    row = torch.tensor(mine, dtype=torch.int64).view(1, -1).to(device)
    timed(comm, "validate", header.numel() * 8, comm._all_gather, header, row, timeout)
    return header.cpu().tolist()


def split_members(comm: CommunicatorCore, color: int | None, key: int) -> tuple[list[int], int]:
    """A ``split``'s agreement: every rank's color and key travel in its header (always exchanged).

    Returns:
        ``(members, code)``: this rank's sub-group as group ranks ordered by ``(key, rank)`` (``[]`` for
        ``color=None``) and its color code (-1 for None), which ``Communicator._new_group`` takes.
    """
    problem = None if color is None or int(color) >= 0 else f"color must be >= 0 or None, got {color}"
    code = -1 if color is None else int(color)
    table = exchange(comm, "split", problem, None, None, src=code, extra=key)
    colors, keys = [row[6] for row in table], [row[7] for row in table]
    groups = {
        c: [r for _, r in sorted((k, r) for r, (cc, k) in enumerate(zip(colors, keys)) if cc == c)]
        for c in set(colors)
        if c >= 0
    }
    if not comm.split_can_reorder and any(m != sorted(m) for m in groups.values()):
        raise ValueError(
            f"split on rank {comm.rank}: the {comm.backend} backend orders a sub-group by parent "
            f"rank; a key that reorders ranks is not supported (keys: {keys})"
        )
    return groups.get(code, []), code


def p2p_check(
    comm: CommunicatorCore, tensor: torch.Tensor, peer: int, name: str, validate: bool, timeout: float | None
) -> None:
    """Check a ``send`` (``name="dst"``) or ``recv`` (``name="src"``) of ``tensor`` with group rank ``peer``.

    A bad peer fails here alone (there is no partner to tell); with ``validate`` the two ranks swap headers
    first, so a bad tensor or a disagreement on dtype or shape is the same ``ValueError`` on both.
    """
    op = "send" if name == "dst" else "recv"
    problem = tensor_problem(tensor, "tensor")
    if not 0 <= peer < comm.world_size or peer == comm.rank:
        where = "this rank itself" if peer == comm.rank else f"not a rank of this group (world_size={comm.world_size})"
        raise ValueError(f"{op} on rank {comm.rank}: {name}={peer} is {where}")
    if validate:
        header = peer_checks.p2p_header(op, tensor, problem)
        both = peer_checks.swap_p2p_headers(comm, header, peer, call_timeout(comm, timeout))
        problem = problem or peer_checks.p2p_problem(both, (min(comm.rank, peer), max(comm.rank, peer)))
    if problem:
        raise ValueError(f"{op} on rank {comm.rank}: {problem}")


# ------------------------------------------------------------------------------------------- naming absentees
def absent_ranks(comm: CommunicatorCore) -> list[int]:
    """Global ranks whose arrival count is behind ours: they never reached this rank's current validated call
    ([] when the backend keeps no counts)."""
    seen = comm._arrivals()
    if not seen:
        return []
    return [comm.group_ranks[r] for r in range(comm.world_size) if seen.get(r, 0) < comm._validated]


def name_absent(comm: CommunicatorCore, exc: CollectiveError, op: str) -> CollectiveError:
    """``exc`` with the ranks that never reached this call named (their arrival count is behind ours)."""
    absent = absent_ranks(comm)
    if not absent:
        return exc
    return CollectiveError(
        f"{op} on rank {comm.global_rank}: rank(s) {absent} never reached it (stuck or busy before it, or "
        f"dead); the argument header's exchange said: {exc}",
        op=exc.op,
        failed_ranks=sorted(set(exc.failed_ranks) | set(absent)),
    )
