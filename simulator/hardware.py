"""Hardware: ``HardwareSpec`` (peaks, HBM, links) with one ``Efficiency`` set per hardware, presets, JSON.

Peak numbers are vendor datasheet values for dense (non-sparse) math; link bandwidths are per GPU per direction.
Efficiencies are the *only* tuning knobs and there is exactly one set per hardware (the issue's rule): the
A100 set was fitted once to all eight Korthikanti et al. runs together (see ``simulator/README.md``); the Hopper
and Blackwell sets are engineering estimates, to be replaced by ``moonep simulate calibrate`` profiles, except
five software constants fitted to published runs (``SUSTAINED`` per architecture and the MoE layer's fixed time
eager, under per-module and under full-iteration CUDA graphs; ``simulator.software_fit``).
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, field, fields, replace
from typing import Any

from simulator.field_checks import MAX_MAGNITUDE, check_finite, check_types, frozen_config
from simulator.host_spec import HostSpec


@frozen_config
class Efficiency:
    """Achieved fraction of peak per op class, overlap fractions and software behaviour of one hardware."""

    gemm: float = 0.70
    """BF16 GEMM ceiling: the fraction of the bf16 peak the best large shapes reach (a measurement, e.g. the MAMF
    table); each GEMM's own efficiency comes from its shape (``simulator.gemm_model``: tiles, waves, roofline)."""
    gemm_fp8: float = 0.0
    """FP8 GEMM ceiling as a fraction of the fp8 peak (0: same as ``gemm``)."""
    grouped_gemm: float = 1.0
    """Grouped-GEMM kernel throughput relative to dense GEMMs of the same per-expert shapes (1: as fast; the
    per-expert padding and the shared waves are in the shape model)."""
    gemm_half_gflop: float = 0.0
    """Optional extra size curve on top of the shape model: efficiency x F / (F + gemm_half_gflop) for a layer's
    GEMMs of F GFLOP (0: off, as in the presets; kept for profiles that set it)."""
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
    """Share of the last micro-batch's backward (gradient reduce-scatter) and the first one's forward (parameter
    all-gather) that the DP bucket collectives may overlap (Megatron ``overlap_grad_reduce`` /
    ``overlap_param_gather``: 1 on, 0 off); what the buckets cannot hide is exposed (``simulator.dp_comm``)."""
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
    """Fixed time per MoE layer per micro-batch, forward+backward: the dispatcher's device-to-host sync of the
    token counts (dropless runs; it drains the launch queue), router top-k and permutation kernel launches."""
    moe_layer_graphed_s: float = 0.0
    """What stays of ``moe_layer_fixed_s`` under a full-iteration CUDA graph (``ParallelConfig.cuda_graph``): no
    host sync and no launches, but the layer's many short kernels still fill and drain the GPU one after another."""
    moe_layer_module_graph_s: float = 0.0
    """What stays of ``moe_layer_fixed_s`` under per-module CUDA graphs (``ParallelConfig.cuda_graph = modules``):
    the router and preprocessing launch as one graph each, the host sync and the expert part's launches stay."""

    def __post_init__(self):
        check_types(self)
        for f in ("gemm", "grouped_gemm", "attention", "kda", "hbm", "nvlink", "network"):  # a rate is not ~0
            if not 1 / MAX_MAGNITUDE <= getattr(self, f) <= 1:
                raise ValueError(f"Efficiency.{f} must be in [{1 / MAX_MAGNITUDE:g}, 1], got {getattr(self, f)!r}")
        for f in ("gemm_fp8", "tp_overlap", "dp_overlap", "ep_overlap"):
            if not 0 <= getattr(self, f) <= 1:
                raise ValueError(f"Efficiency.{f} must be in [0, 1], got {getattr(self, f)!r}")
        # every other number (the fractions above are in range already) is finite and >= 0
        check_finite(self, tuple(f.name for f in fields(self) if f.type == "float"))


MAX_SMS = 4096
"""Most SMs a profile may give (a B300 has 148; 10**20 priced every GEMM's waves at almost nothing)."""
MAX_DOMAIN = 2**16
"""Most GPUs a profile may put in one NVLink domain (GB300 NVL72 has 72)."""


