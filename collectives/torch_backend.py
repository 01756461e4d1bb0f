"""``torch`` backend: torch.distributed, gloo for CPU tensors and NCCL for CUDA tensors.

Every call is posted with ``async_op=True``; how it is waited on depends on where the tensor lives
(``_blocks_host``):

- CPU tensors (gloo): ``work.wait(timeout=...)`` with this call's timeout, so a dead or stuck peer turns into a
  ``CollectiveError`` after ``timeout`` seconds. The host thread blocks, which is what a CPU collective is.
- CUDA tensors (NCCL): ``work.wait()`` *without* a timeout, which does not block the host: it makes the current
  CUDA stream wait on the NCCL stream, so the collective is stream-ordered like any kernel. (A timeout would make
  ProcessGroupNCCL poll the work from the host until the GPU finished, a host sync on every exchange.) Timeouts
  then come from the process group's own timeout and watchdog (``init_process_group(timeout=...)``, set by
  ``init_torch`` and by ``split`` to the communicator's ``timeout``); a per-call ``timeout`` is not enforced for
  CUDA tensors. When the watchdog or an abort makes the work raise, the ``CollectiveError`` names the op as for
  gloo; with NCCL's default async error handling the watchdog may instead end the process, which
  ``collectives.launch`` then reports as a dead rank. An error can surface at a later wait than the op's own,
  since the host no longer waits for each op to finish.

When a rank fails under ``collectives.launch`` it writes ``moonep/failed/<rank>`` into the rendezvous store; a
timed-out peer reads those keys to name it. Before each validated call's header exchange every member also
writes its count of validated calls on the group (``moonep/arrived/...``), so on a timeout the header exchange
names the ranks whose count is behind: the ones that never arrived (asleep, stuck in other work, or dead).

Groups someone else made: ``from_group(group)`` wraps an existing process group (the trainer's, a DeviceMesh
dimension's) without owning it: ``close()`` leaves it alone. Exit: a gloo process group still alive when the
interpreter finalises can abort the process (SIGABRT, "terminate called without an active exception"): gloo's
``pt_gloo_runloop`` thread may need the GIL after finalisation began, CPython then ends that thread with a forced
unwind, and the unwind through a ``noexcept`` C++ frame calls ``std::terminate``. Plain torch does the same when
``destroy_process_group`` is never called. So the first ``TorchCommunicator`` of a process registers an
``atexit`` hook that destroys torch.distributed's groups (joining those threads) while Python is still whole.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from collectives.base import CollectiveError, Communicator
from collectives.peer_checks import row_numel as _row_numel
from collectives.trace import Tracer, tracer_from_env

_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}
# torch >= 2.13 renamed the tensor collectives; keep one spelling for both.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
FAILED_KEY = "moonep/failed/{}"
ARRIVAL_KEY = "moonep/arrived"
"""Store prefix under which each member of a group records how many validated calls it has entered, so that a
timed-out peer can name the ranks that never arrived."""
_GROUPS_MADE: dict[str, int] = {}


def _movable(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a dtype gloo can move: rows of raw bytes ``[rows, row_bytes]`` for dtypes gloo lacks
    (bf16, fp16, int16, bool); split sizes still count rows."""
    if t.dtype in _GLOO_NATIVE or t.device.type != "cpu":
        return t
    rows = t.shape[0] if t.dim() > 0 else 1
    return t.reshape(rows, _row_numel(t)).view(torch.uint8)


_GLOO_NATIVE = (torch.float32, torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8)


def _blocks_host(tensor: torch.Tensor) -> bool:
    """True when the collective on ``tensor`` is waited for on the host with a bounded ``work.wait(timeout)``
    (CPU tensors: gloo); False for CUDA tensors, whose NCCL work is waited for on the stream (module docstring).
    Anything that is not CUDA (cpu, meta, ...) keeps the bounded host wait: only NCCL is stream-ordered."""
    return tensor.device.type != "cuda"


