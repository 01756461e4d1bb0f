"""Fault flags and phase records of the trainer, without launching ranks (the traced 4-rank run is in
tests/tools/test_train_trace.py)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from collectives.faults import DataDelay, LinkDelay, Slowdown, faults_at
from collectives.trace import Tracer
from k3.config import K3Config
from k3.model import build_model, token_loss_sum
from k3.trace import PhaseClock
from k3.train import TrainConfig


def _train_cli(argv: list[str]) -> int:
    from moonep.console import main

    return main(["train", "--no-progress", *argv], packages=["k3"])


@pytest.mark.parametrize(
    "flag, spec, words",
    [
        ("--inject-slowdown", "rank=4,factor=2", ["slowdown rank 4", "world_size=4"]),
        ("--inject-link-delay", "src=0,dst=9,ms=5", ["link delay rank 9", "world_size=4"]),
        ("--inject-data-delay", "rank=7,ms=5", ["data delay rank 7"]),
        ("--inject-slowdown", "rank=1", ["'rank=1'", "missing ['factor']"]),
        ("--inject-link-delay", "src=2,dst=2,ms=5", ["two different ranks"]),
        ("--inject-slowdown", "rank=1,factor=2,from_step=1", ["slowdowns (--inject-slowdown): from_step=1", "steps=1"]),
        ("--inject-data-delay", "rank=1,ms=5,from_step=7", ["data_delays (--inject-data-delay): from_step=7"]),
        ("--inject-link-delay", "src=0,dst=1,ms=5,from_step=1", ["link_delays (--inject-link-delay): from_step=1"]),
        ("--inject-slowdown", "rank=1,factor=inf", ["slowdown factor must be >= 1 and <= 1000, got inf"]),
    ],
)
def test_bad_fault_flags_fail_before_launch(tmp_path, capsys, flag, spec, words):
    """Exit 2 with one line naming the problem, and nothing launched (no run folder): a typo in a fault spec
    must never run a clean 4-rank job that then 'finds nothing'."""
    rc = _train_cli(["--world-size", "4", "--steps", "1", "--run-dir", str(tmp_path / "run"), flag, spec])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ")
    for w in words:
        assert w in err
    assert not (tmp_path / "run").exists()


def test_fault_specs_survive_the_trip_to_the_ranks():
    """launch() hands the ranks dataclasses.asdict(tc): the specs must come back as the same typed values."""
    tc = TrainConfig(
        world_size=4,
        slowdowns=(Slowdown(rank=2, factor=1.5, from_step=3),),
        data_delays=(DataDelay(rank=0, ms=40.0),),
        link_delays=(LinkDelay(src=1, dst=3, ms=10.0),),
    )
    again = TrainConfig(**dataclasses.asdict(tc))
    assert again == tc and isinstance(again.slowdowns[0], Slowdown)
    json.dumps(dataclasses.asdict(tc))  # train.json and checkpoints store it as JSON


def _busy(seconds: float) -> float:
    """CPU work on this thread for about ``seconds`` of thread time; returns the thread time it took."""
    c0 = time.thread_time()
    x = torch.randn(64, 64)
    while time.thread_time() - c0 < seconds:
        x = (x @ x).tanh_()
    return time.thread_time() - c0


def test_slowdown_stretches_the_phase_in_thread_cpu_time(tmp_path):
    """factor 2: the recorded cpu_s is twice the work's own CPU time (time-based, so the same on any machine);
    would catch a stretch by wall time, a missing stretch, or a record that leaves the stretch out."""
    tracer = Tracer(tmp_path, 0)
    clock = PhaseClock(tracer)
    clock.factor = 2.0
    tracer.step = 0
    with clock.phase("optimizer"):
        work = _busy(0.05)
    clock.factor = 1.0
    with clock.phase("grad_sync"):
        plain = _busy(0.02)
    with clock.data(delay_ms=30):
        pass
    tracer.flush()
    recs = {r["op"]: r for r in map(json.loads, (tmp_path / "rank0.jsonl").read_text().splitlines())}
    assert 2 * work <= recs["optimizer"]["cpu_s"] <= 2 * work + 0.01
    assert plain <= recs["grad_sync"]["cpu_s"] <= plain + 0.01
    assert recs["optimizer"]["kind"] == "compute" and recs["optimizer"]["step"] == 0
    assert recs["data_load"]["kind"] == "data" and recs["data_load"]["t_exit"] - recs["data_load"]["t_enter"] >= 0.03


def test_sublayer_records_partition_each_phase(tmp_path):
    """Tiny K3 on one process (no EP buffer): forward/backward/evaluate records per sublayer kind plus one
    'other' remainder, never negative, summing to the phase's CPU time (no double counting across hooks)."""
    torch.set_num_threads(1)
    model = build_model(K3Config.preset("tiny"), seed=0)
    tracer = Tracer(tmp_path, 0)
    clock = PhaseClock(tracer)
    clock.attach(model)
    tracer.step = 0
    tokens = torch.randint(0, 256, (2, 17))
    spent = {}
    for name in ("forward", "backward", "evaluate"):
        c0 = time.thread_time()
        with clock.phase(name):
            if name == "forward":
                loss = token_loss_sum(model, tokens[:, :-1], tokens[:, 1:])
            elif name == "backward":
                loss.backward()
            else:
                with torch.no_grad():
                    token_loss_sum(model, tokens[:, :-1], tokens[:, 1:])
        spent[name] = time.thread_time() - c0
    token_loss_sum(model, tokens[:, :-1], tokens[:, 1:])  # outside any phase: hooks record nothing
    tracer.flush()
    recs = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    for name in spent:
        mine = [r for r in recs if r["op"] == name]
        assert {r["layer"] for r in mine} == {"kda", "mla", "moe", "dense", "other"}, name
        assert all(r["cpu_s"] >= 0 for r in mine)
        assert abs(sum(r["cpu_s"] for r in mine) - spent[name]) <= 0.005 + 0.05 * spent[name], name
    from tools.traces import load_dir

    # the tools read every phase as compute (a phase named like a collective op would vanish from the scores)
    assert set(load_dir(tmp_path)[0].compute_ops[0]) == set(spent)
    n_layers = len(model.layers)
    assert len([r for r in recs if r["op"] == "forward"]) == 2 * n_layers + 1  # attention + MLP per layer


def test_faults_start_at_their_step_on_their_rank():
    """Would catch a fault applied before from_step, on the wrong rank, or a link delay never handed over."""
    tc = TrainConfig(
        world_size=4,
        slowdowns=(Slowdown(rank=2, factor=1.5, from_step=3), Slowdown(rank=2, factor=1.2, from_step=1)),
        data_delays=(DataDelay(rank=0, ms=40.0, from_step=2),),
        link_delays=(LinkDelay(src=1, dst=3, ms=10.0, from_step=2),),
    )
    assert faults_at(tc, 2, 0) == (1.0, 0.0, [])
    assert faults_at(tc, 2, 1)[0] == 1.2 and faults_at(tc, 2, 5)[0] == 1.5  # overlapping: the larger factor
    assert faults_at(tc, 1, 5)[:2] == (1.0, 0.0)
    assert faults_at(tc, 0, 1)[1] == 0.0 and faults_at(tc, 0, 2)[1] == 40.0
    assert faults_at(tc, 3, 1)[2] == [] and faults_at(tc, 3, 2)[2] == [LinkDelay(src=1, dst=3, ms=10.0, from_step=2)]