@frozen_config
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
    arch: str = ""
    """GEMM tile family for the shape model: ``ampere``, ``hopper``, ``blackwell``; ``""``: none (GEMMs at the
    ceiling rate, e.g. a calibrated profile that measured its own rate)."""
    sms: int = 0
    """Streaming multiprocessors (the wave size of the shape model; datasheet)."""
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
        if self.arch not in ("", "ampere", "hopper", "blackwell"):
            raise ValueError(f"HardwareSpec.arch must be '', 'ampere', 'hopper' or 'blackwell', got {self.arch!r}")
        for f, low, top in (("sms", 1 if self.arch else 0, MAX_SMS), ("gpus_per_node", 1, MAX_DOMAIN)):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= top:
                raise ValueError(f"HardwareSpec.{f} must be an integer in [{low}, {top}], got {v!r}")
        if self.reserved_gib >= self.hbm_gib:  # every plan came out "out of memory", with no word on why
            raise ValueError(f"HardwareSpec.reserved_gib {self.reserved_gib:g} must be below hbm_gib {self.hbm_gib:g}")

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
            data["host"] = HostSpec.from_dict(data["host"])
        spec = replace(base, **data) if base is not None else cls(**data)
        if eff is not None:
            known_e = {f.name for f in fields(Efficiency)}
            if set(eff) - known_e:
                raise ValueError(f"unknown Efficiency field(s) {sorted(set(eff) - known_e)}")
            spec = replace(spec, efficiency=replace(spec.efficiency, **eff))
        return spec


# GEMM ceilings (``gemm``, ``gemm_fp8``): the best-shape fraction of peak measured with cuBLAS, the "Maximum
# Achievable Matmul FLOPS" table of ml-engineering (stas00/ml-engineering, compute/accelerator/README.md, bf16):
# A100 SXM 267.9 of 312 TFLOP/s (85.9%), H100 SXM 792.1 of 989 (80.1%), GH200 83.0%; Blackwell: no measurement was
# checked, the H100 fraction is used. FP8 on Hopper: DeepGEMM (deepseek-ai/DeepGEMM README) reports 1,300-1,550
# TFLOP/s for large DeepSeek-V3 shapes on H800 (0.66-0.78 of 1,979), taken as 0.70 (also for Blackwell, not
# measured). Per-GEMM efficiency then follows the shape (simulator.gemm_model).
# Hopper/Blackwell: current Megatron/TE (TP comm overlap; DP buckets overlapped, overlap_grad_reduce/param_gather).
GEMM_CEILING = {"bf16": 0.801, "fp8": 0.70}
"""Best-shape GEMM fraction of peak in a microbenchmark (sources above), Hopper and Blackwell."""
SUSTAINED = {"hopper": 0.946, "blackwell": 0.794}
"""Fitted (simulator.software_fit): the share of the ceiling a training step sustains (clocks under load, SMs lent to
communication, launch gaps), per architecture (Blackwell's ceiling is the unmeasured H100 fraction)."""


def sustained_gemm(share: float) -> dict[str, float]:
    """``Efficiency``'s GEMM fields at ``share`` of the ``GEMM_CEILING`` s."""
    return {"gemm": GEMM_CEILING["bf16"] * share, "gemm_fp8": GEMM_CEILING["fp8"] * share}


# A100 set: the non-GEMM terms were fitted once, jointly, to the eight Korthikanti et al. 2022 runs (Megatron-LM
# 2022: no fused attention, no TP/DP overlap); see simulator/README.md. Do not tune per case. Its GEMMs keep Hopper's
# sustained share of their measured ceiling (both ceilings are MAMF measurements; no A100 run is in that fit).
A100_GEMM_CEILING = 0.859
"""A100 SXM bf16 best-shape fraction of peak (MAMF table: 267.9 of 312 TFLOP/s)."""
A100_EFFICIENCY = Efficiency(
    gemm=A100_GEMM_CEILING * SUSTAINED["hopper"],
    gemm_half_gflop=0.0,
    grouped_gemm=1.0,
    attention=0.45,
    kda=0.30,
    hbm=0.80,
    elementwise_bytes=75.0,
    nvlink=0.55,
    network=0.80,
    flash_attention=False,
)