_exit_hook_registered = False


def _destroy_groups_at_exit() -> None:
    """atexit: destroy every torch.distributed group still alive, before interpreter finalisation (module doc)."""
    if dist.is_available() and dist.is_initialized():
        # exiting anyway; a half-torn-down group must not turn a clean exit into an error
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _register_exit_hook() -> None:
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_destroy_groups_at_exit)
        _exit_hook_registered = True


class TorchCommunicator(Communicator):
    """A ``Communicator`` over a ``torch.distributed`` process group (default group unless ``group`` given).

    It does not own ``group``: ``close()`` destroys only groups this package created (``split``'s, and the world
    group of ``init_torch``). Wrapping someone else's group is ``from_group``.
    """

    backend = "torch"
    split_can_reorder = False  # torch.distributed.new_group numbers members in ascending global rank

    def __init__(
        self, group=None, *, store=None, timeout: float = 60.0, validate: bool = True, tracer: Tracer | None = None
    ):
        if not dist.is_initialized():
            raise RuntimeError(
                "TorchCommunicator needs torch.distributed.init_process_group() first; "
                "use collectives.launch() or collectives.init()"
            )
        self.group = group
        self.store = store
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        super().__init__(
            dist.get_rank(group),
            dist.get_world_size(group),
            list(ranks),
            timeout=timeout,
            validate=validate,
            tracer=tracer,
            global_rank=dist.get_rank(),
        )
        self._has_gloo = "gloo" in str(dist.get_backend(group))
        self.owns_world = False  # set by init_torch: closing the world communicator ends torch.distributed
        self.owns_group = False  # set by split: closing destroys the sub-group
        # Members build the groups over the same ranks in the same order, so (ranks, n-th such group) names this
        # group alike on every member: the store key under which each member records its arrivals.
        key = ",".join(map(str, self.group_ranks))
        _GROUPS_MADE[key] = _GROUPS_MADE.get(key, 0) + 1
        self._arrival_prefix = f"{ARRIVAL_KEY}/{key}#{_GROUPS_MADE[key]}/"
        if store is not None and self.group_ranks == tuple(range(dist.get_world_size())):
            self._agree_run_id(store, f"moonep/run_id/{key}#{_GROUPS_MADE[key]}")
        _register_exit_hook()

    def _agree_run_id(self, store, key: str) -> None:
        """One run id for every rank's trace header: rank 0 writes a fresh one to the store (always, so a rank
        that traces never waits for one that does not), the others read it when they trace."""
        if self.rank == 0:
            store.set(key, uuid.uuid4().hex)
        if self.tracer is not None and self.tracer.run_id is None:
            self.tracer.run_id = store.get(key).decode()

    # ---------------------------------------------------------------- waiting
    def _wait(self, work, op: str, timeout: float, tensor: torch.Tensor) -> None:
        """Wait for ``work`` on ``tensor``: bounded and on the host for CPU tensors, stream-ordered for CUDA."""
        host = _blocks_host(tensor)
        try:
            if host:
                work.wait(timeout=timedelta(seconds=timeout))
            else:  # no timeout: the current stream waits on NCCL's; the group's watchdog bounds the op
                work.wait()
        except Exception as exc:  # gloo: timeouts, closed peer connections; NCCL: watchdog timeout or abort
            # NCCL's limit is the process group's timeout (this communicator's), not this call's.
            raise self._failure(op, timeout if host else self.timeout, exc) from exc

    def _failure(self, op: str, timeout: float, exc: BaseException) -> CollectiveError:
        failed = self.failed_ranks()
        if failed:
            who = "; ".join(f"rank {r} failed: {msg}" for r, msg in failed.items())
        else:
            who = "no rank reported an error (a rank may have been killed or be stuck)"
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "timed out" in reason.lower():
            reason = f"no answer within its {timeout:g}s timeout"
        return CollectiveError(
            f"{op} on rank {self.global_rank} failed ({reason}); {who}", op=op, failed_ranks=list(failed)
        )

    def failed_ranks(self) -> dict[int, str]:
        """``{global rank: last line of its error}`` for ranks that reported a failure into the store."""
        if self.store is None:
            return {}
        found = {}
        for r in range(dist.get_world_size()):
            key = FAILED_KEY.format(r)
            try:
                if self.store.check([key]):
                    found[r] = self.store.get(key).decode(errors="replace")
            except Exception:  # the store may be gone with the failed rank; naming is best effort
                break
        return found

    def _mark_arrival(self, count: int) -> None:
        if self.store is not None and self.world_size > 1:
            # naming a late rank is best effort; the collective itself decides the outcome
            with contextlib.suppress(Exception):
                self.store.set(f"{self._arrival_prefix}{self.rank}", str(count))

    def _arrivals(self) -> dict[int, int] | None:
        if self.store is None:
            return None
        seen = {}
        try:
            for r in range(self.world_size):
                key = f"{self._arrival_prefix}{r}"
                seen[r] = int(self.store.get(key)) if self.store.check([key]) else 0
        except Exception:  # the store may be gone with a dead rank 0
            return None
        return seen

    def report_failure(self, message: str) -> None:
        if self.store is not None:
            with contextlib.suppress(Exception):  # best effort: the store may be gone with rank 0
                self.store.set(FAILED_KEY.format(self.global_rank), message[-2000:])

    # ---------------------------------------------------------------- primitives
    def _all_to_all_single(self, out, inp, out_splits, in_splits, timeout):
        work = dist.all_to_all_single(
            _movable(out), _movable(inp), out_splits, in_splits, group=self.group, async_op=True
        )
        self._wait(work, "all_to_all_single", timeout, inp)
        return out

    def _start_all_to_all_single(self, out, inp, out_splits, in_splits, timeout):
        work = dist.all_to_all_single(
            _movable(out), _movable(inp), out_splits, in_splits, group=self.group, async_op=True
        )
        return lambda: self._wait(work, "all_to_all_single", timeout, inp)

    def _all_gather(self, out, inp, timeout):
        work = _all_gather_single(_movable(out), _movable(inp), group=self.group, async_op=True)
        self._wait(work, "all_gather", timeout, inp)
        return out

    def _all_reduce(self, tensor, op, timeout):
        if tensor.dtype == torch.bool:
            raise ValueError("all_reduce on bool tensors is not supported; reduce them as uint8")
        on_gloo = tensor.device.type == "cpu"
        target = tensor.float() if on_gloo and tensor.dtype in (torch.bfloat16, torch.float16) else tensor
        work = dist.all_reduce(target, op=_REDUCE[op], group=self.group, async_op=True)
        self._wait(work, "all_reduce", timeout, target)
        if target is not tensor:  # gloo has no half-precision reductions: reduce in fp32, round once
            tensor.copy_(target)
        return tensor

    def _reduce_scatter(self, out, inp, op, timeout):
        if inp.device.type == "cpu":  # gloo lacks reduce_scatter: all-reduce a copy and keep this rank's rows
            full = inp.clone()
            self._all_reduce(full, op, timeout)
            n = out.shape[0]
            out.copy_(full[self.rank * n : (self.rank + 1) * n])
            return out
        work = _reduce_scatter_single(out, inp, op=_REDUCE[op], group=self.group, async_op=True)
        self._wait(work, "reduce_scatter", timeout, inp)
        return out

    def _broadcast(self, tensor, src, timeout):
        work = dist.broadcast(_movable(tensor), src=self.group_ranks[src], group=self.group, async_op=True)
        self._wait(work, "broadcast", timeout, tensor)
        return tensor

    def _barrier(self, timeout):
        # A tiny all-reduce rather than dist.barrier: NCCL's barrier guesses a device, this never does. On a CUDA
        # flag (an NCCL-only group) the wait is stream-ordered like every CUDA collective here.
        flag = torch.zeros(1, device=self._device())
        self._wait(dist.all_reduce(flag, group=self.group, async_op=True), "barrier", timeout, flag)

    def _send(self, tensor, dst, timeout):
        self._wait(dist.isend(_movable(tensor), self.group_ranks[dst], group=self.group), "send", timeout, tensor)

    def _recv(self, tensor, src, timeout):
        self._wait(dist.irecv(_movable(tensor), self.group_ranks[src], group=self.group), "recv", timeout, tensor)
        return tensor

    def _header_device(self) -> torch.device:
        return self._device()

    @property
    def device(self) -> torch.device:
        """The current CUDA device when the group moves CUDA tensors (NCCL, alone or beside gloo as in
        ``cpu:gloo,cuda:nccl``), else the CPU: where an EP Buffer over this group allocates."""
        if "nccl" in str(dist.get_backend(self.group)) and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _device(self) -> torch.device:
        if self._has_gloo or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def _new_group(self, members, color):
        if not members:
            return None
        ranks = [self.group_ranks[m] for m in members]
        # Only members create the group (local synchronization), so colors can be built independently.
        group = dist.new_group(ranks, timeout=timedelta(seconds=self.timeout), use_local_synchronization=True)
        comm = TorchCommunicator(
            group, store=self.store, timeout=self.timeout, validate=self.validate, tracer=self.tracer
        )
        comm.owns_group = True
        return comm

    def close(self) -> None:
        """Destroy the group if this package made it (a ``split`` sub-group; the world communicator from
        ``init_torch`` ends torch.distributed, so gloo's threads are joined before the interpreter exits).
        A wrapped group (``from_group``, an adopted default group) stays alive for its owner."""
        super().close()
        if self.owns_group and self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        elif self.owns_world and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_world = self.owns_group = False


