"""Hardware: ``HardwareSpec`` (peaks, HBM, links) with one ``Efficiency`` set per hardware, presets, JSON.

Peak numbers are vendor datasheet values for dense (non-sparse) math; link bandwidths are per GPU per direction.
Efficiencies are the *only* tuning knobs and there is exactly one set per hardware (the issue's rule): the
A100 set was fitted once to all eight Korthikanti et al. runs together (see ``simulator/README.md``); the Hopper
and Blackwell sets are engineering estimates, to be replaced by ``moonep simulate calibrate`` profiles, except
``moe_copy_ns``, fitted on calibration rows held out of the validation table (``simulator.moe_fit``).
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from simulator.field_checks import check_finite, check_types


@dataclass(kw_only=True, frozen=True)
class Efficiency:
    """Achieved fraction of peak per op class, overlap fractions and software behaviour of one hardware."""

    gemm: float = 0.70
    """Dense GEMM throughput as a fraction of the precision's peak."""
    grouped_gemm: float = 0.60
    """Routed-expert grouped GEMM fraction of peak."""
    gemm_half_gflop: float = 0.0
    """GEMM size (GFLOP per call) at which efficiency drops to half of ``gemm``: efficiency = gemm * F / (F +
    gemm_half_gflop), so small or thin GEMMs (high TP, small experts) run further from peak (Calculon-style)."""
    attention: float = 0.50
    """Core softmax attention fraction of peak (forward and backward)."""
    kda: float = 0.35
    """KDA chunked kernels fraction of bf16 peak."""
    hbm: float = 0.80
    """Memory-bound (elementwise, optimizer) kernels: fraction of HBM bandwidth."""
    elementwise_bytes: float = 60.0
    """HBM bytes moved by memory-bound ops per token per layer per unit of hidden size, forward (norms, adds,
    activations, dropout, rotary/conv); backward moves twice as much."""
    nvlink: float = 0.80
    """Achieved fraction of NVLink bandwidth (NCCL bus bandwidth / link bandwidth)."""
    network: float = 0.85
    """Achieved fraction of NIC bandwidth."""
    tp_overlap: float = 0.0
    """Fraction of TP/SP collective time hidden behind GEMMs (0 = Megatron 2022, no overlap)."""
    dp_overlap: float = 0.0
    """Fraction of data-parallel gradient/parameter collectives hidden behind the backward pass."""
    ep_overlap: float = 0.0
    """Fraction of EP all-to-all hidden by 1F1B/interleaved schedules (DualPipe overlaps by construction)."""
    flash_attention: bool = True
    """Fused attention: no s^2 activations saved and causal blocks skipped (half the core FLOPs)."""
    step_overhead_s: float = 0.0
    """Fixed per-step time (data loading, launch gaps, gradient clipping)."""
    layer_overhead_s: float = 0.0
    """Fixed time per layer per micro-batch, forward+backward (kernel launches, small ops)."""
    grouped_half_rows: float = 0.0
    """Rows per local expert at which grouped-GEMM efficiency halves (tile padding and per-expert setup):
    efficiency = grouped_gemm * rows / (rows + grouped_half_rows) (0: no row effect)."""
    moe_copy_ns: float = 0.0
    """Time per routed token copy (token x top-k) per MoE layer, forward+backward, in nanoseconds, beyond the
    modelled bytes: index bookkeeping, per-expert scaling and the un-fused gathers of the dispatcher."""
    moe_layer_fixed_s: float = 0.0
    """Fixed time per MoE layer per micro-batch, forward+backward: the dropless dispatcher's device-to-host sync
    of the token counts (it drains the launch queue), router top-k and permutation kernel launches."""

    def __post_init__(self):
        check_types(self)
        for f in ("gemm", "grouped_gemm", "attention", "kda", "hbm", "nvlink", "network"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"Efficiency.{f} must be in (0, 1], got {getattr(self, f)!r}")
        for f in ("tp_overlap", "dp_overlap", "ep_overlap"):
            if not 0 <= getattr(self, f) <= 1:
                raise ValueError(f"Efficiency.{f} must be in [0, 1], got {getattr(self, f)!r}")
        check_finite(
            self,
            (
                "gemm_half_gflop",
                "elementwise_bytes",
                "step_overhead_s",
                "layer_overhead_s",
                "grouped_half_rows",
                "moe_layer_fixed_s",
                "moe_copy_ns",
            ),
        )


