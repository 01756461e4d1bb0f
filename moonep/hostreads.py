"""Count host reads of tensor data (what makes the host wait for a GPU): the EP layer's host-read budget.

Used by the tests ("this path never syncs") and by ``moonep bench ep`` (reads per layer step).

    with HostReads() as reads:
        step(...)
    assert reads.count == 0, reads.report()

What counts, on ANY device (CPU tensors included, so a CPU-only test catches code that would stall a GPU):

* the Tensor methods that hand tensor data to Python (``READ_METHODS``): ``item``, ``tolist``, ``numpy``,
  ``cpu``, ``bool(t)`` (``if t:``), ``int(t)``, ``float(t)``, ``complex(t)``, ``operator.index(t)`` (``range(t)``,
  list indexing), ``repr``/``format``;
* aten ops seen by a ``TorchDispatchMode`` that read data on the host or need it for their output's size
  (``SYNC_OPS`` and ``_sync_name``): ``_local_scalar_dense`` (what the C++ side lowers every scalar read to),
  ``equal``, ``is_nonzero``, ``nonzero``, ``masked_select``, ``unique*``, ``bincount`` (its CUDA kernel reads the
  max back), boolean-mask ``index``/``index_put_`` (``t[mask]``), ``repeat_interleave`` without ``output_size``,
  and copies from a non-CPU device to the CPU.

Not counted: a call that raises (every data read of a ``meta`` tensor does), any call on a meta tensor (it has
no data), a read made inside another counted one (``float(t)`` lowering to ``_local_scalar_dense`` counts once),
calls from threads other than the one that opened the context, and ``tolist``/``numpy``/``repr`` bound before
it opened (``f = t.tolist`` outside, ``f()`` inside: unpatched; scalar reads still count, as
``_local_scalar_dense``). Not seen at all: host->device copies
(``torch.tensor(x, device="cuda")`` waits for the stream too) and syncs inside CUDA kernels outside the list;
on a GPU, ``torch.cuda.set_sync_debug_mode("error")`` is the complement.

Safe to nest (each context counts what ran inside it; re-entering the same instance is a no-op): the Tensor
methods are patched while any context is open and the originals are back when the last one closes, on an
exception too. A context keeps counting across uses; open a new one for a fresh count.
"""

from __future__ import annotations

import os
import threading
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

PLANNER_CPU_ENTRY = ("Tensor.numpy", os.path.join("planner", "device.py"), "_run_cpu_kernel")
"""The CPU planner kernel's zero-copy view of the counts: on CUDA the device kernel replaces it (exempt)."""
LAYOUT_CPU_ENTRY = ("Tensor.numpy", os.path.join("moonep", "layout_cpu.py"), "send_layout_cpu")
"""The CPU send-layout kernel's zero-copy views of the routing and the plan: on CUDA the tensor ops run."""
CPU_KERNEL_ENTRIES = (PLANNER_CPU_ENTRY, LAYOUT_CPU_ENTRY)
"""The compiled CPU kernels' zero-copy entries (no device, no sync): what a host-read count exempts."""
READ_METHODS = (
    "item",
    "tolist",
    "numpy",
    "cpu",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__complex__",
    "__repr__",
    "__format__",
)
SYNC_OPS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::equal",
        "aten::is_nonzero",
        "aten::nonzero",
        "aten::masked_select",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::unique_dim_consecutive",
        "aten::bincount",
    }
)
_MASK_INDEX_OPS = frozenset({"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"})

