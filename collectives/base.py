"""The ``Communicator``: one face over torch.distributed, mpi4py and NVSHMEM.

Every public call takes and returns torch tensors, checks its arguments before any data moves, records itself in
the per-rank trace when tracing is on, and gives up after ``timeout`` seconds with a ``CollectiveError`` instead
of hanging. Backends implement the underscored primitives only (``_all_to_all_single``, ``_all_gather``, ...),
which receive arguments that were already checked.

With ``validate=True`` (the default) each collective first all-gathers a small integer header (operation, dtype,
row size, split sizes, any local problem) so that a bad argument on one rank is reported on *every* rank as a
``ValueError`` naming the rank and the problem, rather than as a hang or garbage on the others. Hot paths whose
splits are consistent by construction (the EP layer, whose splits come from one shared plan) pass
``validate=False`` to skip that header, except an all-to-all on host-waited tensors, which still agrees it
(``peer_checks`` says why and what is left unchecked). ``send``/``recv`` are unchecked unless both sides pass
``validate=True``.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from datetime import timedelta

import torch

from collectives import peer_checks
from collectives.faults import link_delays_from_env
from collectives.peer_checks import DTYPE_CODE, REDUCE_OPS
from collectives.peer_checks import rows as _rows
from collectives.trace import Tracer, tracer_from_env


class CollectiveError(RuntimeError):
    """A collective failed on this rank: it timed out, or a peer died or reported an error."""

    def __init__(self, message: str, *, op: str = "", failed_ranks: Sequence[int] = ()):
        super().__init__(message)
        self.op = op
        self.failed_ranks = tuple(failed_ranks)


def _check_splits(name: str, splits, world: int, rows: int) -> list[int] | str:
    """Returns the split list, or a message saying what is wrong with it."""
    splits = [int(s) for s in splits]
    if len(splits) != world:
        return f"{name} has {len(splits)} entries, expected world_size={world}"
    if any(s < 0 for s in splits):
        return f"{name} has a negative size: {splits}"
    if sum(splits) != rows:
        return f"{name} sums to {sum(splits)} but the tensor has {rows} rows along dim 0"
    return splits


def _even_splits(name: str, world: int, rows: int) -> list[int] | str:
    if rows % world:
        return f"{name} is None, so dim 0 ({rows} rows) must divide evenly by world_size={world}"
    return [rows // world] * world


class Pending:
    """A started collective (``Communicator.all_to_all_single_start``): ``wait()`` finishes it; later calls do
    nothing. Until then its output is undefined and its input must stay untouched."""

    def __init__(self, finish=None) -> None:
        self._finish = finish

    def wait(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


class Communicator(abc.ABC):
    """A group of ranks that exchange torch tensors.

    Attributes:
        rank: this process's index in the group, ``0 <= rank < world_size``.
        world_size: number of ranks in the group.
        group_ranks: global (world) rank of each member, indexed by group rank.
        timeout: default seconds any call may take before it raises ``CollectiveError``.
        validate: exchange a small header before each collective so bad input fails on every rank.
    """

    backend: str = "abstract"
    split_can_reorder: bool = True
    """Whether ``split``'s ``key`` may order a sub-group differently from parent rank order."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        group_ranks: Sequence[int],
        *,
        timeout: float = 60.0,
        validate: bool = True,
        tracer: Tracer | None = None,
        global_rank: int | None = None,
    ):
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        self.rank = rank
        self.world_size = world_size
        self.group_ranks = tuple(int(r) for r in group_ranks)
        self.timeout = float(timeout)
        self.validate = validate
        self.global_rank = self.group_ranks[rank] if global_rank is None else global_rank
        self.tracer = tracer if tracer is not None else tracer_from_env(self.global_rank)
        if self.tracer is not None and self.tracer.world_size is None and self.group_ranks == tuple(range(world_size)):
            self.tracer.world_size = world_size  # the world communicator comes first; sub-groups never set it
        self.link_delays = link_delays_from_env()  # {(src, dst) global ranks: seconds}; empty = no injection
        self._validated = 0  # validated calls entered on this group (``_mark_arrival``)
        self._header_of = ""  # the op whose argument header is being exchanged (names it in a backend's timeout)

    # ---------------------------------------------------------------- backend primitives (checked input)
    @abc.abstractmethod
    def _all_to_all_single(self, out, inp, out_splits: list[int], in_splits: list[int], timeout: float): ...

    @abc.abstractmethod
    def _all_gather(self, out, inp, timeout: float): ...

    @abc.abstractmethod
    def _all_reduce(self, tensor, op: str, timeout: float): ...

    @abc.abstractmethod
    def _reduce_scatter(self, out, inp, op: str, timeout: float): ...

    @abc.abstractmethod
    def _broadcast(self, tensor, src: int, timeout: float): ...

    @abc.abstractmethod
    def _barrier(self, timeout: float): ...

    @abc.abstractmethod
    def _send(self, tensor, dst: int, timeout: float): ...

    @abc.abstractmethod
    def _recv(self, tensor, src: int, timeout: float): ...

    @abc.abstractmethod
    def _new_group(self, members: list[int], color: int) -> Communicator:
        """Sub-communicator over ``members`` (group ranks of self, in new-rank order).

        Called on every rank of ``self``; ranks that are not members get ``members == []`` and return ``None``.
        """

    def _header_device(self) -> torch.device:
        """Where the validation header lives (a backend whose group only moves CUDA tensors overrides this)."""
        return torch.device("cpu")

    @property
    def device(self) -> torch.device:
        """Where this group's data lives by default: the device an EP ``Buffer`` over it allocates on.

        CPU unless the backend moves CUDA tensors (NCCL in the group, NVSHMEM): then the current CUDA device.
        """
        return torch.device("cpu")

    def close(self) -> None:
        """Release backend resources of this communicator (collective over the group where the backend needs it)."""
        if self.tracer is not None:
            self.tracer.close()

    def report_failure(self, message: str) -> None:
        """Tell peers that this rank failed, so their timeouts can name it. Best effort; backends may ignore."""

    def _mark_arrival(self, count: int) -> None:
        """Record that this rank entered its ``count``-th validated call on this group (where peers can read it
        after a timeout). Best effort; backends without a shared store ignore it."""

    def _arrivals(self) -> dict[int, int] | None:
        """``{group rank: validated calls entered}`` as recorded by ``_mark_arrival``; None when unknown."""
        return None

    def _absent_ranks(self) -> list[int]:
        """Global ranks whose arrival count is behind ours: they never reached this rank's current validated call
        ([] when unknown)."""
        seen = self._arrivals()
        if not seen:
            return []
        return [self.group_ranks[r] for r in range(self.world_size) if seen.get(r, 0) < self._validated]

    def _name_absent(self, exc: CollectiveError, op: str) -> CollectiveError:
        """``exc`` with the ranks that never reached this call named (their arrival count is behind ours)."""
        absent = self._absent_ranks()
        if not absent:
            return exc
        return CollectiveError(
            f"{op} on rank {self.global_rank}: rank(s) {absent} never reached it (stuck or busy before it, or "
            f"dead); the argument header's exchange said: {exc}",
            op=exc.op,
            failed_ranks=sorted(set(exc.failed_ranks) | set(absent)),
        )

    # ---------------------------------------------------------------- public API
    def all_to_all_single(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: Sequence[int] | None = None,
        in_splits: Sequence[int] | None = None,
        *,
        timeout: float | None = None,
        validate: bool | None = None,
        splits_agreed: bool = False,
    ) -> torch.Tensor:
        """Exchange rows among ranks; unchecked on CUDA over NCCL/NVSHMEM, a peer's different splits go UNDETECTED.

        ``inp[rows for peer j]`` goes to peer j, peer i's rows land in ``out`` in rank order.
        ``inp [sum(in_splits), ...]``, ``out [sum(out_splits), ...]``; splits count rows along dim 0 and default
        to equal parts. ``in_splits[j]`` on rank i must equal ``out_splits[i]`` on rank j. Returns ``out``.
        ``timeout`` and ``validate`` override the communicator's defaults for this call (every collective).
        Unchecked (``validate=False``), the header is still exchanged wherever the host waits for the exchange
        anyway (CPU tensors, and every tensor under MPI), only without the arrival count and its trace record: a
        peer's different split sizes, dtype or row size is then the same ``ValueError`` on every rank instead of
        garbage or a gloo abort (``peer_checks``). On CUDA tensors over NCCL or NVSHMEM that would put a host round
        trip on the hot path, so nothing is checked there: a mismatch gives garbage or a hang until the timeout.
        ``splits_agreed=True`` (with ``validate=False``): the caller's split sizes come from data every rank already
        agreed on (a shared plan, counts this exchange's peers sent), so they cannot disagree: that round trip is
        skipped too (the EP layer's exchanges; on gloo it costs about 0.35 ms a call).
        """
        problem, ins, outs = self._local_a2a_problem(out, inp, out_splits, in_splits)
        self._agree(
            "all_to_all_single", problem, out, inp, splits=(ins, outs), validate=validate, timeout=timeout,
            agreed=splits_agreed,
        )  # fmt: skip
        delay = self._link_delay(j for j, n in enumerate(ins) if n) if self.link_delays else 0.0
        return self._timed(
            "all_to_all_single",
            inp.numel() * inp.element_size(),
            self._all_to_all_single,
            out,
            inp,
            outs,
            ins,
            timeout,
            delay=delay,
        )

    def all_to_all_single_start(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        *,
        timeout: float | None = None,
        splits_agreed: bool = False,
    ) -> Pending:
        """Start ``all_to_all_single`` and return; on CUDA via NCCL/NVSHMEM a peer's different splits go UNDETECTED.

        The hot-path form, checked like an unchecked ``all_to_all_single`` (sizes agreed before anything is posted,
        except on CUDA over NCCL or NVSHMEM). The caller can start another exchange or compute before ``wait()``.
        Every rank must start the same collectives in the same order. Backends without asynchronous collectives
        run it here and return a finished ``Pending``; torch.distributed (gloo, NCCL) and MPI overlap it.
        ``timeout`` bounds the size agreement and the wait; ``splits_agreed``: as in ``all_to_all_single``."""
        problem, ins, outs = self._local_a2a_problem(out, inp, out_splits, in_splits)
        self._agree(
            "all_to_all_single", problem, out, inp, splits=(ins, outs), validate=False, timeout=timeout,
            agreed=splits_agreed,
        )  # fmt: skip
        timeout = self.timeout if timeout is None else float(timeout)
        nbytes, t_enter = inp.numel() * inp.element_size(), time.time()
        delay = self._link_delay(j for j, n in enumerate(ins) if n) if self.link_delays else 0.0
        finish = self._start_all_to_all_single(out, inp, outs, ins, timeout)
        if self.tracer is None and not delay:
            return Pending(finish)

        def traced() -> None:
            ok = False
            try:
                time.sleep(delay)  # an injected slow link delays the exchange's completion
                if finish is not None:
                    finish()
                ok = True
            finally:
                if self.tracer is not None:
                    self.tracer.record("all_to_all_single", nbytes, self.group_ranks, t_enter, time.time(), ok)

        return Pending(traced)

    def _start_all_to_all_single(self, out, inp, out_splits: list[int], in_splits: list[int], timeout: float):
        """Backend hook: start the exchange, return a callable that finishes it (None: already done)."""
        self._all_to_all_single(out, inp, out_splits, in_splits, timeout)
        return None

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, *, timeout: float | None = None, validate: bool | None = None
    ) -> torch.Tensor:
        """Concatenate every rank's ``inp [n, ...]`` into ``out [world_size * n, ...]`` in rank order."""
        problem = self._pair_problem(out, inp) or self._shape_problem(
            out, (_rows(inp) * self.world_size, *inp.shape[1:]), "out", "world_size * inp rows"
        )
        self._agree("all_gather", problem, out, inp, validate=validate, timeout=timeout)
        return self._timed("all_gather", out.numel() * out.element_size(), self._all_gather, out, inp, timeout)

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", *, timeout: float | None = None, validate: bool | None = None
    ) -> torch.Tensor:
        """Reduce ``tensor`` over all ranks in place (``op`` in sum, max, min, prod) and return it."""
        problem = self._tensor_problem(tensor, "tensor") or self._op_problem(op)
        self._agree("all_reduce", problem, tensor, tensor, reduce_op=op, validate=validate, timeout=timeout)
        return self._timed("all_reduce", tensor.numel() * tensor.element_size(), self._all_reduce, tensor, op, timeout)

    def reduce_scatter(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        op: str = "sum",
        *,
        timeout: float | None = None,
        validate: bool | None = None,
    ) -> torch.Tensor:
        """Reduce ``inp [world_size * n, ...]`` over ranks; rank r keeps rows ``[r*n, (r+1)*n)`` in ``out [n, ...]``."""
        problem = (
            self._pair_problem(out, inp)
            or self._op_problem(op)
            or self._shape_problem(inp, (_rows(out) * self.world_size, *out.shape[1:]), "inp", "world_size * out rows")
        )
        self._agree("reduce_scatter", problem, out, inp, reduce_op=op, validate=validate, timeout=timeout)
        return self._timed(
            "reduce_scatter", inp.numel() * inp.element_size(), self._reduce_scatter, out, inp, op, timeout
        )

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, *, timeout: float | None = None, validate: bool | None = None
    ) -> torch.Tensor:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor`` (in place) and return it."""
        problem = self._tensor_problem(tensor, "tensor")
        if not 0 <= src < self.world_size:
            problem = problem or f"src={src} is not a rank of this group (world_size={self.world_size})"
        self._agree("broadcast", problem, tensor, tensor, src=src, validate=validate, timeout=timeout)
        return self._timed("broadcast", tensor.numel() * tensor.element_size(), self._broadcast, tensor, src, timeout)

    def barrier(self, *, timeout: float | None = None, validate: bool | None = None) -> None:
        """Wait until every rank of the group has arrived. Validated like every collective: a rank that calls
        another collective meanwhile is named on every rank, and so is a rank that never arrives."""
        self._agree("barrier", None, None, None, validate=validate, timeout=timeout)
        self._timed("barrier", 0, self._barrier, timeout)

    def send(self, tensor: torch.Tensor, dst: int, *, timeout: float | None = None, validate: bool = False) -> None:
        """Send ``tensor`` to group rank ``dst``; UNCHECKED unless both sides pass ``validate=True``.

        Unchecked, a ``recv`` whose size or dtype differs is not detected: a shorter send leaves the tail of the
        receive buffer as it was, another dtype is read as raw bits, and gloo aborts a receiver sent more bytes than
        it expects. ``validate=True`` first swaps a small header (dtype, shape) with the peer, so a difference is the
        same ``ValueError`` on both ranks before any data moves. ``validate`` must be the same on both sides: an
        unchecked peer would take the header for data.
        """
        self._p2p_check(tensor, dst, "dst", validate, timeout)
        delay = self._link_delay([dst]) if self.link_delays else 0.0
        self._timed(
            "send", tensor.numel() * tensor.element_size(), self._send, tensor, dst, timeout, delay=delay, peer=dst
        )

    def recv(
        self, tensor: torch.Tensor, src: int, *, timeout: float | None = None, validate: bool = False
    ) -> torch.Tensor:
        """Receive into ``tensor`` from group rank ``src`` and return it; UNCHECKED unless both pass ``validate=True``.

        The pair of ``send``: see there what goes undetected without ``validate=True``.
        """
        self._p2p_check(tensor, src, "src", validate, timeout)
        self._timed("recv", tensor.numel() * tensor.element_size(), self._recv, tensor, src, timeout, peer=src)
        return tensor

    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """Sub-groups by ``color`` (like ``MPI_Comm_split``): ranks with equal color form a group ordered by
        ``(key, rank)``. Collective over this group; a rank passing ``color=None`` joins none and gets ``None``.
        """
        problem = None if color is None or int(color) >= 0 else f"color must be >= 0 or None, got {color}"
        key = self.rank if key is None else int(key)
        table = self._agree("split", problem, None, None, src=-1 if color is None else int(color), extra=key)
        colors, keys = [row[6] for row in table], [row[7] for row in table]
        groups = {
            c: [r for _, r in sorted((k, r) for r, (cc, k) in enumerate(zip(colors, keys)) if cc == c)]
            for c in set(colors)
            if c >= 0
        }
        if not self.split_can_reorder and any(m != sorted(m) for m in groups.values()):
            raise ValueError(
                f"split on rank {self.rank}: the {self.backend} backend orders a sub-group by parent "
                f"rank; a key that reorders ranks is not supported (keys: {keys})"
            )
        return self._new_group(groups.get(-1 if color is None else int(color), []), -1 if color is None else int(color))

    def inject_link_delay(self, src: int, dst: int, ms: float) -> None:
        """Fault injection: data this rank sends from global rank ``src`` to ``dst`` arrives ``ms`` later."""
        if ms < 0 or src == dst:
            raise ValueError(f"inject_link_delay needs two different ranks and ms >= 0, got {src}->{dst} {ms} ms")
        self.link_delays[(int(src), int(dst))] = ms / 1000.0

    def _link_delay(self, peers) -> float:
        return max((self.link_delays.get((self.global_rank, self.group_ranks[j]), 0.0) for j in peers), default=0.0)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
            f"group_ranks={list(self.group_ranks)})"
        )

    # ---------------------------------------------------------------- checks
    def _tensor_problem(self, t, name: str) -> str | None:
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dtype not in DTYPE_CODE:
            return f"{name} has unsupported dtype {t.dtype}"
        if not t.is_contiguous():
            return f"{name} must be contiguous"
        return None

    def _pair_problem(self, out, inp) -> str | None:
        problem = self._tensor_problem(inp, "inp") or self._tensor_problem(out, "out")
        if problem:
            return problem
        if out.dtype != inp.dtype:
            return f"dtype mismatch: out is {out.dtype}, inp is {inp.dtype}"
        if out.device != inp.device:
            return f"device mismatch: out is on {out.device}, inp is on {inp.device}"
        if out.shape[1:] != inp.shape[1:]:
            return f"row shape mismatch: out rows are {tuple(out.shape[1:])}, inp rows are {tuple(inp.shape[1:])}"
        return None

    @staticmethod
    def _shape_problem(t, expected: tuple, name: str, rule: str) -> str | None:
        if tuple(t.shape) != tuple(expected):
            return f"{name} has shape {tuple(t.shape)}, expected {tuple(expected)} ({rule})"
        return None

    @staticmethod
    def _op_problem(op: str) -> str | None:
        return None if op in REDUCE_OPS else f"op must be one of {REDUCE_OPS}, got {op!r}"

    def _local_a2a_problem(self, out, inp, out_splits, in_splits):
        problem = self._pair_problem(out, inp)
        if problem:
            return problem, [0] * self.world_size, [0] * self.world_size
        w = self.world_size
        ins = (
            _even_splits("in_splits", w, _rows(inp))
            if in_splits is None
            else _check_splits("in_splits", in_splits, w, _rows(inp))
        )
        outs = (
            _even_splits("out_splits", w, _rows(out))
            if out_splits is None
            else _check_splits("out_splits", out_splits, w, _rows(out))
        )
        for bad in (ins, outs):
            if isinstance(bad, str):
                return bad, [0] * w, [0] * w
        return None, ins, outs

    def _p2p_check(self, tensor, peer: int, name: str, validate: bool, timeout: float | None) -> None:
        op = "send" if name == "dst" else "recv"
        problem = self._tensor_problem(tensor, "tensor")
        if not 0 <= peer < self.world_size or peer == self.rank:  # no partner to tell: fail here, alone
            where = (
                "this rank itself" if peer == self.rank else f"not a rank of this group (world_size={self.world_size})"
            )
            raise ValueError(f"{op} on rank {self.rank}: {name}={peer} is {where}")
        if validate:
            timeout = self.timeout if timeout is None else float(timeout)
            header = peer_checks.swap_p2p_headers(self, peer_checks.p2p_header(op, tensor, problem), peer, timeout)
            problem = problem or peer_checks.p2p_problem(header, (min(self.rank, peer), max(self.rank, peer)))
        if problem:
            raise ValueError(f"{op} on rank {self.rank}: {problem}")

    def _agree(
        self,
        op: str,
        problem: str | None,
        out,
        inp,
        *,
        splits=None,
        src: int = 0,
        reduce_op: str = "sum",
        extra: int = 0,
        validate: bool | None = None,
        timeout: float | None = None,
        agreed: bool = False,
    ) -> torch.Tensor | None:
        """Check the call on every rank; raise the same ``ValueError`` everywhere if any rank's call is bad.

        Returns every rank's header (``world_size`` lists of ``8 + 2*world_size`` ints) when they were exchanged.
        An unchecked all-to-all still exchanges them where the host waits for it anyway (``peer_checks``: gloo
        would abort), through host memory and without arrival count or trace record.
        """
        checked = (self.validate if validate is None else validate) or op == "split"
        on_host = not checked and not agreed and op == "all_to_all_single" and self._sizes_agreed_on_host(inp)
        if not checked and not on_host:
            if problem:
                raise ValueError(f"{op} on rank {self.rank}: {problem}")
            return None
        mine = peer_checks.call_header(op, problem, out, inp, self.world_size, splits, src, reduce_op, extra)
        self._header_of = op
        try:
            if on_host:
                table = peer_checks.gather_on_host(self, mine, self.timeout if timeout is None else float(timeout))
            else:
                table = self._gather_validated(mine, timeout)
        except CollectiveError as exc:
            raise self._name_absent(exc, op) from exc
        finally:
            self._header_of = ""
        if problem:
            raise ValueError(f"{op} on rank {self.rank}: {problem}")
        disagreement = peer_checks.header_problem(op, table)
        if disagreement:
            raise ValueError(f"{op} on rank {self.rank}: {disagreement}")
        return table

    def _gather_validated(self, mine: list[int], timeout: float | None) -> list[list[int]]:
        """A validated call's header exchange: after the arrival count that names a rank which never comes; traced."""
        self._validated += 1
        self._mark_arrival(self._validated)
        device = self._header_device()
        header = torch.empty(self.world_size, len(mine), dtype=torch.int64, device=device)
        row = torch.tensor(mine, dtype=torch.int64).view(1, -1).to(device)
        self._timed("validate", header.numel() * 8, self._all_gather, header, row, timeout)
        return header.cpu().tolist()

    def _sizes_agreed_on_host(self, t) -> bool:
        """Whether an unchecked all-to-all of ``t`` agrees its split sizes first: where the host waits for the
        exchange anyway (not CUDA), so that costs one small round trip and no device read."""
        device = t.device if isinstance(t, torch.Tensor) else self.device
        return self.world_size > 1 and device.type != "cuda"

    # ---------------------------------------------------------------- tracing and timeouts
    def _timed(self, op: str, nbytes: int, fn, *args, delay: float = 0.0, peer: int | None = None):
        """Run a primitive with this call's timeout (the last arg), recording it when tracing is on.

        ``delay`` (injected link delay, seconds) is spent inside the op, as a slow link would spend it.
        """
        *head, timeout = args
        timeout = self.timeout if timeout is None else float(timeout)
        if self.tracer is None:
            if delay:
                time.sleep(delay)
            return fn(*head, timeout)
        t_enter = time.time()
        ok = False
        try:
            if delay:
                time.sleep(delay)
            result = fn(*head, timeout)
            ok = True
            return result
        finally:
            self.tracer.record(
                op,
                nbytes,
                self.group_ranks,
                t_enter,
                time.time(),
                ok,
                peer=None if peer is None else self.group_ranks[peer],
            )


def as_timedelta(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)