def init_torch(
    rank: int,
    world_size: int,
    *,
    store=None,
    init_method: str | None = None,
    timeout: float = 60.0,
    backend: str | None = None,
    validate: bool = True,
    trace_dir=None,
) -> TorchCommunicator:
    """Initialise torch.distributed (gloo on CPU; ``cpu:gloo,cuda:nccl`` when CUDA is present) and wrap it."""
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if _loopback_only():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend,
        store=store,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    comm = TorchCommunicator(
        None, store=store, timeout=timeout, validate=validate, tracer=tracer_from_env(rank, trace_dir)
    )
    comm.owns_world = True
    return comm


def from_group(group=None, *, timeout: float = 60.0, validate: bool = True, trace_dir=None) -> TorchCommunicator:
    """A ``Communicator`` over an existing torch.distributed process group, which the caller keeps owning.

    group: a ``ProcessGroup``, a 1-D ``DeviceMesh`` (its group), or None for the default (world) group; needs
    ``init_process_group`` to have run. The communicator's ranks are ranks within ``group``. ``close()`` does not
    destroy the group; at interpreter exit the groups still alive are destroyed (module docstring: the exit abort).
    Failures are named through the default group's store when torch exposes it.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "collectives.from_group needs torch.distributed.init_process_group() first "
            "(or use collectives.init(), which initialises it)"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup) and hasattr(group, "get_group"):
        if getattr(group, "ndim", 1) != 1:
            raise ValueError(f"from_group takes a 1-D DeviceMesh, got one with {group.ndim} dimensions")
        group = group.get_group()
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"from_group expects a torch ProcessGroup, a 1-D DeviceMesh or None, got {type(group)}")
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the group it wraps")
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # a private accessor: without it peers' timeouts just cannot name the failed rank
        store = None
    return TorchCommunicator(
        group, store=store, timeout=timeout, validate=validate, tracer=tracer_from_env(dist.get_rank(), trace_dir)
    )


def _loopback_only() -> bool:
    """True for single-host runs (our launcher), where gloo must bind loopback rather than a resolved hostname."""
    return os.environ.get("MOONEP_LOOPBACK", "0") == "1"
