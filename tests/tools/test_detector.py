"""The in-loop StragglerDetector (one rank here; the real 2-rank DDP runs are in test_foreign_jobs.py) and the
JSON-lines traces of a job whose collectives hide inside a phase (DDP's all-reduce inside ``backward``)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from moonep.console import main
from tools.analysis import build_tables
from tools.detector import DetectorConfig, StragglerDetector
from tools.findings import diagnose
from tools.report import analyse
from tools.traces import traces_from_records


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [({"every": 0}, "every"), ({"every": 10, "window": 5}, "window"), ({"thresholds": {}}, "thresholds")],
)
def test_config_is_checked(kwargs, words):
    with pytest.raises(ValueError, match=words):
        DetectorConfig(**kwargs)


def test_one_rank_gathers_every_n_steps_and_writes_our_schema(tmp_path):
    seen = []
    det = StragglerDetector(every=4, window=8, trace_dir=str(tmp_path), on_finding=seen.append)
    for _ in range(10):
        with det.step():
            with det.section("data", kind="data"):
                time.sleep(0.001)
            with det.section("forward"):
                sum(range(20000))
    assert det.gathers == 2  # after steps 4 and 8, not on every step
    assert det.close() == [] and det.gathers == 3 and seen == []
    lines = [json.loads(x) for x in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert lines[0]["kind"] == "header" and lines[0]["world_size"] == 1 and lines[0]["source"] == "detector"
    kinds = {(r["op"], r.get("kind")) for r in lines[1:]}
    assert kinds == {("step", "step"), ("data", "data"), ("forward", "compute")}
    assert all(r["cpu_s"] >= 0 for r in lines if r.get("kind") == "compute")
    report, _ = analyse(tmp_path)
    assert report["steps"]["count"] == 10 and report["coverage"]["complete"]


def test_a_section_kind_is_checked():
    det = StragglerDetector()
    with pytest.raises(ValueError, match="kind"):
        with det.section("x", kind="io"):
            pass


def _ddp_records(*, steps=30, onset=10, sleep=0.0, where="gap", hidden_only=False, cpu_s=True, seed=0):
    """Two ranks of a DDP-like loop traced the documented way: data, forward, backward (holding an unrecorded
    all-reduce both ranks leave together), optimizer. Rank 1 loses ``sleep`` seconds from ``onset``: in a gap
    before the data fetch, or off-CPU inside ``forward``; ``hidden_only`` puts it off-CPU inside ``backward``
    before the sync, where a wait looks the same."""
    rng = np.random.default_rng(seed)
    recs = {0: [], 1: []}
    t = 100.0
    for step in range(steps):
        late = sleep if step >= onset else 0.0
        arrive, ends = {}, {}
        for r in (0, 1):
            x = t + (late if r == 1 and where == "gap" and not hidden_only else 0.0)
            work = 0.004 * (1 + 0.02 * rng.standard_normal())
            fwd_off = late if r == 1 and where == "forward" and not hidden_only else 0.0
            rec = {"rank": r, "step": step, "group": [r], "bytes": 0}
            recs[r].append(dict(rec, op="data_load", kind="data", t_enter=x, t_exit=x + 0.0005))
            x += 0.0005
            recs[r].append(dict(rec, op="forward", t_enter=x, t_exit=x + work + fwd_off, cpu_s=work))
            x += work + fwd_off
            ends[r] = x
            bwd_off = late if r == 1 and hidden_only else 0.0
            arrive[r] = x + 2 * work + bwd_off
        sync = max(arrive.values()) + 0.0005
        for r in (0, 1):
            rec = {"rank": r, "step": step, "group": [r], "bytes": 0}
            recs[r].append(dict(rec, op="backward", t_enter=ends[r], t_exit=sync, cpu_s=2 * 0.004))
            recs[r].append(dict(rec, op="optimizer", t_enter=sync, t_exit=sync + 0.001, cpu_s=0.001))
        t = sync + 0.002
    if not cpu_s:
        for rs in recs.values():
            for rec in rs:
                rec.pop("cpu_s", None)
    return recs


@pytest.mark.parametrize(("where", "cpu_s"), [("gap", True), ("forward", True), ("forward", False)])
def test_a_wait_hidden_in_backward_is_blamed_on_the_rank_that_caused_it(where, cpu_s):
    t = build_tables(traces_from_records(_ddp_records(sleep=0.03, where=where, cpu_s=cpu_s)))
    assert "backward" in t.hidden and any("backward" in n for n in t.notes)
    (f,) = diagnose(t)
    kind = "host_idle" if cpu_s else "slow_compute"  # without cpu_s a sleep inside an op is its wall time
    assert (f.kind, f.ranks, f.onset_step) == (kind, [1], 10), f
    assert t.wait_matrix_s[0, 1] > 0.5 and t.wait_matrix_s[1, 0] < 0.01  # rank 0 waited for rank 1


def test_a_slowdown_the_trace_cannot_attribute_is_said_not_hidden(tmp_path, capsys):
    recs = _ddp_records(sleep=0.03, hidden_only=True)
    t = build_tables(traces_from_records(recs))
    (f,) = diagnose(t)
    assert f.kind == "step_slowdown" and f.ranks == [0, 1] and f.onset_step == 10, f
    assert "cannot tell which rank" in f.detail
    clean = build_tables(traces_from_records(_ddp_records()))
    assert diagnose(clean) == []
    for r, rs in recs.items():
        (tmp_path / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rs))
    assert main(["diagnose", str(tmp_path)], packages=["tools"]) == 1
    assert "no straggler found" not in capsys.readouterr().out


def test_bench_detector_runs_and_reports_the_ratio(tmp_path, capsys):
    path = tmp_path / "d.json"
    code = main(["bench", "detector", "--steps", "8", "--blocks", "2", "--step-ms", "2", "--every", "2",
                 "--json", str(path)], packages=["tools"])  # fmt: skip
    result = json.loads(path.read_text())
    assert code in (0, 1) and result["benchmark"] == "detector" and result["ratio"] > 0
    assert result["passed"] == (result["overhead_fraction"] < 0.01) and "ratio" in capsys.readouterr().out
    assert main(["bench", "detector", "--blocks", "3"], packages=["tools"]) == 2
