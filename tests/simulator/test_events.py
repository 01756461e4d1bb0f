"""The event engine: schedules are complete and causal, and it agrees with the analytic engine within 3%."""

from collections import Counter
from dataclasses import replace

import pytest

from simulator.analytic import pipeline_costs, simulate
from simulator.events import _entries, dualpipe_order, simulate_pipeline, static_order
from simulator.hardware import load_hardware
from simulator.network import ClusterSpec, cluster_tiers
from simulator.parallel import ParallelConfig
from simulator.specs import load_model
from simulator.validation import RUNS, config

K3 = ParallelConfig(pp=16, ep=64, dp=256, seq_len=8192, global_batch_tokens=64 * 2**20, recompute="full")
DSV3 = ParallelConfig(
    pp=16, ep=64, dp=128, seq_len=4096, global_batch_tokens=15360 * 4096, recompute="full", precision="fp8"
)
CASES = [(run.model, "a100", config(run, mode), run.gpus) for run in RUNS for mode in ("full", "selective")] + [
    ("k3", "h200", K3, 4096),
    ("k3", "h200", replace(K3, schedule="interleaved", vpp=2), 4096),
    ("k3", "h200", replace(K3, schedule="dualpipe"), 4096),
    ("k3", "h200", replace(K3, schedule="dualpipe", maxvio=0.4, dispatcher="classic"), 4096),
    ("deepseek-v3", "h800", replace(DSV3, schedule="dualpipe"), 2048),
    ("deepseek-v3", "h800", DSV3, 2048),
    (
        "kimi-k2",
        "h100",
        ParallelConfig(
            pp=8, ep=32, dp=64, seq_len=4096, global_batch_tokens=4096 * 2048, recompute="full", schedule="dualpipe"
        ),
        512,
    ),
    (
        "llama3-405b",
        "h100",
        ParallelConfig(
            tp=8,
            pp=16,
            dp=64,
            seq_len=8192,
            global_batch_tokens=2**24,
            recompute="selective",
            schedule="interleaved",
            vpp=2,
        ),
        8192,
    ),
    (
        "gpt-175b",
        "b200",
        ParallelConfig(
            tp=4, pp=4, dp=4, seq_len=2048, global_batch_tokens=512 * 2048, recompute="selective", schedule="dualpipe"
        ),
        64,
    ),
]


@pytest.mark.parametrize("model,hw,par,gpus", CASES, ids=[f"{c[0]}-{c[2].schedule}-{i}" for i, c in enumerate(CASES)])
def test_event_agrees_with_analytic(model, hw, par, gpus):
    a = simulate(model, hw, par, gpus)
    e = simulate(model, hw, par, gpus, engine="event")
    assert abs(a.step_time_s / e.step_time_s - 1) < 0.03, (a.step_time_s, e.step_time_s)


@pytest.mark.parametrize(
    "sched,p,m,v", [("1f1b", 4, 7, 1), ("interleaved", 4, 8, 3), ("dualpipe", 6, 12, 1), ("dualpipe", 8, 40, 1)]
)
def test_every_op_once(sched, p, m, v):
    par = ParallelConfig(pp=p, vpp=v, schedule=sched, global_batch_tokens=m * 4096)
    ops = Counter()
    for r in range(p):
        for entry in _entries(par, r):
            for kind, d, mb, s in entry:
                ops[(kind, d, mb, s)] += 1
    stages = p * v
    assert set(ops.values()) == {1}
    assert len(ops) == 2 * m * stages


def test_dependencies_respected():
    """No backward starts before its forward ended; no stage starts before the previous stage ended."""
    spec, hw = load_model("k3"), load_hardware("h200")
    par = replace(K3, schedule="dualpipe")
    tl = simulate_pipeline(par, pipeline_costs(spec, hw, par, cluster_tiers(4096, hw, ClusterSpec())))
    by_rank = {}
    for r, _kind, _mb, _stage, s, e in tl.ops:
        by_rank.setdefault(r, []).append((s, e))
    for spans in by_rank.values():  # one GPU runs one entry at a time
        spans.sort()
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    assert tl.makespan == max(e for *_, e in tl.ops)


def test_dualpipe_order_counts():
    par = ParallelConfig(pp=8, schedule="dualpipe", global_batch_tokens=32 * 4096)
    for r in range(8):
        c = Counter(op for entry in dualpipe_order(par, r) for op in entry)
        assert c == {("F", 0): 16, ("F", 1): 16, ("B", 0): 16, ("B", 1): 16}
    assert static_order(ParallelConfig(pp=2, global_batch_tokens=3 * 4096), 0) == [
        ("F", 0, 0),
        ("F", 1, 0),
        ("B", 0, 0),
        ("F", 2, 0),
        ("B", 1, 0),
        ("B", 2, 0),
    ]
