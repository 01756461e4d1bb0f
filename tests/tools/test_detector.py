"""The in-loop StragglerDetector (one rank here; the real 2-rank DDP runs are in test_foreign_jobs.py) and the
JSON-lines traces of a job whose collectives hide inside a phase (DDP's all-reduce inside ``backward``)."""

from __future__ import annotations

import ast
import json
import os
import time

import numpy as np
import pytest

from moonep.console import main
from tests.tools.test_foreign_jobs import on_a_fresh_run_if_one_fails
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
    with pytest.raises(ValueError, match="kind"), det.section("x", kind="io"):
        pass


def _ddp_records(
    *, steps=30, onset=10, sleep=0.0, where="gap", hidden_only=False, cpu_s=True, seed=0, mild=0.0, slow_opt=0.0
):
    """Two ranks of a DDP-like loop traced the documented way: data, forward, backward (holding an unrecorded
    all-reduce both ranks leave together), optimizer, then an unrecorded logging all-reduce both leave
    together. Rank 1 loses ``sleep`` seconds from ``onset``: in a gap before the data fetch, or off-CPU inside
    ``forward``; ``hidden_only`` puts it off-CPU inside ``backward`` before the sync, where a wait looks the
    same. ``mild``: rank 1 also loses that many seconds in the gap from step 0 (a core a little busier);
    ``slow_opt``: rank 0's optimizer computes that much longer (rank 1 waits for it at the logging sync)."""
    rng = np.random.default_rng(seed)
    recs = {0: [], 1: []}
    t = 100.0
    for step in range(steps):
        late = sleep if step >= onset else 0.0
        arrive, ends = {}, {}
        for r in (0, 1):
            x = t + (late if r == 1 and where == "gap" and not hidden_only else 0.0) + (mild if r == 1 else 0.0)
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
            opt = 0.001 + (slow_opt if r == 0 else 0.0)
            recs[r].append(dict(rec, op="backward", t_enter=ends[r], t_exit=sync, cpu_s=2 * 0.004))
            recs[r].append(dict(rec, op="optimizer", t_enter=sync, t_exit=sync + opt, cpu_s=opt))
        t = sync + 0.001 + slow_opt + 0.002
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


def test_a_milder_level_before_the_stall_does_not_move_its_onset():
    """Rank 1 idles 4 ms a step more than rank 0 from the start (a busier core), then 30 ms from step 10: one
    finding, from the rise, with the milder level and its start as evidence (not one episode from step 0)."""
    (f,) = diagnose(build_tables(traces_from_records(_ddp_records(sleep=0.03, mild=0.004))))
    assert (f.kind, f.ranks, f.onset_step) == ("host_idle", [1], 10), f
    assert f.evidence["earlier_onset_step"] <= 2 and 0.003 < f.evidence["earlier_excess_s"] < 0.005, f
    assert 0.03 < f.evidence["excess_s"] < 0.04 and "already from step" in f.detail
    (alone,) = diagnose(build_tables(traces_from_records(_ddp_records(mild=0.004))))  # the milder level alone
    # step 0 has no gap before its first record (no previous step to start from): the level shows from step 1
    assert (alone.kind, alone.ranks, alone.onset_step) == ("host_idle", [1], 1), alone
    assert "earlier_onset_step" not in alone.evidence


def test_waiting_for_a_slower_peer_at_an_untraced_sync_is_not_idle():
    """Rank 0's optimizer computes 3 ms longer; rank 1 waits for it in the logging all-reduce, which the trace
    does not record. That gap ends together on both ranks: its wait is rank 1's wait for rank 0, not host idle
    on rank 1 (before ``tools.gaps`` it was blamed as host_idle on rank 1)."""
    t = build_tables(traces_from_records(_ddp_records(slow_opt=0.003)))
    assert t.synced_gaps == {"data_load": 29} and any("a sync the trace does not record" in n for n in t.notes)
    found = diagnose(t)
    assert not [f for f in found if 1 in f.ranks], found
    assert t.wait_matrix_s[1, 0] > 29 * 0.0025 and t.wait_matrix_s[0, 1] < 0.01  # rank 1 waited for rank 0
    stalled = diagnose(build_tables(traces_from_records(_ddp_records(slow_opt=0.003, sleep=0.03))))
    assert [(f.kind, f.ranks, f.onset_step) for f in stalled if 1 in f.ranks] == [("host_idle", [1], 10)], stalled


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


