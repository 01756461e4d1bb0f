"""A plain two-rank DDP training job, NOT built on ``collectives``: what a user brings to ``moonep diagnose``.

Started the way torchrun starts it (``python -m torch.distributed.run --standalone --nproc_per_node=2``, env://
rendezvous). It writes, for the same run, everything such a user may have:

- ``profiler/``: PyTorch profiler traces (``--schedule``: ``tensorboard_trace_handler`` files with
  ``ProfilerStep#N``; otherwise one ``export_chrome_trace`` per rank, no step marks);
- ``fr/``: Flight Recorder dumps (``TORCH_FR_BUFFER_SIZE``), JSON, taken at the end or when a collective times out;
- ``jsonl/``: our JSON lines, traced the documented way (``collectives.trace.Tracer.record_event`` around data,
  forward, backward and optimizer, with ``cpu_s``): DDP's gradient all-reduce is hidden inside ``backward``;
- ``detector/``: the in-loop ``tools.detector.StragglerDetector``'s JSON lines and its findings
  (``detector/findings.json``, rank 0).

Faults (rank 1, from ``--onset``): ``sleep`` (30 ms in the loop, outside any op), ``cpu_thread`` (a competing
thread on its core), ``slow_data`` (the data loader sleeps 25 ms per batch), ``skip_collective`` (at step
``onset`` rank 1 skips the rest of the iteration, a per-rank "skip a bad batch" rule, so it skips that step's
collectives: every later call pairs with the other rank's call of the step before, and at the end the other
rank waits for an all-reduce that never comes while rank 1 waits in the final barrier, until the process
group's 4 s timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

from collectives.trace import Tracer
from tools.detector import StragglerDetector

SCENARIOS = ("clean", "sleep", "cpu_thread", "slow_data", "skip_collective")


class Batches(torch.utils.data.Dataset):
    """Random regression batches; on the faulty rank, a slow fetch from ``onset`` (``slow_data``)."""

    def __init__(self, n: int, slow_from: int | None):
        self.n, self.slow_from = n, slow_from
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 256, 256, generator=gen), torch.randn(n, 256, 256, generator=gen)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.slow_from is not None and i >= self.slow_from:
            time.sleep(0.025)
        return self.x[i], self.y[i]


def _hog(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(2000))  # pure Python: competes for the core and for the interpreter (a metrics thread, say)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", choices=SCENARIOS, default="clean")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--onset", type=int, default=10)
    p.add_argument("--out", required=True)
    p.add_argument("--schedule", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=4))
    rank = dist.get_rank()
    if args.scenario == "cpu_thread" and len(os.sched_getaffinity(0)) > 1:  # the thread must share rank 1's core
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    faulty = rank == 1
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    slow_from = args.onset if faulty and args.scenario == "slow_data" else None
    loader = torch.utils.data.DataLoader(Batches(args.steps, slow_from), batch_size=None)
    for sub in ("profiler", "fr", "jsonl", "detector"):
        os.makedirs(os.path.join(args.out, sub), exist_ok=True)
    tracer = Tracer(os.path.join(args.out, "jsonl"), rank)
    tracer.world_size = dist.get_world_size()
    det = StragglerDetector(every=8, window=60, trace_dir=os.path.join(args.out, "detector"))
    stop, hogs = threading.Event(), []
    kw = {}
    if args.schedule:
        handler = tensorboard_trace_handler(os.path.join(args.out, "profiler"), worker_name=f"host_{os.getpid()}")
        kw = {"schedule": schedule(wait=0, warmup=1, active=args.steps - 1), "on_trace_ready": handler}
    prof = profile(activities=[ProfilerActivity.CPU], **kw)
    try:
        with prof:
            _loop(args, rank, faulty, model, opt, loader, tracer, det, prof, stop, hogs)
    finally:
        stop.set()
        for hog in hogs:
            hog.join()  # a thread still running Python at interpreter exit can abort the process
        _finish(args, rank, prof, tracer, det)
        # a job that leaves its process group to interpreter exit can abort there ("terminate called without an
        # active exception", 1 run in ~15 on two cores): gloo's threads are torn down while still joinable
        dist.destroy_process_group()


def _timed(tracer: Tracer, op: str, fn, **fields):
    t0, c0 = time.time(), time.thread_time()
    out = fn()
    tracer.record_event(op, t0, time.time(), cpu_s=time.thread_time() - c0, **fields)
    return out


def _loop(args, rank, faulty, model, opt, loader, tracer, det, prof, stop, hogs) -> None:
    batches = iter(loader)
    loss_sum = torch.zeros(1)
    for step in range(args.steps):
        tracer.step = step
        with det.step():
            if faulty and step == args.onset and args.scenario == "cpu_thread":
                hogs.append(threading.Thread(target=_hog, args=(stop,), daemon=True))
                hogs[-1].start()
            if faulty and step >= args.onset and args.scenario == "sleep":
                time.sleep(0.03)  # outside every op: a host stall the ops do not show
            with det.section("data", kind="data"):
                x, y = _timed(tracer, "data_load", lambda: next(batches), kind="data")
            if faulty and step == args.onset and args.scenario == "skip_collective":
                continue  # "skip a bad batch", decided on one rank only: its collectives are skipped too
            with det.section("forward"), record_function("forward"):
                loss = _timed(tracer, "forward", lambda x=x, y=y: torch.nn.functional.mse_loss(model(x), y))
            with det.section("backward"):
                _timed(tracer, "backward", loss.backward)
            with det.section("optimizer"):
                _timed(tracer, "optimizer", lambda: (opt.step(), opt.zero_grad()))
            loss_sum += loss.detach()
            dist.all_reduce(loss_sum)  # the loss for logging
        if args.schedule:
            prof.step()
    dist.barrier()  # before saving: where a rank that skipped collectives waits for the others


def _finish(args, rank, prof, tracer, det) -> None:
    if not args.schedule:
        prof.export_chrome_trace(os.path.join(args.out, "profiler", f"host_{os.getpid()}.pt.trace.json"))
    with open(os.path.join(args.out, "fr", f"fr_trace_{rank}.json"), "wb") as f:
        f.write(torch._C._distributed_c10d._dump_fr_trace_json())
    tracer.close()
    try:
        findings = det.close()
    except Exception:  # the detector's last gather fails when a peer is gone (the hang scenario)
        findings = []
    if rank == 0:
        with open(os.path.join(args.out, "detector", "findings.json"), "w") as f:
            json.dump([f.to_json() for f in findings], f)


if __name__ == "__main__":
    main()
