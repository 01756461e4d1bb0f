"""Collective benchmarks: our ``Communicator`` against the raw backend call, in the same run.

``moonep bench collectives`` times all-to-all and all-gather over message sizes 4 KiB .. 64 MiB, interleaving
the raw call (``torch.distributed`` / mpi4py on the same group and buffers) with ours iteration by iteration,
so machine noise hits both alike. ``moonep roundtrip`` (the demo) dispatches rows with uneven splits and
returns them, checking every byte came back.

Time of one iteration = the slowest rank's time (max over ranks); reported time = median over iterations;
overhead = median over iterations of (ours / raw) - 1, a paired estimate (the variants run back to back, in
rotating order).
Bandwidth is per rank: bytes this rank sends (all-to-all) or receives (all-gather) per second.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from collectives.base import Communicator
from collectives.mpi_backend import MPICommunicator
from collectives.torch_backend import TorchCommunicator, _all_gather_single

RawCall = Callable[[torch.Tensor, torch.Tensor], object]
"""A backend's own collective on ``(out, inp)`` uint8 buffers, bypassing the ``Communicator``."""

KiB, MiB = 1024, 1024 * 1024
FULL_SIZES = tuple(4 * KiB * 4**i for i in range(8))  # 4 KiB, 16 KiB, ..., 64 MiB
QUICK_SIZES = (4 * KiB, 64 * KiB, 1 * MiB)


def _raw_calls(comm: Communicator) -> tuple[RawCall, RawCall]:
    """The backend's own all-to-all and all-gather on the same group, bypassing our layer."""
    if isinstance(comm, TorchCommunicator):
        group = comm.group
        return (
            lambda out, inp: dist.all_to_all_single(out, inp, group=group),
            lambda out, inp: _all_gather_single(out, inp, group=group),
        )
    if isinstance(comm, MPICommunicator):
        from mpi4py import MPI  # optional: mpi4py (the mpi extra); importing it initialises MPI

        mpi_comm = comm.comm

        def a2a(out: torch.Tensor, inp: torch.Tensor) -> None:
            mpi_comm.Alltoall([inp.numpy(), MPI.BYTE], [out.numpy(), MPI.BYTE])

        def gather(out: torch.Tensor, inp: torch.Tensor) -> None:
            mpi_comm.Allgather([inp.numpy(), MPI.BYTE], [out.numpy(), MPI.BYTE])

        return a2a, gather
    raise ValueError(f"no raw baseline for backend {comm.backend!r}")


def _time(fn, comm: Communicator, barrier) -> float:
    barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _iterations(nbytes: int, quick: bool) -> int:
    if quick:
        return 3
    return max(9, min(60, int(256 * MiB / max(nbytes, 1))))


def bench_collectives(comm: Communicator, sizes=FULL_SIZES, quick: bool = False, progress: bool = True) -> dict:
    """Times raw vs ours (and ours with argument validation) per op and size. Collective: call on every rank."""
    from tqdm import tqdm  # heavy: tqdm, kept out of ``import collectives.cli`` (--help); only rank 0 draws a bar

    raw_a2a, raw_gather = _raw_calls(comm)
    w = comm.world_size

    def raw_barrier():
        return raw_gather(torch.empty(w, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8))

    rows = []
    # Only rank 0 builds a bar: tqdm's lock is a named semaphore that other ranks would leave behind.
    for nbytes in tqdm(sizes, desc="sizes") if progress and comm.rank == 0 else sizes:
        for op, (raw, ours, checked, moved) in _cases(comm, nbytes, raw_a2a, raw_gather).items():
            times = {"raw": [], "ours": [], "ours_validated": []}
            for _ in range(2):  # warm-up: first calls set up connections and buffers
                for fn in (raw, ours, checked):
                    fn()
            variants = [("raw", raw), ("ours", ours), ("ours_validated", checked)]
            for i in range(_iterations(moved, quick)):
                # Rotate the order so no variant always runs first (warm caches, a just-woken rank).
                for name, fn in variants[i % 3 :] + variants[: i % 3]:
                    times[name].append(_time(fn, comm, raw_barrier))
            rows.append(_summarise(comm, op, moved, times))
    return _report(comm, rows)


