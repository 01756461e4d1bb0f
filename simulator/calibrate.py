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
(the 20% test does). On a GPU it also measures the MoE fixed terms (``simulator.calibrate_moe``). This and
``calibrate_moe`` are the only simulator modules that import torch (the rest of the simulator is numbers
in, numbers out), and ``collectives`` and ``cp_kda`` inside the two functions that run them, as the layering's
listed exceptions (``tests/test_layers.py``): it measures them.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from simulator.specs import load_model


@dataclass(kw_only=True, frozen=True)
class CalibrationSizes:
    """The job shapes the host and GEMM measurements are taken at (``from_model`` reads them off a model)."""

    tokens: int = 256
    """Tokens per rank per micro-batch (activation rows)."""
    hidden: int = 64
    """Model width (activation columns)."""
    seq_len: int = 64
    """Sequence length (KDA kernel and attention)."""
    kda_heads: int = 2
    """KDA heads of the kernel measurement."""
    kda_head_dim: int = 16
    """KDA head width of the kernel measurement."""
    experts: int = 8
    """Routed experts of the MoE bookkeeping measurement (``simulator.calibrate_moe``, GPU only)."""
    top_k: int = 2
    """Experts per token of that measurement."""

    def __post_init__(self):
        for name in ("tokens", "hidden", "seq_len", "kda_heads", "kda_head_dim", "experts", "top_k"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"CalibrationSizes.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.tokens % self.seq_len or self.tokens < 2:
            raise ValueError(
                f"CalibrationSizes.tokens {self.tokens} must be a multiple of seq_len {self.seq_len} and >= 2"
            )

    @classmethod
    def from_model(cls, model, seq_len: int | None = None, micro_batch: int = 1) -> "CalibrationSizes":
        """Sizes of ``model`` (anything ``load_model`` takes) at ``micro_batch`` sequences of ``seq_len``."""
        spec = load_model(model)
        seq = seq_len or spec.seq_len
        return cls(
            tokens=micro_batch * seq,
            hidden=spec.hidden,
            seq_len=seq,
            kda_heads=spec.kda_heads or 2,
            kda_head_dim=spec.kda_head_dim or 16,
            experts=spec.num_experts or 8,
            top_k=spec.top_k or 2,
        )


def _timed(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


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
    return 2.0 * m * k * n * calls / _timed(run, repeats, clock) / 1e12


def measure_attention(seq: int, heads: int, repeats: int, device: str) -> float:
    """Causal attention forward TFLOP/s (FLOPs = 2 * 2 * heads * seq^2 * d / 2)."""
    d = 128
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, heads, seq, d, device=device, dtype=dtype) for _ in range(3))
    sync = _sync(device)

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        sync()

    return 2.0 * heads * seq * seq * d / _timed(run, repeats) / 1e12


def measure_copy(nbytes: int, repeats: int, device: str) -> float:
    """Device memory bandwidth in TB/s (read + write of a tensor copy)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    sync = _sync(device)

    def run():
        dst.copy_(src)
        sync()

    return 2.0 * nbytes / _timed(run, repeats) / 1e12


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
        comm.all_to_all_single(out, inp, validate=False)
        if device == "cuda":
            torch.cuda.synchronize()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        comm.all_reduce(dt, op="max")
        times.append(float(dt))
    sent = inp.numel() * inp.element_size() * (comm.world_size - 1) / comm.world_size
    return sent / statistics.median(times) / 1e9


# ------------------------------------------------------------------------------------------ host (CPU) costs
def _reference_block(width: int):
    """A small eager block in the style of model code: RMS norm, tanh/sigmoid gate, softmax mix of two sources
    and a row gather, each an ``nn.Module`` call under autograd."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(width))
            self.bias = nn.Parameter(torch.zeros(width))

        def forward(self, x):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.gain
            h = torch.tanh(h / 4.0) * torch.sigmoid(h + self.bias)
            h = h.index_select(0, torch.arange(x.shape[0])).contiguous()
            v = torch.stack([x, h], 0)
            w = torch.softmax(v.mean(-1), dim=0)
            return (w.unsqueeze(-1) * v).sum(0)

    return nn.Sequential(*(Block() for _ in range(20)))


def _count_ops(fn) -> int:
    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def solo_timer(repeats: int):
    """Seconds per call of ``fn`` on this rank alone: median CPU time of ``repeats`` calls after a warm-up."""
    return lambda fn: _timed(fn, repeats, time.process_time)


def _agreed_count(comm, fn, seconds: float, minimum: int) -> int:
    """How many calls of ``fn`` take about ``seconds`` of CPU time on this rank (after a warm-up call); the
    largest over ranks, so that every rank runs the same count."""
    fn()
    t0 = time.process_time()
    fn()
    count = torch.tensor([max(minimum, round(seconds / max(time.process_time() - t0, 1e-6)))], dtype=torch.int64)
    comm.all_reduce(count, op="max", validate=False)
    return int(count)


