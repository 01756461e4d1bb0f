"""The real K3 training job (`moonep train`, tiny, 4 gloo ranks) writes the traces `moonep diagnose` reads, and
the faults it injects are found in them: a 1.5x compute slowdown on rank 2 and a data-loader delay on rank 0.

One run (about 40 s on 2 idle cores, 90 s when they are busy) shared by the tests of this file. Link delays are
not checked from this trace: a few ms of delay is within the host's drift of collective times on 2 busy cores,
and the trace detector does not flag it in this job (tools/README.md, "Tracing a training run");
tests/k3/test_train_faults.py checks that and when the trainer injects it.
"""

from __future__ import annotations

import json

import pytest

from tools.report import analyse
from tools.traces import load_dir

# the shared fixture trains K3 on 4 local ranks, and the slow rank is told by the times they measure
pytestmark = [pytest.mark.spawns, pytest.mark.solo]

STEPS = 16  # onset + the detectors' 10 evidence steps + 2 steps for a late onset
SLOW_FROM = 4  # rank 2 computes 1.5x from here
DATA_FROM = 4  # rank 0's data loading takes 150 ms longer from here (> 1% of even a 10 s step)
COMPUTE_PHASES = {"forward", "backward", "grad_sync", "optimizer"}


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    from moonep.console import main

    root = tmp_path_factory.mktemp("k3-trace")
    rc = main(
        [
            "train",
            "--preset",
            "tiny",
            "--world-size",
            "4",
            "--steps",
            str(STEPS),
            "--no-progress",
            "--run-dir",
            str(root / "run"),
            "--trace-dir",
            str(root / "trace"),
            "--inject-slowdown",
            f"rank=2,factor=1.5,from_step={SLOW_FROM}",
            "--inject-data-delay",
            f"rank=0,ms=150,from_step={DATA_FROM}",
        ],
        packages=["k3"],
    )
    assert rc == 0
    return root / "trace"


def test_every_rank_records_every_phase_of_every_step(trace_dir):
    """Would catch a phase left unrecorded, records without a step, or a rank whose file does not parse."""
    traces = load_dir(trace_dir)
    assert sorted(traces) == [0, 1, 2, 3]
    for rank, t in traces.items():
        assert sorted(t.data) == list(range(STEPS)), rank
        assert sorted(t.compute) == list(range(STEPS)), rank
        for step in range(STEPS):
            assert set(t.compute_ops[step]) >= COMPUTE_PHASES, (rank, step)
            assert t.compute[step] > 0
        assert "evaluate" in t.compute_ops[STEPS - 1], rank  # the validation loss at the last step is compute
        a2a_steps = {c.step for c in t.collectives if c.op == "all_to_all_single"}
        assert a2a_steps == set(range(STEPS)), rank  # the MoE dispatches are stamped with the step
    with open(trace_dir / "rank1.jsonl") as f:
        recs = [json.loads(line) for line in f]
    layers = {r.get("layer") for r in recs if r["op"] in ("forward", "backward")}
    assert layers == {"kda", "mla", "moe", "dense", "other"}
    assert all(r["cpu_s"] >= 0 for r in recs if r.get("kind") == "compute")


def test_slow_rank_and_slow_loader_are_found(trace_dir):
    report, _ = analyse(trace_dir)
    found = {f["kind"]: f for f in report["findings"]}
    assert [f["ranks"] for f in report["findings"] if f["kind"] == "slow_compute"] == [[2]], report["findings"]
    # one step early is the host's noise, not the detector's: a step just before the fault that a busy core slowed
    # at least halfway up to the fault's level joins the episode (tools.detect._walk_back). Smaller noise no longer
    # does: two clean-clone CI runs saw rank 2 at 1.13x its peers on step 3 (and 2) before 1.5x from step 4, and
    # reported onset 3 and 2 before that rule. The DDP job's check allows 2 steps.
    assert SLOW_FROM - 1 <= found["slow_compute"]["onset_step"] <= SLOW_FROM + 10, found["slow_compute"]
    assert [f["ranks"] for f in report["findings"] if f["kind"] == "data_loader"] == [[0]], report["findings"]
    assert DATA_FROM <= found["data_loader"]["onset_step"] <= DATA_FROM + 10, found["data_loader"]
    cov = report["coverage"]  # the trainer's own trace is complete, and its header says how many ranks it has
    assert cov["complete"] and cov["expected_from"] == "header" and cov["expected_ranks"] == 4, cov
    assert cov["steps"] == STEPS and cov["lines_dropped"] == 0