def _cases(comm: Communicator, nbytes: int, raw_a2a: RawCall, raw_gather: RawCall) -> dict[str, tuple]:
    """``{op: (raw, ours, ours validated, bytes moved)}`` for one message size: the three variants are closures
    over this call's own uint8 buffers (``[nbytes // world * world]`` for the all-to-all, ``[nbytes // world]``
    in and ``[world * that]`` out for the all-gather), so each size's closures keep their own."""
    w = comm.world_size
    per_peer = max(1, nbytes // w)
    inp = torch.randint(0, 255, (per_peer * w,), dtype=torch.uint8)
    out = torch.empty_like(inp)
    g_inp = torch.randint(0, 255, (max(1, nbytes // w),), dtype=torch.uint8)
    g_out = torch.empty(g_inp.numel() * w, dtype=torch.uint8)
    return {
        "all_to_all": (
            lambda: raw_a2a(out, inp),
            lambda: comm.all_to_all_single(out, inp, validate=False, splits_agreed=True),
            lambda: comm.all_to_all_single(out, inp),
            inp.numel(),
        ),
        "all_gather": (
            lambda: raw_gather(g_out, g_inp),
            lambda: comm.all_gather(g_out, g_inp, validate=False),
            lambda: comm.all_gather(g_out, g_inp),
            g_out.numel(),
        ),
    }


def _summarise(comm: Communicator, op: str, moved: int, times: dict) -> dict:
    stacked = torch.tensor([times["raw"], times["ours"], times["ours_validated"]], dtype=torch.float64)
    comm.all_reduce(stacked, op="max", validate=False)  # an iteration lasts as long as its slowest rank
    raw, ours, checked = (statistics.median(r) for r in stacked.tolist())
    # Paired estimate: each iteration ran all three back to back, so their ratio cancels slow phases of the
    # machine that a ratio of medians would not.
    paired = (stacked[1] / stacked[0]).median().item() - 1.0
    paired_checked = (stacked[2] / stacked[0]).median().item() - 1.0
    return {
        "op": op,
        "bytes": moved,
        "iterations": stacked.shape[1],
        "raw_s": raw,
        "ours_s": ours,
        "ours_validated_s": checked,
        "raw_gbps": moved / raw / 1e9,
        "ours_gbps": moved / ours / 1e9,
        "overhead": paired,
        "overhead_validated": paired_checked,
    }


def _report(comm: Communicator, rows: list[dict]) -> dict:
    big = [r["overhead"] for r in rows if r["bytes"] >= MiB]
    return {
        "backend": comm.backend,
        "world_size": comm.world_size,
        "threads_per_rank": torch.get_num_threads(),
        "results": rows,
        "summary": {
            "goal_overhead_ge_1MiB": 0.05,
            "median_overhead_ge_1MiB": statistics.median(big) if big else None,
            "max_overhead_ge_1MiB": max(big) if big else None,
            "met": bool(big) and statistics.median(big) <= 0.05,
        },
    }


def format_table(report: dict) -> str:
    lines = [
        f"backend={report['backend']} world_size={report['world_size']} (per-rank GB/s, median of slowest-rank times)",
        f"{'op':<11} {'size':>9} {'raw GB/s':>9} {'ours GB/s':>9} {'overhead':>9} {'+validate':>10}",
    ]
    for r in report["results"]:
        lines.append(
            f"{r['op']:<11} {_size(r['bytes']):>9} {r['raw_gbps']:>9.3f} {r['ours_gbps']:>9.3f} "
            f"{r['overhead']:>+9.1%} {r['overhead_validated']:>+10.1%}"
        )
    s = report["summary"]
    if s["median_overhead_ge_1MiB"] is not None:
        lines.append(
            f"overhead at >= 1 MiB: median {s['median_overhead_ge_1MiB']:+.1%}, max "
            f"{s['max_overhead_ge_1MiB']:+.1%} (goal <= +5%: {'met' if s['met'] else 'NOT met'})"
        )
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


# ------------------------------------------------------------------------------------------- round trip demo
def round_trip_bytes(world: int, hidden: int, sizes=(64 * KiB, 1 * MiB, 16 * MiB)) -> int:
    """Bytes the round trip's ranks hold together at its largest size, rows ``[max(world, nbytes / (2 hidden)),
    hidden]``: 12 bytes per element per rank, six bf16 copies (the rows and their fp32 draw, the received and
    returned rows, gloo's staging; measured 11.6 at 2 ranks and 2 x 2e8 elements)."""
    return world * 12 * hidden * max(world, max(sizes) // (hidden * 2))


def round_trip(comm: Communicator, sizes=(64 * KiB, 1 * MiB, 16 * MiB), hidden: int = 1024, seed: int = 0) -> dict:
    """Dispatch bf16 rows ``[rows, hidden]`` to every rank with uneven splits, send them back, check and time.

    Split sizes come from one generator seeded identically everywhere, so every rank knows the whole
    ``[world, world]`` row matrix without exchanging it (as the EP layer knows it from the shared plan).
    """
    w, r = comm.world_size, comm.rank
    report = []
    for nbytes in sizes:
        rows_per_rank = max(w, nbytes // (hidden * 2))
        gen = torch.Generator().manual_seed(seed + nbytes)
        weights = torch.rand(w, w, generator=gen) + 0.05
        matrix = (weights / weights.sum(1, keepdim=True) * rows_per_rank).floor().long()
        matrix[:, -1] += rows_per_rank - matrix.sum(1)  # each row of the matrix sums to rows_per_rank exactly
        if w > 1:  # a zero-length part, as EP sees for ranks that need nothing from a peer
            matrix[0, 1] += matrix[0, 0]
            matrix[0, 0] = 0
        in_splits, out_splits = matrix[r].tolist(), matrix[:, r].tolist()
        tokens = torch.randn(rows_per_rank, hidden, generator=torch.Generator().manual_seed(seed + r)).bfloat16()
        received = torch.empty(sum(out_splits), hidden, dtype=torch.bfloat16)
        back = torch.empty_like(tokens)
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_to_all_single(received, tokens, out_splits, in_splits)
        t1 = time.perf_counter()
        comm.all_to_all_single(back, received, in_splits, out_splits)
        t2 = time.perf_counter()
        ok = torch.tensor([int(torch.equal(back, tokens))])
        comm.all_reduce(ok, op="min")
        timing = torch.tensor([t1 - t0, t2 - t1], dtype=torch.float64)
        comm.all_reduce(timing, op="max")
        sent = tokens.numel() * 2
        report.append(
            {
                "bytes_per_rank": sent,
                "dispatch_s": timing[0].item(),
                "combine_s": timing[1].item(),
                "dispatch_gbps": sent / timing[0].item() / 1e9,
                "combine_gbps": sent / timing[1].item() / 1e9,
                "verified": bool(ok.item()),
            }
        )
    return {"backend": comm.backend, "world_size": w, "hidden": hidden, "dtype": "bfloat16", "results": report}


def format_round_trip(report: dict) -> str:
    lines = [
        f"all-to-all round trip: {report['world_size']} ranks, backend={report['backend']}, "
        f"bf16 rows of {report['hidden']}, uneven splits",
        f"{'per rank':>9} {'dispatch GB/s':>14} {'combine GB/s':>13} {'data back intact':>17}",
    ]
    for r in report["results"]:
        lines.append(
            f"{_size(r['bytes_per_rank']):>9} {r['dispatch_gbps']:>14.3f} {r['combine_gbps']:>13.3f} "
            f"{'yes' if r['verified'] else 'NO':>17}"
        )
    return "\n".join(lines)
