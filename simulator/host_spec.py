"""``HostSpec``: host-bound costs of eager PyTorch on a calibrated machine (split out of ``simulator.hardware``,
which re-exports it)."""

from __future__ import annotations

from dataclasses import fields

from simulator.field_checks import check_finite, frozen_config


@frozen_config
class HostSpec:
    """Host-bound costs of eager PyTorch on a calibrated machine (CPU ranks; written by ``simulate calibrate``).

    When a model is small, a step is set by the host: each framework op costs microseconds of Python and
    dispatcher time, collectives cost host time per call, and local ranks beyond the free cores share them.
    ``simulator.host`` prices a step with these numbers and an op census of the project's implementation.
    Every time is the wall time one rank sees while all ``ranks`` local ranks do the same work at once, so the
    time sharing at ``ranks`` ranks is in the numbers; ``effective_cores`` rescales them to another rank count.
    """

    timing: str
    """How the times were taken; only ``"shared_wall"`` (wall time per rank, all ``ranks`` busy at once) is read.
    Profiles calibrated before it existed held solo CPU times and are refused (calibrate again)."""
    cores: int
    """CPU cores the calibrating process could run on (``os.sched_getaffinity``)."""
    effective_cores: float
    """Measured: throughput of ``ranks`` concurrently busy local ranks, in units of one rank alone (at most
    ``ranks``; below ``cores`` when other work shares the machine)."""
    ranks: int
    """Local ranks the concurrent and collective measurements used. Calibrate at the job's local rank count:
    carrying the times to more ranks assumes no more cores than ``effective_cores`` (at most ``ranks``)."""
    op_fwd_tiny_us: float
    """Host time per framework op of a forward under autograd, on tiny tensors (pure per-op overhead)."""
    op_bwd_tiny_us: float
    """The same for an op run by the autograd engine in the backward."""
    op_nograd_tiny_us: float
    """The same outside autograd (optimizer, gradient bookkeeping)."""
    op_fwd_us: float
    """Host time per forward op of the reference eager block at ``ref_elements`` activation elements."""
    op_bwd_us: float
    """Host time per backward op of the reference block at ``ref_elements``."""
    ref_elements: int
    """Activation elements (tokens x width) per op at which ``op_fwd_us`` / ``op_bwd_us`` were measured."""
    kda_us: float
    """One KDA kernel call (``cp_kda`` gate + chunk), forward + backward, at ``kda_elements``."""
    kda_tiny_us: float
    """The same at ``kda_tiny_elements`` (the per-call part of the cost)."""
    kda_elements: int
    """Tokens x heads x head width of the ``kda_us`` call."""
    kda_tiny_elements: int
    """Tokens x heads x head width of the ``kda_tiny_us`` call."""
    a2a_call_us: float
    """Wall time of one small all-to-all through ``collectives`` (no argument check) at ``ranks`` ranks."""
    all_reduce_call_us: float
    """Wall time of one small all-reduce without argument check."""
    checked_all_reduce_call_us: float
    """Wall time of one small all-reduce with the default argument check (an extra header all-gather)."""
    all_gather_call_us: float
    """Wall time of one small all-gather without argument check."""
    a2a_us_per_mb: float
    """Extra all-to-all wall time per MB a rank sends."""
    all_reduce_us_per_mb: float
    """Extra all-reduce wall time per MB of the reduced buffer."""

    def __post_init__(self):
        if self.timing != "shared_wall":
            raise ValueError(
                f"HostSpec.timing must be 'shared_wall', got {self.timing!r}: the profile is from an "
                "older `moonep simulate calibrate` (solo CPU times); calibrate again"
            )
        if not isinstance(self.cores, int) or self.cores < 1 or not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"HostSpec.cores and ranks must be positive integers, got {self.cores!r}, {self.ranks!r}")
        if not 0 < self.effective_cores <= self.ranks + 1e-9:
            raise ValueError(
                f"HostSpec.effective_cores must be in (0, ranks={self.ranks}], got {self.effective_cores!r}"
            )
        check_finite(self, tuple(f.name for f in fields(self) if f.name not in ("timing", "cores", "ranks")))
        if (
            min(self.ref_elements, self.kda_elements, self.kda_tiny_elements) < 1
            or self.kda_elements <= self.kda_tiny_elements
        ):
            raise ValueError("HostSpec: ref_elements, kda_*elements must be >= 1 and kda_elements > kda_tiny_elements")

    @classmethod
    def from_dict(cls, data: dict) -> HostSpec:
        """The ``host`` object of a hardware profile: every field, no unknown one (``ValueError`` naming them)."""
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown HostSpec field(s) {unknown}")
        missing = sorted(f.name for f in fields(cls) if f.name not in data)
        if missing:
            raise ValueError(f"HostSpec is missing field(s) {missing}")
        return cls(**data)

    def stretch(self, local_ranks: int) -> float:
        """Wall seconds per second of one rank's busy work (measured alone) when ``local_ranks`` ranks share this
        machine: applied to FLOPs at the solo GEMM rate; the host times go through ``share_factor``."""
        return max(1.0, local_ranks / self.effective_cores)

    def share_factor(self, local_ranks: int) -> float:
        """Factor on this spec's times (measured with ``ranks`` ranks busy) for ``local_ranks`` local ranks."""
        return self.stretch(local_ranks) / self.stretch(self.ranks)