def _wall_per_call(comm, fn, count: int) -> float:
    """Seconds per call of ``fn`` looped ``count`` times by every rank at once after a barrier: wall time,
    mean over ranks."""
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(count):
        fn()
    wall = torch.tensor([(time.perf_counter() - t0) / count], dtype=torch.float64)
    comm.all_reduce(wall, validate=False)
    return float(wall) / comm.world_size


def shared_timer(comm, seconds: float):
    """Seconds per call of ``fn`` while every rank of ``comm`` runs it: each rank loops ``fn`` for about
    ``seconds`` of CPU time (the same count on all ranks), wall time per call averaged over ranks. That is the
    time one rank of a job sees when all local ranks do this work at once, time sharing included, measured
    directly rather than as a solo cost times a separately measured stretch (whose noises multiply). Ranks that
    finish first free their cores for the rest, so the tail reads slightly less contention than a job sees."""
    return lambda fn: _wall_per_call(comm, fn, _agreed_count(comm, fn, seconds, 3))


def measure_ops(tokens: int, width: int, timer) -> tuple[float, float, float]:
    """Microseconds per framework op of the reference block: (forward, backward, no-grad forward), as
    ``timer`` (``solo_timer`` or ``shared_timer``) measures a call."""
    blocks, x = _reference_block(width), torch.randn(tokens, width, requires_grad=True)

    def fwd():
        return blocks(x)

    y = fwd()
    n_fwd, n_bwd = _count_ops(fwd), _count_ops(lambda: y.sum().backward())
    t_fwd = timer(fwd)
    t_both = timer(lambda: fwd().sum().backward())
    with torch.no_grad():
        t_nograd = timer(fwd)
    return t_fwd / n_fwd * 1e6, max(0.0, t_both - t_fwd) / n_bwd * 1e6, t_nograd / n_fwd * 1e6


def measure_kda(batch: int, seq: int, heads: int, dim: int, timer) -> float:
    """Microseconds of one ``cp_kda`` gate + chunk call, forward and backward, on ``[batch, seq, heads, dim]``."""
    import cp_kda  # layering exception: times the real kernel (listed in tests/test_layers.py)

    gen = torch.Generator().manual_seed(0)
    shape = (batch, seq, heads, dim)
    q, k = (torch.nn.functional.normalize(torch.randn(shape, generator=gen), dim=-1) for _ in range(2))
    v, f = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    beta = torch.rand(shape[:3], generator=gen)
    leaves = [t.requires_grad_() for t in (q, k, v, f, beta)]
    a_log, dt_bias = torch.zeros(heads, requires_grad=True), torch.zeros(heads * dim, requires_grad=True)

    def run():
        g = cp_kda.kda_gate(leaves[3], a_log, dt_bias, lower_bound=-5.0)
        cp_kda.kda_chunk(leaves[0], leaves[1], leaves[2], g, leaves[4])[0].sum().backward()

    return timer(run) * 1e6


def _per_call_us(comm, fn, repeats: int) -> float:
    """Wall microseconds per call of the collective ``fn``, all ranks calling back to back, mean over ranks.

    Wall, not CPU time: with ranks time-sharing cores a call lasts until every peer has been scheduled to do its
    part (measured here at 4 ranks on 2 cores: 2.6-2.8x a call's CPU time, against 2.2x for busy work), and that
    is what a training step waits for."""
    fn()
    return _wall_per_call(comm, fn, repeats) * 1e6