@dataclass(kw_only=True, frozen=True)
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

    def stretch(self, local_ranks: int) -> float:
        """Wall seconds per second of one rank's busy work (measured alone) when ``local_ranks`` ranks share this
        machine: applied to FLOPs at the solo GEMM rate; the host times go through ``share_factor``."""
        return max(1.0, local_ranks / self.effective_cores)

    def share_factor(self, local_ranks: int) -> float:
        """Factor on this spec's times (measured with ``ranks`` ranks busy) for ``local_ranks`` local ranks."""
        return self.stretch(local_ranks) / self.stretch(self.ranks)


@dataclass(kw_only=True, frozen=True)
class HardwareSpec:
    """One accelerator type and its node: peaks, memory, links."""

    name: str
    """Preset name or profile label."""
    bf16_tflops: float
    """Dense BF16 tensor peak, TFLOP/s."""
    fp8_tflops: float = 0.0
    """Dense FP8 tensor peak, TFLOP/s (0: no FP8 tensor cores)."""
    hbm_gib: float
    """Usable device memory, GiB."""
    hbm_tbps: float
    """HBM bandwidth, TB/s."""
    nvlink_gbps: float
    """Intra-node bandwidth per GPU per direction, GB/s."""
    nic_gbps: float
    """Scale-out NIC bandwidth per GPU per direction, GB/s (400 Gb/s = 50)."""
    gpus_per_node: int = 8
    """GPUs per NVLink domain (node)."""
    nvlink_latency_us: float = 3.0
    """Per-hop latency inside a node, microseconds."""
    nic_latency_us: float = 10.0
    """Per-hop latency across nodes, microseconds."""
    pcie_gbps: float = 50.0
    """Host link per GPU per direction, GB/s (PCIe Gen5 x16 about 50-55): activation offload traffic."""
    reserved_gib: float = 3.0
    """Memory not available to the model (CUDA context, NCCL, allocator slack), GiB."""
    price_per_gpu_hour: float = 2.0
    """Rental price, USD per GPU-hour, for the cost line."""
    efficiency: Efficiency = field(default_factory=Efficiency)
    """The one efficiency set of this hardware."""
    host: HostSpec | None = None
    """Host-bound eager costs (calibrated CPU profiles); None prices kernels only (GPU presets)."""

    def __post_init__(self):
        check_types(self)
        check_finite(
            self, ("bf16_tflops", "hbm_gib", "hbm_tbps", "nvlink_gbps", "nic_gbps", "pcie_gbps"), positive=True
        )
        check_finite(self, ("fp8_tflops", "nvlink_latency_us", "nic_latency_us", "reserved_gib", "price_per_gpu_hour"))
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"HardwareSpec.gpus_per_node must be a positive integer, got {self.gpus_per_node!r}")

    def peak_tflops(self, precision: str) -> float:
        return self.fp8_tflops if precision == "fp8" else self.bf16_tflops

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, base: HardwareSpec | None = None) -> HardwareSpec:
        """A spec from a dict; with ``base``, the dict overrides only the fields it names."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown HardwareSpec field(s) {unknown}; known: {sorted(known)}")
        missing = sorted(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)
        missing = [m for m in missing if m not in data]
        if base is None and missing:
            raise ValueError(f"hardware profile is missing required field(s) {missing} (or name a 'base' preset)")
        for sub in ("efficiency", "host"):
            if data.get(sub) is not None and not isinstance(data[sub], dict):
                raise ValueError(f"HardwareSpec.{sub} must be a JSON object, got {data[sub]!r}")
        data = dict(data)
        eff = data.pop("efficiency", None)
        if isinstance(data.get("host"), dict):
            known_h = {f.name for f in fields(HostSpec)}
            if set(data["host"]) - known_h:
                raise ValueError(f"unknown HostSpec field(s) {sorted(set(data['host']) - known_h)}")
            missing_h = sorted(f.name for f in fields(HostSpec) if f.name not in data["host"])
            if missing_h:
                raise ValueError(f"HostSpec is missing field(s) {missing_h}")
            data["host"] = HostSpec(**data["host"])
        spec = replace(base, **data) if base is not None else cls(**data)
        if eff is not None:
            known_e = {f.name for f in fields(Efficiency)}
            if set(eff) - known_e:
                raise ValueError(f"unknown Efficiency field(s) {sorted(set(eff) - known_e)}")
            spec = replace(spec, efficiency=replace(spec.efficiency, **eff))
        return spec


# A100 set: fitted once, jointly, to the eight Korthikanti et al. 2022 runs (Megatron-LM 2022: no fused
# attention, no TP/DP overlap); see simulator/README.md. Do not tune per case.
A100_EFFICIENCY = Efficiency(
    gemm=0.78,
    gemm_half_gflop=0.0,
    grouped_gemm=0.65,
    attention=0.45,
    kda=0.30,
    hbm=0.80,
    elementwise_bytes=75.0,
    nvlink=0.55,
    network=0.80,
    flash_attention=False,
)
# Hopper/Blackwell: estimates for current Megatron/TE + DeepEP-class software (TP comm overlap, overlapped DP).
HOPPER_EFFICIENCY = Efficiency(
    gemm=0.62,
    gemm_half_gflop=10.0,
    attention=0.45,
    kda=0.30,
    hbm=0.80,
    elementwise_bytes=60.0,
    nvlink=0.80,
    network=0.85,
    tp_overlap=0.5,
    dp_overlap=0.8,
    grouped_gemm=0.50,
    moe_copy_ns=152.0,
)
BLACKWELL_EFFICIENCY = replace(HOPPER_EFFICIENCY, gemm=0.60, grouped_gemm=0.48, attention=0.45, moe_copy_ns=170.0)
# MoE terms: grouped_gemm is the estimate these sets had before any published MoE run was read; moe_copy_ns is
# the only constant fitted to published runs, and only to the calibration rows of simulator.moe_fit (25.11
# Megatron-Bridge tables), never to the validation rows of simulator.published (tests/simulator/test_moe_fit.py
# refits it and checks both). moe_layer_fixed_s stays 0 (measured by `simulate calibrate` on a GPU).

PRESETS: dict[str, HardwareSpec] = {
    "a100": HardwareSpec(
        name="a100-80g",
        bf16_tflops=312.0,
        fp8_tflops=0.0,
        hbm_gib=80.0,
        hbm_tbps=2.039,
        nvlink_gbps=300.0,
        nic_gbps=25.0,
        reserved_gib=2.0,
        price_per_gpu_hour=1.5,
        efficiency=A100_EFFICIENCY,
    ),
    "h100": HardwareSpec(
        name="h100-sxm",
        bf16_tflops=989.0,
        fp8_tflops=1979.0,
        hbm_gib=79.6,
        hbm_tbps=3.35,
        nvlink_gbps=450.0,
        nic_gbps=50.0,
        price_per_gpu_hour=2.5,
        efficiency=HOPPER_EFFICIENCY,
    ),
    "h800": HardwareSpec(
        name="h800",
        bf16_tflops=989.0,
        fp8_tflops=1979.0,
        hbm_gib=79.6,
        hbm_tbps=3.35,
        nvlink_gbps=200.0,
        nic_gbps=50.0,
        price_per_gpu_hour=2.0,
        efficiency=HOPPER_EFFICIENCY,
    ),
    "h200": HardwareSpec(
        name="h200",
        bf16_tflops=989.0,
        fp8_tflops=1979.0,
        hbm_gib=140.0,
        hbm_tbps=4.8,
        nvlink_gbps=450.0,
        nic_gbps=50.0,
        price_per_gpu_hour=3.0,
        efficiency=HOPPER_EFFICIENCY,
    ),
    "b200": HardwareSpec(
        name="b200",
        bf16_tflops=2250.0,
        fp8_tflops=4500.0,
        hbm_gib=179.0,
        hbm_tbps=8.0,
        nvlink_gbps=900.0,
        nic_gbps=50.0,
        price_per_gpu_hour=5.0,
        efficiency=BLACKWELL_EFFICIENCY,
    ),
}
ALIASES = {"a100-80g": "a100", "h100-sxm": "h100"}


def load_hardware(name_or_path: str | os.PathLike | HardwareSpec | dict[str, Any]) -> HardwareSpec:
    """A preset name (a100, h100, h800, h200, b200), or a JSON file / dict (with ``base`` naming a preset)."""
    if isinstance(name_or_path, HardwareSpec):
        return name_or_path
    if isinstance(name_or_path, dict):
        data = dict(name_or_path)
    else:
        key = os.fspath(name_or_path)
        low = ALIASES.get(key.lower(), key.lower())
        if low in PRESETS:
            return PRESETS[low]
        if not os.path.exists(key):
            raise ValueError(f"hardware {key!r} is neither a preset ({', '.join(PRESETS)}) nor an existing file")
        with open(key) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"hardware file {key}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{key}: a hardware file holds one JSON object")
    data.pop("measured", None)  # calibration's raw numbers ride along for the reader
    base = data.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ValueError(f"hardware 'base' must be a preset name ({', '.join(PRESETS)}), got {base!r}")
    if base is not None:
        return HardwareSpec.from_dict(data, base=load_hardware(base))
    return HardwareSpec.from_dict(data)
