"""``moonep bench train``: training throughput and peak memory of a preset at EP = 1, 2, 4 (local CPU ranks).

Per world size: build the trainer, run one warm-up step, time ``steps`` steps (fwd + bwd + sync + optimizer +
balancing; the slowest rank's time per step), report global tokens/s from the median step and each rank's peak
resident memory (``ru_maxrss``, the whole process: torch, buffers and activations; torch has no CPU allocator
statistics). JSON: ``{"config", "results": [{"world_size", "tokens_per_s", "step_s", "peak_rss_mb"}]}``.

``run_muon_bench`` (``python -m k3.bench [--json PATH]``): ``opt.step()`` of Per-Head Muon, the per-block loop twin
(``k3.reference.PerHeadMuonLoop``) against the batched, DP-sharded optimizer, in the same ranks on the same
model and grads, steps interleaved, the slowest rank's time per step (median and min); plus the blocks each rank
ran through NS5 and the largest parameter difference between the two after the timed steps.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import resource
import statistics
import tempfile
import time
import zlib
from typing import TYPE_CHECKING

import torch

from collectives import launch
from k3.config import K3Config
from k3.model import build_model
from k3.muon import PerHeadMuon, param_groups
from k3.reference import PerHeadMuonLoop, param_groups_by_name
from k3.train import TrainConfig, Trainer
from moonep.parallel import is_expert
from moonep_base import write_json

if TYPE_CHECKING:
    from collectives.base import Communicator


def timed_steps(comm: Communicator, trainer: Trainer, first: int, steps: int) -> list[float]:
    """Seconds of ``trainer.step(first)`` ... ``trainer.step(first + steps - 1)``, each started after a barrier,
    the slowest rank's time per step (the same list on every rank)."""
    times = []
    for step in range(first, first + steps):
        comm.barrier()
        t0 = time.perf_counter()
        trainer.step(step)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if comm.world_size > 1:
            comm.all_reduce(dt, op="max")
        times.append(float(dt))
    return times


def bench_rank(comm: Communicator, train: dict, steps: int) -> dict:
    torch.set_num_threads(1)
    tc = TrainConfig(**train)
    trainer = Trainer(comm, tc)
    trainer.step(0)  # warm-up: allocations, first plan
    times = timed_steps(comm, trainer, 1, steps)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    if comm.world_size > 1:
        comm.all_reduce(rss, op="max")
    step_s = statistics.median(times)
    return {
        "world_size": comm.world_size,
        "tokens_per_s": tc.global_batch * tc.seq_len / step_s,
        "step_s": step_s,
        "peak_rss_mb": float(rss),
    }


def run_bench(preset: str = "tiny", world_sizes=(1, 2, 4), steps: int = 5, max_data_bytes: int = 1 << 20) -> dict:
    results = []
    with tempfile.TemporaryDirectory(prefix="k3-bench-") as tmp:
        for ws in world_sizes:
            tc = TrainConfig(
                preset=preset,
                world_size=ws,
                steps=steps + 1,
                progress=False,
                run_dir=tmp,
                max_data_bytes=max_data_bytes,
            )
            results.append(launch(bench_rank, ws, timeout=300, train=dataclasses.asdict(tc), steps=steps))
    return {
        "config": {
            "preset": preset,
            "steps": steps,
            "threads_per_rank": 1,
            "global_batch": tc.global_batch,
            "seq_len": tc.seq_len,
        },
        "results": results,
    }


def _timed_opt_step(comm: Communicator, opt: torch.optim.Optimizer) -> float:
    """Seconds of one ``opt.step()`` started after a barrier, the slowest rank's (the same on every rank)."""
    comm.barrier()
    t0 = time.perf_counter()
    opt.step()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    if comm.world_size > 1:
        comm.all_reduce(dt, op="max")
    return float(dt)


def muon_bench_rank(comm: Communicator, preset: str, steps: int) -> dict:
    """One rank: the preset at EP = world size, random grads (replicated ones equal on every rank, experts
    local), the loop twin and the new optimizer stepping twin copies of the model, one warm-up step each."""
    torch.set_num_threads(1)
    model = build_model(K3Config.preset(preset), seed=0, ep_size=comm.world_size, ep_rank=comm.rank)
    for name, p in model.named_parameters():
        rank = comm.rank if is_expert(p) else 0
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()) + rank))
    twin_model = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin_model.parameters()):
        q.grad = p.grad.clone()
    new = PerHeadMuon(param_groups(model), lr=1e-2, comm=comm)
    old = PerHeadMuonLoop(param_groups_by_name(twin_model), lr=1e-2)
    old_s, new_s = [], []
    for i in range(steps + 1):  # interleaved, so a busy machine slows both alike; step 0 warms up
        o, n = _timed_opt_step(comm, old), _timed_opt_step(comm, new)
        if i:
            old_s.append(o), new_s.append(n)
    with torch.no_grad():
        diff = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), twin_model.parameters()))
    loop_blocks = sum(_loop_blocks(g) for g in old.param_groups if g["kind"] == "muon")
    blocks = torch.tensor([new.ns_blocks, loop_blocks], dtype=torch.float64)
    if comm.world_size > 1:
        comm.all_reduce(blocks, op="max")
    o, n = statistics.median(old_s), statistics.median(new_s)
    return {
        "preset": preset,
        "world_size": comm.world_size,
        "old_step_s": o,
        "new_step_s": n,
        "speedup": o / n,
        "old_min_s": min(old_s),
        "new_min_s": min(new_s),
        "ns_blocks_new": int(blocks[0]),
        "ns_blocks_old": int(blocks[1]),
        "max_param_diff": diff,
    }


def _loop_blocks(group: dict) -> int:
    """Blocks the loop twin runs through NS5 for one Muon group: heads per matrix, experts per 3-D tensor."""
    return sum(p.shape[0] if p.dim() == 3 else h for p, h in zip(group["params"], group["heads"]))


def run_muon_bench(presets=("tiny", "small"), world_sizes=(1, 2), steps: int = 15) -> dict:
    """``muon_bench_rank`` for every preset and world size (local gloo ranks, one thread each)."""
    results = [
        launch(muon_bench_rank, ws, timeout=300, preset=preset, steps=steps) for preset in presets for ws in world_sizes
    ]
    return {
        "config": {
            "presets": list(presets),
            "world_sizes": list(world_sizes),
            "steps": steps,
            "threads_per_rank": 1,
            "lr": 1e-2,
        },
        "results": results,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3.bench", description="Per-Head Muon step: loop twin vs batched")
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--world-sizes", default="1,2")
    p.add_argument("--steps", type=int, default=15, help="timed steps (median and min reported)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    out = run_muon_bench(tuple(args.presets.split(",")), tuple(int(x) for x in args.world_sizes.split(",")), args.steps)
    for r in out["results"]:
        print(
            f"{r['preset']:>5} W={r['world_size']}: loop {r['old_step_s'] * 1e3:7.1f} ms, batched "
            f"{r['new_step_s'] * 1e3:7.1f} ms (median), x{r['speedup']:.2f}; min {r['old_min_s'] * 1e3:.1f} -> "
            f"{r['new_min_s'] * 1e3:.1f} ms; NS5 blocks per rank {r['ns_blocks_old']} -> {r['ns_blocks_new']}; "
            f"max |dparam| {r['max_param_diff']:.1e}"
        )
    if args.json:
        write_json(args.json, out)
    return 0


__all__ = ["run_bench", "bench_rank", "timed_steps", "run_muon_bench", "muon_bench_rank"]


if __name__ == "__main__":
    raise SystemExit(main())