_MISSING = object()  # the method was inherited (from torch._C.TensorBase), not set on Tensor
_lock = threading.Lock()
_active: list[HostReads] = []  # open contexts, any thread
_saved: dict[str, object] = {}  # method name -> torch.Tensor.__dict__ entry before patching
_tls = threading.local()  # .depth > 0 while a counted call runs (its own lowering is not a 2nd read)
_SKIP_DIRS = (os.path.abspath(__file__), os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def _short_stack(limit: int = 4) -> str:
    """The innermost ``limit`` frames outside this module and torch, innermost first: 'file:line function'."""
    frames = [f for f in traceback.extract_stack() if not os.path.abspath(f.filename).startswith(_SKIP_DIRS)]
    where = []
    for f in reversed(frames[-limit:]):
        path = os.path.relpath(f.filename) if os.path.isabs(f.filename) else f.filename
        where.append(f"{path}:{f.lineno} {f.name}")
    return " <- ".join(where)


def _depth() -> int:
    return getattr(_tls, "depth", 0)


def _counted_method(name: str, original):
    """Tensor.<name> that records one read (after it returns, for a non-meta tensor) to this thread's contexts."""

    def counted(self, *args, **kwargs):
        depth = _depth()
        _tls.depth = depth + 1
        try:
            out = original(self, *args, **kwargs)
        finally:
            _tls.depth = depth
        if depth == 0 and not self.is_meta:
            me, stack = threading.get_ident(), _short_stack()
            for reads in dict.fromkeys(_active):
                if reads._thread == me:
                    reads._add(f"Tensor.{name}", stack)
        return out

    counted.__wrapped__ = original
    return counted


def _install() -> None:
    for name in READ_METHODS:
        _saved[name] = torch.Tensor.__dict__.get(name, _MISSING)
        setattr(torch.Tensor, name, _counted_method(name, getattr(torch.Tensor, name)))


def _restore() -> None:
    for name, original in _saved.items():
        if original is _MISSING:
            delattr(torch.Tensor, name)  # back to inheriting TensorBase's
        else:
            setattr(torch.Tensor, name, original)
    _saved.clear()


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _sync_name(func, args, kwargs) -> str | None:
    """'aten.<op>' when this aten call reads data on the host or sizes its output from it, else None."""
    name = func._schema.name
    label = "aten." + name.split("::", 1)[-1]
    if name in SYNC_OPS:
        return label
    if name in _MASK_INDEX_OPS and len(args) > 1 and any(_is_mask(i) for i in (args[1] or ())):
        return label + "(bool mask)"
    if name == "aten::repeat_interleave" and kwargs.get("output_size") is None:
        return label
    if name == "aten::_to_copy" and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
        device = kwargs.get("device")
        return label + "(to cpu)" if device is not None and torch.device(device).type == "cpu" else None
    if name == "aten::copy_" and args[0].device.type == "cpu" and args[1].device.type != "cpu":
        return label + "(to cpu)"
    return None


class _SyncOps(TorchDispatchMode):
    """Records the aten calls ``_sync_name`` flags to one HostReads (modes are per thread: only its thread)."""

    def __init__(self, owner: HostReads) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _depth() == 0:
            name = _sync_name(func, args, kwargs)
            if name is not None and not any(
                isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves((args, kwargs))
            ):
                self.owner._add(name, _short_stack())
        return out


class HostReads:
    """Context manager: ``.count`` host reads of tensor data inside it, ``.where`` [(name, short stack)].

    ``ignore``: names not to count (as in ``.where``: ``"Tensor.cpu"``, ``"aten.nonzero"``, ...).
    ``exempt``: reads not to count, each a tuple of strings that must all occur in the read's name and its
    innermost frame (``"Tensor.numpy planner/device.py:160 _run_cpu_kernel"``), e.g. ``PLANNER_CPU_ENTRY``.
    """

    def __init__(self, ignore: tuple[str, ...] = (), exempt: tuple[tuple[str, ...], ...] = ()) -> None:
        self.ignore = frozenset(ignore)
        self.exempt = tuple(exempt)
        self.where: list[tuple[str, str]] = []
        self._thread: int | None = None
        self._mode: _SyncOps | None = None
        self._entered = 0

    @property
    def count(self) -> int:
        return len(self.where)

    def report(self) -> str:
        """One line per read, for an assertion message."""
        lines = [f"{len(self.where)} host read(s):"] + [f"  {name} at {stack}" for name, stack in self.where]
        return "\n".join(lines)

    def _add(self, name: str, stack: str) -> None:
        inner = name + " " + stack.split(" <- ", 1)[0]
        if name not in self.ignore and not any(all(p in inner for p in site) for site in self.exempt):
            self.where.append((name, stack))

    def _leave(self) -> None:
        with _lock:
            _active.remove(self)
            if not _active:
                _restore()

    def __enter__(self) -> HostReads:
        if self._entered:
            self._entered += 1
            return self
        self._thread = threading.get_ident()
        with _lock:
            if not _active:
                _install()
            _active.append(self)
        try:
            self._mode = _SyncOps(self)
            self._mode.__enter__()
        except BaseException:
            self._leave()
            raise
        self._entered = 1
        return self

    def __exit__(self, *exc) -> bool:
        self._entered -= 1
        if self._entered == 0:
            assert self._mode is not None  # set by __enter__ whenever _entered reached 1
            try:
                self._mode.__exit__(*exc)
            finally:
                self._mode = None
                self._leave()
        return False


__all__ = ["CPU_KERNEL_ENTRIES", "HostReads", "LAYOUT_CPU_ENTRY", "PLANNER_CPU_ENTRY", "READ_METHODS", "SYNC_OPS"]