def _collective_costs(comm, repeats: int, big: int) -> dict:
    """Per-call and per-MB wall costs of the collectives a training step issues (small vs ``big`` bytes)."""
    R, out = comm.world_size, {}
    for nbytes, tag in ((1024, "small"), (big, "big")):
        rows = max(R, nbytes // 128 // R * R)
        inp = torch.ones(rows, 32)
        got = torch.empty_like(inp)
        out[f"a2a_{tag}"] = _per_call_us(comm, lambda: comm.all_to_all_single(got, inp, validate=False), repeats)
        buf = torch.ones(max(1, nbytes // 4))
        out[f"ar_{tag}"] = _per_call_us(comm, lambda: comm.all_reduce(buf, validate=False), repeats)
    small = torch.ones(256)
    out["checked"] = _per_call_us(comm, lambda: comm.all_reduce(small), repeats)
    counts, gathered = torch.zeros(16, dtype=torch.int64), torch.empty(16 * R, dtype=torch.int64)
    out["ag"] = _per_call_us(comm, lambda: comm.all_gather(gathered, counts, validate=False), repeats)
    return out


PROBE_SECONDS = 0.3
"""CPU seconds of the effective-cores work on one rank alone: shorter windows are dominated by scheduler
granularity (a 50 ms probe scattered 0.6-2.0 effective cores on one idle-ish machine, 300 ms 0.8-1.05)."""


def _effective_cores(comm, sizes: CalibrationSizes, rounds: int) -> float:
    """Throughput of all ranks busy at once, in units of one rank alone: R * (CPU time alone) / (wall together)."""
    blocks, x = _reference_block(sizes.hidden), torch.randn(sizes.tokens, sizes.hidden, requires_grad=True)

    def step():
        blocks(x).sum().backward()

    count = _agreed_count(comm, step, PROBE_SECONDS, 1)  # every rank does the same work
    work = lambda: [step() for _ in range(count)]  # noqa: E731
    ratios = []
    for _ in range(rounds):
        comm.barrier()
        alone = torch.zeros(1, dtype=torch.float64)
        if comm.rank == 0:
            t0 = time.process_time()
            work()
            alone[0] = time.process_time() - t0
        comm.all_reduce(alone, validate=False)
        comm.barrier()
        t0 = time.perf_counter()
        work()
        wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        comm.all_reduce(wall, op="max", validate=False)
        ratios.append(comm.world_size * float(alone) / float(wall))
    return min(float(comm.world_size), statistics.median(ratios))


BIG = 1 << 20
"""Bytes of the large collective measurements (the per-MB costs are big minus small)."""


SHARED_SECONDS_PER_REPEAT = 0.04
"""CPU seconds each rank loops one shared measurement for, per repeat (quick: 5 repeats, 0.2 s)."""


def _op_costs(sizes: CalibrationSizes, timer) -> dict:
    """Per-op and KDA host costs as ``timer`` measures them."""
    tiny, act = measure_ops(8, 8, timer), measure_ops(sizes.tokens, sizes.hidden, timer)
    rows, tiny_tokens = sizes.tokens // sizes.seq_len, min(16, sizes.tokens // 2)  # tiny: the fixed cost
    return {
        "ops_tiny": tiny,
        "ops_act": act,
        "tiny_tokens": tiny_tokens,
        "kda": measure_kda(rows, sizes.seq_len, sizes.kda_heads, sizes.kda_head_dim, timer),
        "kda_tiny": measure_kda(1, tiny_tokens, sizes.kda_heads, sizes.kda_head_dim, timer),
    }


def _ranks_body(comm, sizes: CalibrationSizes, repeats: int, nbytes: int, host: bool) -> dict:
    """What ``measure_in_group`` measures on all ranks at once: all-to-all bandwidth, and on CPU the
    collectives' and the per-op and KDA costs with all ranks busy at once, then the effective cores (which
    only rescale those costs to another rank count)."""
    out = {"a2a_gbps": _a2a_rank(comm, nbytes, repeats)}
    if host:
        out.update(_collective_costs(comm, repeats * 6, BIG))
        out.update(_op_costs(sizes, shared_timer(comm, SHARED_SECONDS_PER_REPEAT * repeats)))
        out["effective_cores"] = _effective_cores(comm, sizes, 3 if repeats < 10 else 5)
    return out


def calibrate_host(m: dict) -> dict:
    """The ``host`` block of a CPU profile (fields of ``hardware.HostSpec``) from ``measure_in_group``'s (or a
    one-rank ``calibrate``'s) measurements."""
    per_mb = lambda key: max(0.0, m.get(f"{key}_big", 0.0) - m.get(f"{key}_small", 0.0)) / (BIG / 1e6)  # noqa: E731
    (tf, tb, tn), (af, ab, _) = m["ops_tiny"], m["ops_act"]
    sizes = CalibrationSizes(**m["sizes"])
    return {
        "timing": "shared_wall",
        "cores": len(os.sched_getaffinity(0)),
        "effective_cores": m.get("effective_cores", 1.0),
        "ranks": m["world_size"],
        "op_fwd_tiny_us": tf,
        "op_bwd_tiny_us": tb,
        "op_nograd_tiny_us": tn,
        "op_fwd_us": af,
        "op_bwd_us": ab,
        "ref_elements": sizes.tokens * sizes.hidden,
        "kda_us": m["kda"],
        "kda_tiny_us": m["kda_tiny"],
        "kda_elements": sizes.tokens * sizes.kda_heads * sizes.kda_head_dim,
        "kda_tiny_elements": m["tiny_tokens"] * sizes.kda_heads * sizes.kda_head_dim,
        "a2a_call_us": m.get("a2a_small", 0.0),
        "all_reduce_call_us": m.get("ar_small", 0.0),
        "checked_all_reduce_call_us": m.get("checked", 0.0),
        "all_gather_call_us": m.get("ag", 0.0),
        "a2a_us_per_mb": per_mb("a2a"),
        "all_reduce_us_per_mb": per_mb("ar"),
    }


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
            measured.update(_op_costs(sizes, solo_timer(repeats)))
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
