"""``moonep simulate calibrate``: measure this machine and write a hardware profile JSON.

Kernel rates (median of timed repeats after a warm-up): dense GEMM at the job's sizes (``[tokens, hidden] x
[hidden, hidden]``; bf16 on GPU, fp32 on CPU), causal attention (``scaled_dot_product_attention``), memory copy,
and all-to-all bandwidth per rank through ``collectives.launch`` (local ranks; gloo on CPU, NCCL on GPU). The
profile sets the *achieved* rates as peaks with efficiencies of 1, so the cost model reproduces them.

On CPU it also measures what bounds a small eager job (the ``host`` block, see ``simulator.host``), each as the
wall time one rank sees while all ``world_size`` local ranks do the same work at once (CPU time when alone):

- framework op cost: a reference eager block (norm, gate, softmax mix, gather; ``nn.Module``s under autograd)
  forward, backward and no-grad, on tiny tensors and at the job's activation size, divided by its op count;
- the KDA kernel (``cp_kda.kda_gate`` + ``kda_chunk``, forward + backward) at the job's size and a tiny one;
- per-call and per-MB wall time of all-to-all, all-reduce (with and without the argument check) and all-gather
  through ``collectives`` on ``world_size`` local ranks calling together (time sharing included);
- effective cores: the same busy work on one rank alone and on all ``world_size`` ranks at once; the model
  uses it only to carry those times to another number of local ranks, and to stretch GEMM FLOPs (whose rate
  is measured alone).

``calibrate`` measures the kernel rates in its own process, launches ``measure_in_group`` (without them) on
fresh ranks and turns the measurements into a profile with ``profile_from``; a job can call
``measure_in_group`` between its own steps instead, so that the profile and the steps see the same machine
(the 20% test does). On a GPU it also measures the MoE fixed terms (``simulator.calibrate_moe``); the host
costs are measured by ``simulator.calibrate_host``. These three are the only simulator modules that import torch
(the rest of the simulator is numbers in, numbers out); ``collectives.launch`` (here) and ``cp_kda``
(``calibrate_host.measure_kda``) are imported inside the functions that run them, as the layering's listed
exceptions (``tests/test_layers.py``): calibration measures them.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from simulator.calibrate_host import (
    BIG,
    calibrate_host,
    collective_costs,
    effective_cores,
    op_costs,
    shared_timer,
    solo_timer,
    timed,
)
from simulator.calibration_sizes import CalibrationSizes


def _sync(device: str):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def measure_gemm(m: int, k: int, n: int, repeats: int, device: str) -> float:
    """Dense GEMM TFLOP/s of ``[m, k] x [k, n]`` (enough products per timing to dwarf the call overhead)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    sync, calls = _sync(device), max(1, int(2e7 // (2 * m * k * n)))

    def run():
        for _ in range(calls):
            torch.matmul(a, b)
        sync()

    clock = time.perf_counter if device == "cuda" else time.process_time
    return 2.0 * m * k * n * calls / timed(run, repeats, clock) / 1e12


def measure_attention(seq: int, heads: int, repeats: int, device: str) -> float:
    """Causal attention forward TFLOP/s (FLOPs = 2 * 2 * heads * seq^2 * d / 2)."""
    d = 128
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, heads, seq, d, device=device, dtype=dtype) for _ in range(3))
    sync = _sync(device)

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        sync()

    return 2.0 * heads * seq * seq * d / timed(run, repeats) / 1e12


