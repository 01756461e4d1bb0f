"""The main job: train K3 on real text with expert parallelism (moonep) across ranks and data parallelism.

    python -m k3.train --preset tiny --world-size 4 --steps 300 --run-dir out/k3-tiny
    moonep train --preset tiny --world-size 4 --steps 300                 # the same

EP spans all ranks (each holds E/R routed experts); every other parameter is replicated and its gradient summed
over ranks (data parallel). The global batch (``global_batch`` rows of ``seq_len`` + 1 bytes) is fixed by the
preset and split across ranks, and the loss is the global token mean, so results do not depend on the world
size up to summation order. fp32, on CPU by default (``device="cuda"``: one GPU per rank); Per-Head Muon +
QK-Clip (AdamW for embeddings, head, norms, router, biases, AttnRes queries, KDA conv/decay parameters), or
AdamW everywhere with ``optimizer="adamw"``.

Tracing (``trace_dir`` or ``$MOONEP_TRACE_DIR``) adds, next to the collectives' own records, one ``kind="data"``
record per step and ``kind="compute"`` records per phase with ``cpu_s`` (thread CPU time): ``forward``,
``backward``, ``grad_sync``, ``optimizer`` and ``evaluate`` (validation loss; not ``validate``, the collectives'
argument check). Forward, backward and evaluate are split per sublayer call (``layer``: ``kda``, ``mla``, ``moe``,
``dense``; ``index``: layer number) plus one ``layer="other"`` remainder (embedding, AttnRes mixes, norms, head,
loss) whose ``t_enter``/``t_exit`` span the whole phase. Injected faults (``slowdowns``, ``data_delays``,
``link_delays``; grammar in ``collectives/faults.py``) feed ``moonep diagnose``'s tests and demos.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from collectives import launch
from collectives.faults import LinkDelay, faults_at
from collectives.launch import LaunchError, external_launcher, rank_device
from k3.balance import rows_per_rank, update_router_biases
from k3.checkpoint import claim_run, clean_run_dir
from k3.config import K3Config
from k3.data import batch, load_corpus
from k3.model import build_model, token_loss_sum
from k3.muon import qk_clip
from k3.optim import build_optimizer, lr_at
from k3.parallelize import ParallelDims, parallelize_k3, shard_batch
from k3.rank_errors import rank_error, record_error
from k3.run_folder import RunLock, check_run_lock, identity, lock_run, metrics_file, prepare_run
from k3.trace import PhaseClock
from k3.train_checkpoint import Checkpointing
from k3.train_config import TrainConfig
from k3.train_flags import add_train_flags, config_fields
from moonep_base import run, write_json

if TYPE_CHECKING:
    from collectives.base import Communicator


class Trainer(Checkpointing):
    """State of one rank: model, optimizer, data; ``step()`` runs one global step.

    Args:
        comm: the world communicator (every rank: EP and DP span it; CP groups are split from it).
        tc: the run.
    """

    def __init__(self, comm: Communicator, tc: TrainConfig) -> None:
        self.comm, self.tc = comm, tc
        self.cfg = K3Config.preset(tc.preset)
        R = comm.world_size
        if self.cfg.num_experts % R:
            raise ValueError(f"world_size: {R} does not divide num_experts={self.cfg.num_experts}")
        if R % tc.cp or tc.global_batch % (R // tc.cp):  # torchrun/mpiexec decide R: check again
            raise ValueError(f"cp: {tc.cp} and global_batch {tc.global_batch} do not fit world size {R}")
        tc.check_fault_ranks(R)
        self.rows, self.T_l = tc.global_batch // (R // tc.cp), tc.seq_len // tc.cp
        self.device = rank_device(comm, tc.device)  # before any sub-group, so NCCL binds the right GPU
        self.dims = ParallelDims.build(comm, tc.cp)
        # built on the host (the seeded init is the same on any device), then moved; single-device code, its
        # experts built for this EP rank; parallelism is applied from outside (k3.parallelize)
        self.model = build_model(self.cfg, seed=tc.seed, ep_size=R, ep_rank=comm.rank).to(self.device)
        self.dp = parallelize_k3(self.model, self.dims, tokens=self.rows * self.T_l, device=self.device)
        # comm: replicated grads are all-reduced over the world (DataParallel.sync_grads), so NS5 is split over it
        self.opt = build_optimizer(self.model, tc.optimizer, lr=tc.lr, weight_decay=tc.weight_decay, comm=comm)
        self.names = {id(p): n for n, p in self.dp.params.items()}
        self.opt_steps = 0
        for layer in self.model.layers:
            if hasattr(layer.self_attn, "track_logits"):
                layer.self_attn.track_logits = bool(tc.qk_clip_tau) and tc.optimizer == "muon"
        self.corpus = load_corpus(tc.data, max_bytes=tc.max_data_bytes)
        self.clock = PhaseClock(comm.tracer)
        if comm.tracer is not None:
            self.clock.attach(self.model)
        self.links_done: set[LinkDelay] = set()
        self.run: dict | None = None
        """``run.json`` of this run (rank 0 writes its id into every checkpoint manifest)."""
        self.lock = RunLock()
        """The run folder's lock (held on rank 0 from ``_start`` until the run ends)."""

    def local(self, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's data-parallel rows and context-parallel token slice (``k3.parallelize.shard_batch``).

        Args:
            full: [G, seq_len + 1] int64, the global batch.

        Returns:
            (inputs, targets), each [rows, T_l] int64 on the rank's device.
        """
        return shard_batch(full, self.dims, self.rows, self.T_l, self.device)

    def _inject(self, step: int) -> float:
        """Start this step's injected faults; returns the data-loading delay in ms."""
        self.clock.factor, data_ms, links = faults_at(self.tc, self.comm.rank, step)
        for d in links:
            if d not in self.links_done:  # a resumed run starts past from_step: apply at its first step
                self.links_done.add(d)
                for comm in self.dims.comms():  # a sub-group keeps its own delay table
                    comm.inject_link_delay(d.src, d.dst, d.ms)
        return data_ms

    def step(self, step: int) -> dict:
        """One global step: forward, backward, gradient sync and clip, optimizer, QK-Clip, router balancing.

        Args:
            step: the 0-based step (picks the batch, the learning rate and the injected faults).

        Returns:
            the step's metrics row (``metrics.jsonl``): loss, lr, grad_norm, tokens_per_s, balance figures.
        """
        tc, clock = self.tc, self.clock
        if self.comm.tracer is not None:
            self.comm.tracer.step = step
        t0 = time.perf_counter()
        with clock.data(self._inject(step)):
            inputs, targets = self.local(batch(self.corpus.train, tc.seed, step, tc.global_batch, tc.seq_len))
        count = tc.global_batch * tc.seq_len
        with clock.phase("forward"):
            self.model.zero_grad(set_to_none=True)
            loss_sum = token_loss_sum(self.model, inputs, targets)
        with clock.phase("backward"):
            (loss_sum / count).backward()
        with clock.phase("grad_sync"):
            loss = self.dp.sync_grads(loss_sum) / count
            grad_norm = self.dp.clip_grad_norm_(tc.grad_clip)
        with clock.phase("optimizer"):
            lr = lr_at(step, tc.schedule_steps or tc.steps, tc.lr, tc.warmup)
            self.opt.set_lr(lr)
            self.opt.step()
            self.opt_steps += 1
            max_logits = qk_clip(self.model, self.comm, tc.qk_clip_tau) if tc.qk_clip_tau else []
            violations, rows = self._balance()
        seconds = time.perf_counter() - t0
        return {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": count / seconds,
            "max_violation": max(violations),
            "max_violation_per_layer": violations,
            "rows_moonep_per_layer": [int(v) for v in rows[0::2]],
            "rows_classic_per_layer": [int(v) for v in rows[1::2]],
            "max_logit": max(max_logits, default=None),
        }

    def _balance(self) -> tuple[list[float], list[float]]:
        """Update the router biases; returns (per-layer max violation, per layer the busiest rank's rows: ours and
        classic, interleaved). The bias computed from this step's batch steers the NEXT step's routing (never its
        own batch); update_router_biases never reads the device: this is where its [Lm] result is read back."""
        moes = self.model.moe_layers()
        violations = update_router_biases(moes, self.comm, self.tc.balance)
        counts = torch.stack([m.gate.last_global_counts for m in moes])
        # one read for the log row: violations, then per layer the busiest rank's rows (ours, classic)
        logged = torch.cat((violations.double(), rows_per_rank(counts, self.comm.world_size).double().flatten()))
        logged = logged.tolist()
        return logged[: len(moes)], logged[len(moes) :]

    def close(self) -> None:
        """Explicit teardown of what this rank created (the CP sub-group); the world comm is the launcher's."""
        self.dims.close()

    @torch.no_grad()
    def validate(self) -> float:
        """Collective: the validation loss over ``val_batches`` held-out global batches.

        Returns:
            the global token mean of the cross-entropy (the same on every rank).
        """
        tc, total = self.tc, torch.zeros(1, dtype=torch.float64, device=self.device)
        with self.clock.phase("evaluate"):
            for i in range(tc.val_batches):
                inputs, targets = self.local(batch(self.corpus.val, tc.seed + 1, i, tc.global_batch, tc.seq_len))
                total += float(token_loss_sum(self.model, inputs, targets))
        if self.comm.world_size > 1:
            self.comm.all_reduce(total)
        return float(total) / (tc.val_batches * tc.global_batch * tc.seq_len)


def run_rank(comm: Communicator, train: dict) -> dict:
    """Body of every rank (module level for ``collectives.launch``). An exception leaves its traceback in
    ``<run_dir>/errors/rank<R>.traceback`` (``k3.rank_errors``; ``moonep train`` prints that path).

    Args:
        comm: the world communicator.
        train: the run, as ``dataclasses.asdict(TrainConfig)``.

    Returns:
        this rank's summary (losses, val_loss, start, run_dir, plots, rank).
    """
    try:
        return _run_rank(comm, TrainConfig(**train))
    except Exception as exc:
        with contextlib.suppress(OSError):  # an unwritable run folder must not hide the rank's own error
            record_error(train.get("run_dir") or ".", comm.rank, exc)
        raise


def _start(comm: Communicator, tc: TrainConfig) -> tuple[TrainConfig, Trainer, int]:
    """Check the run folder, lock it (rank 0, for the run's life: ``trainer.lock``; a folder another run holds
    fails every rank, naming that run), build the trainer, claim or resume the run: (tc, trainer, first step)."""
    tc, run = prepare_run(tc, comm.world_size)
    lock = lock_run(comm, tc.run_dir, run and run["run_id"])
    try:
        tc, run = prepare_run(tc, comm.world_size)  # again under the lock: a run that ended meanwhile counts
        trainer = Trainer(comm, tc)
        if comm.rank == 0:
            clean_run_dir(tc.run_dir)  # a crash's leftovers, before anyone writes
            run = run or claim_run(tc.run_dir, identity(tc, comm.world_size), lock.run_id)
        trainer.run, trainer.lock = run, lock  # rank 0 writes the run into every manifest
        comm.barrier()
        return tc, trainer, trainer.restore() if tc.resume else 0
    except BaseException:
        lock.release()
        raise


def _run_rank(comm: Communicator, tc: TrainConfig) -> dict:
    torch.set_num_threads(1)
    tc, trainer, start = _start(comm, tc)
    rank0 = comm.rank == 0
    if rank0:
        os.makedirs(tc.run_dir, exist_ok=True)
        trainer.cfg.to_json(os.path.join(tc.run_dir, "config.json"))
        write_json(os.path.join(tc.run_dir, "train.json"), dataclasses.asdict(tc))
        metrics_path = metrics_file(tc.run_dir, start)
    losses, val_loss = [], None
    bar = tqdm(range(start, tc.steps), disable=not (rank0 and tc.progress), desc="k3 train", unit="step")
    for step in bar:
        row = trainer.step(step)
        last = step == tc.steps - 1
        if (step + 1) % tc.val_every == 0 or last:
            row["val_loss"] = val_loss = trainer.validate()
        losses.append(row["loss"])
        if rank0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            bar.set_postfix(loss=f"{row['loss']:.3f}", maxvio=f"{row['max_violation']:.2f}")
        if (tc.ckpt_every and (step + 1) % tc.ckpt_every == 0) or last:
            trainer.save(step + 1)
        if comm.tracer is not None:
            comm.tracer.flush()  # one append per step, so `moonep diagnose --follow` sees each step as it ends
    trainer.close()
    plots = []
    if rank0:
        from k3.plots import write_plots  # heavy: matplotlib, rank 0 only

        plots = write_plots(tc.run_dir)
    trainer.lock.release()
    return {
        "losses": losses,
        "val_loss": val_loss,
        "start": start,
        "run_dir": tc.run_dir,
        "plots": plots,
        "rank": comm.rank,
    }


def train(tc: TrainConfig, *, timeout: float = 300.0) -> dict:
    """Launch ``tc.world_size`` local ranks (or join torchrun/mpiexec) and train.

    Args:
        tc: the run.
        timeout: seconds a collective may wait for a peer before the job fails.

    Returns:
        rank 0's summary (``losses``: train loss per step run, ``val_loss``, ``start``, ``run_dir``, ``plots``,
        ``rank``); under torchrun/mpiexec each rank's own.
    """
    if external_launcher() is None:  # under torchrun/mpiexec the launcher's size counts: Trainer checks it
        tc.check_fault_ranks(tc.world_size)
        tc = prepare_run(tc, tc.world_size)[0]  # a bad run folder fails here, before any rank starts
        check_run_lock(tc.run_dir)  # so does a folder another run holds (the ranks check again, under the lock)
    return launch(run_rank, tc.world_size, timeout=timeout, trace_dir=tc.trace_dir, train=dataclasses.asdict(tc))


def train_command(args: argparse.Namespace) -> int:
    """The ``train`` command (``moonep train``, ``python -m k3 train``, ``python -m k3.train``): flags
    (``k3.train_flags``) -> ``TrainConfig`` -> ``train``; bad flags or run folder, or a failed rank, print one line.

    Args:
        args: the parsed flags of ``k3.train_flags.add_train_flags``.

    Returns:
        the exit status: 0, 2 for bad input (flags, run folder, a rank that rejected its input), 1 otherwise.
    """
    try:
        tc = TrainConfig(**config_fields(args))
        started = time.time()
        out = train(tc)
    except ValueError as exc:  # bad flags or run folder: one line naming the problem, no traceback
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    except LaunchError as exc:  # a rank failed: its one line, and where its own traceback is
        line, code = rank_error(tc.run_dir, exc, started)
        print(line, file=sys.stderr)
        return code
    if out["rank"] != 0:  # under torchrun/mpiexec every rank returns here; rank 0 speaks
        return 0
    print(f"final train loss {out['losses'][-1]:.4f}" if out["losses"] else "nothing to do (already at --steps)")
    if out["val_loss"] is not None:
        print(f"validation loss {out['val_loss']:.4f}")
    for path in out["plots"]:
        print(f"plot: {path}")
    print(f"run folder: {out['run_dir']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m k3.train ...`` (what torchrun and mpiexec run): the ``train`` command alone.

    Args:
        argv: the flags (default ``sys.argv[1:]``).

    Returns:
        the exit status (``train_command``'s; 2 for unparsable flags).
    """
    parser = argparse.ArgumentParser(prog="python -m k3.train", description="train Kimi K3 (moonep train)")
    add_train_flags(parser)
    parser.set_defaults(func=train_command)
    return run(parser, argv)


if __name__ == "__main__":
    raise SystemExit(main())
