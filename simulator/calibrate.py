"""``moonep simulate calibrate``: measure this machine and write a hardware profile JSON.

Measures (median of timed repeats after a warm-up): dense GEMM TFLOP/s (bf16 on GPU, fp32 on CPU where bf16
matmul is not a fast path), causal attention TFLOP/s (``scaled_dot_product_attention``, causal FLOPs counted as
half the square), memory-copy bandwidth, and all-to-all bandwidth per rank through ``collectives.launch``
(local ranks; gloo on CPU, NCCL on GPU). The profile sets the *achieved* rates as peaks with efficiencies of 1
(attention as a fraction of the GEMM rate), so the cost model reproduces the measurements; ``measured`` keeps
the raw numbers. This is the only simulator module that imports torch and collectives, lazily.
"""
from __future__ import annotations

import platform
import statistics
import time


def _timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_gemm(n: int, repeats: int, device: str) -> float:
    """Dense GEMM TFLOP/s of an ``n x n x n`` product."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run():
        torch.matmul(a, b)
        sync()

    return 2.0 * n ** 3 / _timed(run, repeats) / 1e12


def measure_attention(seq: int, heads: int, repeats: int, device: str) -> float:
    """Causal attention forward TFLOP/s (FLOPs = 2 * 2 * heads * seq^2 * d / 2)."""
    import torch
    import torch.nn.functional as F

    d = 128
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, heads, seq, d, device=device, dtype=dtype) for _ in range(3))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        sync()

    return 2.0 * heads * seq * seq * d / _timed(run, repeats) / 1e12


def measure_copy(nbytes: int, repeats: int, device: str) -> float:
    """Device memory bandwidth in TB/s (read + write of a tensor copy)."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run():
        dst.copy_(src)
        sync()

    return 2.0 * nbytes / _timed(run, repeats) / 1e12


def _a2a_rank(comm, nbytes: int, repeats: int) -> float:
    """Per-rank all-to-all bandwidth in GB/s (bytes this rank sends / time, slowest rank's time)."""
    import torch

    device = "cuda" if torch.cuda.is_available() and comm.backend != "mpi" else "cpu"
    rows = max(comm.world_size, nbytes // 1024 // comm.world_size * comm.world_size)
    inp = torch.ones(rows, 512, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(inp)
    comm.all_to_all_single(out, inp)
    times = []
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_to_all_single(out, inp, validate=False)
        if device == "cuda":
            torch.cuda.synchronize()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        comm.all_reduce(dt, op="max")
        times.append(float(dt))
    sent = inp.numel() * inp.element_size() * (comm.world_size - 1) / comm.world_size
    return sent / statistics.median(times) / 1e9


def calibrate(*, world_size: int = 2, quick: bool = False, backend: str = "torch") -> dict:
    """Measure and return a hardware profile dict loadable by ``hardware.load_hardware``."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    reps = 3 if quick else 10
    gemm = measure_gemm(512 if quick else (8192 if device == "cuda" else 2048), reps, device)
    attn = measure_attention(256 if quick else 2048, 4 if quick else 16, reps, device)
    copy = measure_copy((16 if quick else 256) * 2**20, reps, device)
    a2a = 0.0
    if world_size > 1:
        from collectives import launch

        a2a = launch(_a2a_rank, world_size, backend=backend, timeout=120.0,
                     nbytes=(1 if quick else 32) * 2**20, repeats=reps)
    name = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or platform.machine()
    mem_gib = (torch.cuda.get_device_properties(0).total_memory / 2**30 if device == "cuda" else 16.0)
    link = max(a2a, 1e-3)
    return {
        "name": f"calibrated {device}: {name}", "bf16_tflops": gemm, "fp8_tflops": 0.0, "hbm_gib": mem_gib,
        "hbm_tbps": copy, "nvlink_gbps": link, "nic_gbps": link, "gpus_per_node": max(1, world_size),
        "nvlink_latency_us": 10.0, "nic_latency_us": 20.0, "reserved_gib": 0.5,
        "efficiency": {"gemm": 1.0, "grouped_gemm": 0.8, "attention": min(1.0, attn / gemm), "kda": 0.3,
                       "hbm": 1.0, "nvlink": 1.0, "network": 1.0, "flash_attention": True,
                       "gemm_half_gflop": 0.0},
        "measured": {"device": device, "gemm_tflops": gemm, "attention_tflops": attn, "copy_tbps": copy,
                     "all_to_all_gbps_per_rank": a2a, "world_size": world_size, "backend": backend,
                     "quick": quick},
    }