def measure_copy(nbytes: int, repeats: int, device: str) -> float:
    """Device memory bandwidth in TB/s (read + write of a tensor copy)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    sync = _sync(device)

    def run():
        dst.copy_(src)
        sync()

    return 2.0 * nbytes / timed(run, repeats) / 1e12


def _a2a_rank(comm, nbytes: int, repeats: int) -> float:
    """Per-rank all-to-all bandwidth in GB/s (bytes this rank sends / time, slowest rank's time)."""
    device = "cuda" if torch.cuda.is_available() and comm.backend != "mpi" else "cpu"
    rows = max(comm.world_size, nbytes // 1024 // comm.world_size * comm.world_size)
    inp = torch.ones(rows, 512, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(inp)
    comm.all_to_all_single(out, inp)
    times = []
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_to_all_single(out, inp, validate=False, splits_agreed=True)  # the transport alone
        if device == "cuda":
            torch.cuda.synchronize()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        comm.all_reduce(dt, op="max")
        times.append(float(dt))
    sent = inp.numel() * inp.element_size() * (comm.world_size - 1) / comm.world_size
    return sent / statistics.median(times) / 1e9


SHARED_SECONDS_PER_REPEAT = 0.04
"""CPU seconds each rank loops one shared measurement for, per repeat (quick: 5 repeats, 0.2 s)."""


def _ranks_body(comm, sizes: CalibrationSizes, repeats: int, nbytes: int, host: bool) -> dict:
    """What ``measure_in_group`` measures on all ranks at once: all-to-all bandwidth, and on CPU the
    collectives' and the per-op and KDA costs with all ranks busy at once, then the effective cores (which
    only rescale those costs to another rank count)."""
    out = {"a2a_gbps": _a2a_rank(comm, nbytes, repeats)}
    if host:
        out.update(collective_costs(comm, repeats * 6, BIG))
        out.update(op_costs(sizes, shared_timer(comm, SHARED_SECONDS_PER_REPEAT * repeats)))
        out["effective_cores"] = effective_cores(comm, sizes, 3 if repeats < 10 else 5)
    return out


def _kernel_rates(sizes: CalibrationSizes, repeats: int, quick: bool, device: str) -> dict:
    """Dense GEMM (at the job's size on CPU), causal attention and copy rates, each measured alone."""
    if device == "cuda":
        gemm = measure_gemm(8192, 8192, 8192, repeats, device)
    else:
        gemm = measure_gemm(sizes.tokens, sizes.hidden, sizes.hidden, repeats, device)
    return {
        "gemm_tflops": gemm,
        "attention_tflops": measure_attention(256 if quick else 2048, 4 if quick else 16, repeats, device),
        "copy_tbps": measure_copy((16 if quick else 256) * 2**20, repeats, device),
    }


def _repeats(quick: bool) -> int:
    """Timed repeats of each measurement (``--quick``: a smoke run)."""
    return 5 if quick else 15


def _settings(sizes: CalibrationSizes, quick: bool, device: str, world_size: int) -> dict:
    return {"device": device, "quick": quick, "sizes": asdict(sizes), "world_size": world_size}


def measure_in_group(comm, *, sizes: CalibrationSizes, quick: bool = False, kernel_rates: bool = True) -> dict:
    """Everything ``calibrate`` measures, from inside a running group of ``comm.world_size`` ranks: the kernel
    rates on rank 0 alone (the others wait at a barrier, within the group's timeout; ``kernel_rates=False``
    skips them), then ``_ranks_body`` on all ranks at once; all of it with one intra-op thread (the caller's
    count is restored after).

    ``calibrate`` launches it on fresh ranks; a job can also call it between its own steps, so that profile and
    steps see the same machine (``profile_from`` turns rank 0's dict into a profile).
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    repeats = _repeats(quick)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the training ranks run, and as ``calibrate`` takes the kernel rates
    rates = {}
    try:
        if kernel_rates:
            comm.barrier()
            rates = _kernel_rates(sizes, repeats, quick, device) if comm.rank == 0 else {}
            comm.barrier()
        out = _ranks_body(comm, sizes, repeats, (1 if quick else 32) * 2**20, device == "cpu")
    finally:
        torch.set_num_threads(threads)
    return {**out, **rates, **_settings(sizes, quick, device, comm.world_size)}


def calibrate(
    *, world_size: int = 2, quick: bool = False, backend: str = "torch", sizes: CalibrationSizes | None = None
) -> dict:
    """Measure and return a hardware profile dict loadable by ``hardware.load_hardware``."""
    sizes = sizes or CalibrationSizes()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    repeats = _repeats(quick)
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # as the training ranks run (idle pool threads would also bill CPU time)
    try:  # kernel rates here, alone and without a collective timeout (a large model's GEMM takes a while)
        measured = {**_kernel_rates(sizes, repeats, quick, device), **_settings(sizes, quick, device, 1)}
        if device == "cuda":  # the MoE fixed terms (on CPU the host model's op census prices the MoE layer)
            from simulator.calibrate_moe import measure_moe_fixed  # heavy: torch kernels, only on a GPU

            measured["moe"] = measure_moe_fixed(
                max(8, sizes.tokens), sizes.hidden, sizes.experts, sizes.top_k, repeats, device, measured["copy_tbps"]
            )
        if world_size > 1:
            from collectives import launch  # layering exception: real ranks (listed in tests/test_layers.py)

            measured.update(
                launch(
                    measure_in_group,
                    world_size,
                    backend=backend,
                    timeout=120.0,
                    sizes=sizes,
                    quick=quick,
                    kernel_rates=False,
                )
            )
        elif device == "cpu":  # one rank: the host costs alone, in this process
            measured.update(op_costs(sizes, solo_timer(repeats)))
    finally:
        torch.set_num_threads(threads)
    return profile_from(measured, backend=backend)


def profile_from(measured: dict, backend: str = "torch") -> dict:
    """A hardware profile (loadable by ``hardware.load_hardware``) from ``measure_in_group``'s rank-0 dict."""
    device, world_size = measured["device"], measured["world_size"]
    gemm, attn, a2a = measured["gemm_tflops"], measured["attention_tflops"], measured.get("a2a_gbps", 0.0)
    name = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or platform.machine()
    mem_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if device == "cuda" else 16.0
    link = max(a2a, 1e-3)
    return {
        "name": f"calibrated {device}: {name}",
        "bf16_tflops": gemm,
        "fp8_tflops": 0.0,
        "hbm_gib": mem_gib,
        "hbm_tbps": measured["copy_tbps"],
        "nvlink_gbps": link,
        "nic_gbps": link,
        "gpus_per_node": max(8, world_size) if device == "cpu" else max(1, world_size),
        "nvlink_latency_us": 10.0,
        "nic_latency_us": 20.0,
        "reserved_gib": 0.5,
        "host": calibrate_host(measured) if device == "cpu" else None,
        "efficiency": {
            "gemm": 1.0,
            "grouped_gemm": 1.0 if device == "cpu" else 0.8,
            "attention": min(1.0, attn / gemm),
            "kda": 0.3,
            "hbm": 1.0,
            "nvlink": 1.0,
            "network": 1.0,
            "flash_attention": True,
            "gemm_half_gflop": 0.0,
            **moe_terms(measured),
        },
        "measured": {
            "device": device,
            "gemm_tflops": gemm,
            "attention_tflops": attn,
            "copy_tbps": measured["copy_tbps"],
            "all_to_all_gbps_per_rank": a2a,
            "world_size": world_size,
            "backend": backend,
            "quick": measured["quick"],
            "sizes": measured["sizes"],
            "moe": measured.get("moe"),
        },
    }


def moe_terms(measured: dict) -> dict:
    """``moe_copy_ns`` / ``moe_layer_fixed_s`` efficiency entries when the MoE bookkeeping was measured."""
    moe = measured.get("moe")
    return {k: moe[k] for k in ("moe_copy_ns", "moe_layer_fixed_s")} if moe else {}


def merge_profiles(*profiles: dict) -> dict:
    """Mean of calibrated profiles (numbers averaged, the rest taken from the first), e.g. two calibrations
    bracketing a measured run on a machine whose free cores change while it runs."""
    if not profiles:
        raise ValueError("merge_profiles: needs at least one profile")

    def mean(values):
        first = values[0]
        if isinstance(first, dict):
            return {k: mean([v[k] for v in values]) for k in first}
        if isinstance(first, float):
            return sum(values) / len(values)
        return first

    return mean(list(profiles))