MOE_LAYER_FIXED_S = 0.00510
"""Fitted (simulator.software_fit): seconds per MoE layer per micro-batch, forward + backward, of dropless
dispatcher work that does not scale with tokens (host syncs for the token counts, kernel launches)."""
MOE_LAYER_GRAPHED_S = 0.00120
"""Fitted (simulator.software_fit): the same under a full-iteration CUDA graph (kernel fill and drain only)."""
MOE_LAYER_MODULE_GRAPH_S = 0.00284
"""Fitted (simulator.software_fit): the same under per-module CUDA graphs (router and preprocessing graphed)."""
HOPPER_EFFICIENCY = Efficiency(
    **sustained_gemm(SUSTAINED["hopper"]),
    gemm_half_gflop=0.0,
    attention=0.45,
    kda=0.30,
    hbm=0.80,
    elementwise_bytes=60.0,
    nvlink=0.80,
    network=0.85,
    tp_overlap=0.5,
    dp_overlap=1.0,
    grouped_gemm=1.0,
    moe_layer_fixed_s=MOE_LAYER_FIXED_S,
    moe_layer_graphed_s=MOE_LAYER_GRAPHED_S,
    moe_layer_module_graph_s=MOE_LAYER_MODULE_GRAPH_S,
)
BLACKWELL_EFFICIENCY = replace(HOPPER_EFFICIENCY, **sustained_gemm(SUSTAINED["blackwell"]))
# MoE terms: grouped_gemm is a kernel's speed relative to dense GEMMs of the same shapes (DeepGEMM's grouped
# contiguous kernels run the DeepSeek-V3 expert shapes at its dense rates); moe_copy_ns stays 0 (a per-copy
# cost, measured by `simulate calibrate` on a GPU: none was fitted, the dispatcher's bytes are priced instead).

PRESETS: dict[str, HardwareSpec] = {
    "a100": HardwareSpec(
        name="a100-80g",
        arch="ampere",
        sms=108,
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
        arch="hopper",
        sms=132,
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
        arch="hopper",
        sms=132,
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
        arch="hopper",
        sms=132,
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
        arch="blackwell",
        sms=148,
        bf16_tflops=2250.0,
        fp8_tflops=4500.0,
        hbm_gib=179.0,
        hbm_tbps=8.0,
        nvlink_gbps=900.0,
        nic_gbps=50.0,
        price_per_gpu_hour=5.0,
        efficiency=BLACKWELL_EFFICIENCY,
    ),
    # GB200 NVL72 (NVIDIA GB200 NVL72 datasheet): per Blackwell GPU 2.5 PF dense BF16 / 5 PF dense FP8 (half the
    # sparse figures), 186 GB HBM3e at 8 TB/s, fifth-generation NVLink 1.8 TB/s bidirectional across one 72-GPU
    # domain, one ConnectX-7 400 Gb/s NIC per GPU; memory as nvidia-smi reports it (189471 MiB), like b200's.
    "gb200": HardwareSpec(
        name="gb200",
        arch="blackwell",
        sms=148,
        bf16_tflops=2500.0,
        fp8_tflops=5000.0,
        hbm_gib=185.0,
        hbm_tbps=8.0,
        nvlink_gbps=900.0,
        nic_gbps=50.0,
        gpus_per_node=72,
        pcie_gbps=450.0,  # NVLink-C2C to the Grace CPU: 900 GB/s both ways (activation offload's path)
        price_per_gpu_hour=6.0,
        efficiency=BLACKWELL_EFFICIENCY,
    ),
    # Blackwell Ultra (NVIDIA DGX B300 and GB300 NVL72 datasheets, Blackwell Ultra technical brief): 160 SMs, the
    # same dense BF16 / FP8 tensor peaks as B200 / GB200 (Ultra raises FP4 and attention exponent rates), 288 GB
    # HBM3e at 8 TB/s, NVLink 5 at 900 GB/s per direction, one ConnectX-8 800 Gb/s NIC per GPU.
    "b300": HardwareSpec(
        name="b300",
        arch="blackwell",
        sms=160,
        bf16_tflops=2250.0,
        fp8_tflops=4500.0,
        hbm_gib=268.0,
        hbm_tbps=8.0,
        nvlink_gbps=900.0,
        nic_gbps=100.0,
        price_per_gpu_hour=6.0,
        efficiency=BLACKWELL_EFFICIENCY,
    ),
    "gb300": HardwareSpec(
        name="gb300",
        arch="blackwell",
        sms=160,
        bf16_tflops=2500.0,
        fp8_tflops=5000.0,
        hbm_gib=268.0,
        hbm_tbps=8.0,
        nvlink_gbps=900.0,
        nic_gbps=100.0,
        gpus_per_node=72,
        pcie_gbps=450.0,  # NVLink-C2C, as gb200
        price_per_gpu_hour=7.0,
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