@pytest.mark.parametrize("step_ms", ["inf", "nan", "0", "1e300"])
def test_bench_detector_refuses_a_step_it_cannot_time_in_one_line(capsys, step_ms):
    """Catches: --step-ms inf, an OverflowError traceback from the calibration's round()."""
    assert main(["bench", "detector", "--step-ms", step_ms], packages=["tools"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: need an even blocks") and f"step_ms={float(step_ms)}" in err and err.count("\n") == 1


def _batches(recs: dict[int, list[dict]], lo: int, hi: int) -> list[tuple[int, list[dict], None]]:
    """What rank 0 receives from one gather: each rank's records of steps ``lo`` .. ``hi - 1``."""
    return [(r, [x for x in rs if lo <= x["step"] < hi], None) for r, rs in recs.items()]


def test_rank_0_reports_each_new_finding_once(caplog):
    """Two ranks' windows fed to rank 0's diagnosis gather by gather (no process group): the straggler from step
    10 is reported once to ``on_finding`` and the log however many gathers still see it."""
    recs = _ddp_records(sleep=0.03, where="gap")
    seen = []
    det = StragglerDetector(every=10, window=30, on_finding=seen.append)
    with caplog.at_level("WARNING", logger="tools.detector"):
        for lo in range(0, 30, 10):
            det._diagnose(_batches(recs, lo, lo + 10))
        det._diagnose(_batches(recs, 20, 30))  # the same window again: nothing new
    assert [(f.kind, f.ranks, f.onset_step) for f in seen] == [("host_idle", [1], 10)], seen
    assert len([r for r in caplog.records if "host_idle" in r.getMessage()]) == 1
    assert [(f.kind, f.ranks) for f in det.findings] == [("host_idle", [1])]


def test_the_window_keeps_the_last_steps_only():
    recs = _ddp_records(sleep=0.0)
    det = StragglerDetector(every=5, window=10)
    for lo in range(0, 30, 5):
        det._diagnose(_batches(recs, lo, lo + 5))
    kept = {r: sorted({x["step"] for x in w}) for r, w in det._window.items()}
    assert kept == {0: list(range(20, 30)), 1: list(range(20, 30))}
    assert det.findings == []


def _module_imports(path: str) -> set[str]:
    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_detector_depends_on_torch_and_pure_tools_modules_only():
    """The detector and the ``tools`` modules it pulls in import nothing of ``collectives`` (or the simulator),
    so it runs in any ``torch.distributed`` job."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    todo, done = ["tools.detector"], set()
    while todo:
        mod = todo.pop()
        if mod in done:
            continue
        done.add(mod)
        for name in _module_imports(os.path.join(root, *mod.split(".")) + ".py"):
            top = name.split(".")[0]
            assert top not in ("collectives", "moonep", "moonep_base", "simulator", "k3"), (mod, name)
            if top == "tools":
                todo.append(name)
    pure = ("detector", "analysis", "calls", "clocks", "detect", "findings", "gaps", "traces", "trace_lines")
    pure += ("intervals",)
    assert done == {f"tools.{m}" for m in pure}


@pytest.mark.spawns
@pytest.mark.solo
@pytest.mark.parametrize(("scenario", "kind"), [("sleep", "host_idle"), ("slow_data", "data_loader")])
def test_the_detector_names_the_slow_rank_of_a_real_ddp_job(scenario, kind, tmp_path_factory):
    """Rank 0's own findings in the real 2-rank gloo DDP job (``ddp_job.py``, run once per session and shared
    with ``test_foreign_jobs.py``): rank 1 sleeps 30 ms a step outside every section, or its data loader 25 ms a
    batch, from step 10. The right kind on rank 1 alone, onset within 2 steps of 10; ``diagnose`` on the JSON
    lines the detector wrote giving the same is checked in ``test_foreign_jobs.py``."""

    def check(out: str) -> None:
        with open(os.path.join(out, "detector", "findings.json")) as f:
            live = json.load(f)
        near = [f for f in live if f["kind"] == kind and f["ranks"] == [1] and abs(f["onset_step"] - 10) <= 2]
        assert near and not [f for f in live if 0 in f["ranks"] and f["kind"] != "step_slowdown"], live

    on_a_fresh_run_if_one_fails(check, scenario, tmp_path_factory)
