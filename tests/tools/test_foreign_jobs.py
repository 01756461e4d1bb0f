"""Diagnosing REAL jobs not built on ``collectives``: a two-rank gloo DDP job (``ddp_job.py``) started by torchrun.

Each scenario runs once (about 5 s) and is read four ways: the profiler trace, the Flight Recorder dumps, our
JSON lines traced the documented way (DDP's all-reduce hidden inside ``backward``) and the in-loop detector.
Each way must name rank 1, the cause and the onset (step 10, within 2 steps); never "no straggler found" with
exit 0. The clean run must give nothing at all. (Where our JSON lines cannot tell which rank, the report says
so with a ``step_slowdown`` on every rank: ``test_detectors.py``.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from moonep.console import main

# every test here starts processes, and judges the times its ranks measure (make test runs it alone)
pytestmark = [pytest.mark.spawns, pytest.mark.solo]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ONSET, STEPS, SLOW_RANK = 10, 30, 1
_RUNS: dict[str, tuple[str, subprocess.CompletedProcess]] = {}


def run_job(scenario: str, tmp_path_factory, schedule: bool = False, *, fresh: bool = False) -> str:
    """The job's output folder (run once per scenario per session; ``fresh``: run it again)."""
    if scenario not in _RUNS or fresh:
        out = str(tmp_path_factory.mktemp(scenario))
        env = dict(os.environ, PYTHONPATH=ROOT, TORCH_FR_BUFFER_SIZE="2000", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        cmd += [os.path.join(HERE, "ddp_job.py"), "--scenario", scenario, "--out", out, "--steps", str(STEPS)]
        cmd += ["--onset", str(ONSET)] + (["--schedule"] if schedule else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
        _RUNS[scenario] = (out, proc)
    out, proc = _RUNS[scenario]
    want_ok = scenario != "skip_collective"  # the hang ends in the process group's timeout on both ranks
    why = [x for x in (proc.stdout + proc.stderr).splitlines() if any(w in x for w in ("rror", "Fatal", "what()"))]
    assert (proc.returncode == 0) == want_ok, "\n".join(why[-20:]) or proc.stderr[-3000:]
    return out


def on_a_fresh_run_if_one_fails(check, scenario: str, tmp_path_factory, schedule: bool = False) -> None:
    """``check(out)`` on the scenario's job, and on up to two fresh runs of it while it fails. The jobs are real
    2-rank processes timed on a shared 2-core host, where the two vCPUs' speeds drift apart: a healthy rank's CPU
    time reads 1.1x slow for most of a 30-step run now and then (1 of 6 runs of ``slow_data`` here; 2 of 2 on a
    loaded CI host on 2026-12-05), which the detector rightly reports, or a Flight Recorder dump puts a late
    arrival at step 0. A detector fault fails every run; each failed run stays in the test report as a warning,
    so a host that is noisy every time still shows."""
    for attempt in range(3):
        try:
            return check(run_job(scenario, tmp_path_factory, schedule, fresh=attempt > 0))
        except AssertionError as failure:
            if attempt == 2:
                raise
            why = str(failure)[:400]
            warnings.warn(f"{scenario}: run {attempt + 1} failed, checking a fresh one: {why}", stacklevel=2)


def diagnose(folder: str, tmp_path, capsys, *extra: str) -> tuple[int, dict, str]:
    """``moonep diagnose folder --json``: (exit status, report, printed text)."""
    path = tmp_path / f"{os.path.basename(folder)}-{len(os.listdir(tmp_path))}.json"
    code = main(["diagnose", folder, "--json", str(path), *extra], packages=["tools"])
    text = capsys.readouterr().out
    return code, json.loads(path.read_text()) if path.exists() else {}, text


def blamed(report: dict, kinds: set[str]) -> dict:
    """A finding on the slow rank whose kind is one of ``kinds`` and whose onset is near the true one; no finding
    may blame rank 0. A failure shows every finding. (With the ranks pinned to the two cores, as the competing
    thread needs, rank 1's core may also run slower than rank 0's from the start: a second, earlier finding on
    rank 1 is the truth about that core, not a miss.)"""
    hits = [f for f in report["findings"] if f["kind"] in kinds and f["ranks"] == [SLOW_RANK]]
    assert hits, report["findings"]
    near = [f for f in hits if abs(f["onset_step"] - ONSET) <= 2]
    assert near, hits
    wrong = [f for f in report["findings"] if 0 in f["ranks"] and f["kind"] != "step_slowdown"]
    assert not wrong, report["findings"]
    return near[0]


@pytest.mark.parametrize(
    ("scenario", "schedule", "profiler_kinds", "jsonl_kinds"),
    [
        ("sleep", False, {"host_idle"}, {"host_idle"}),  # steps inferred: no ProfilerStep spans
        ("slow_data", False, {"data_loader"}, {"data_loader"}),
        # ProfilerStep#N spans. The thread takes the GIL: rank 1's ops run longer AND it waits between them.
        # Our JSON lines name it when its waits outside DDP's hidden all-reduce stand out; when they do not,
        # the report must say it cannot tell (step_slowdown), never "no straggler found"
        ("cpu_thread", True, {"slow_compute", "host_idle"}, None),
    ],
)
def test_a_slow_rank_is_named_from_every_format(
    scenario, schedule, profiler_kinds, jsonl_kinds, tmp_path_factory, tmp_path, capsys
):
    def check(out: str) -> None:
        code, report, text = diagnose(os.path.join(out, "profiler"), tmp_path, capsys, "--plot", str(tmp_path))
        assert code == 1 and report["format"] == "kineto", text
        blamed(report, profiler_kinds)
        assert os.path.exists(tmp_path / "timeline.png")
        code, report, text = diagnose(os.path.join(out, "jsonl"), tmp_path, capsys)
        assert code == 1 and "no straggler found" not in text, text
        if jsonl_kinds:
            blamed(report, jsonl_kinds)
        else:
            named = [f for f in report["findings"] if f["ranks"] == [SLOW_RANK]]
            unsure = [f for f in report["findings"] if f["kind"] == "step_slowdown"]
            assert (named or unsure) and not [f for f in named if f["kind"] == "step_slowdown"], report["findings"]
        _detector_agrees(out, tmp_path, capsys)
        code, report, text = diagnose(os.path.join(out, "fr"), tmp_path, capsys)
        assert code == 1 and report["format"] == "flight_recorder", text
        blamed(report, {"late_arrival"})  # who and since when; the dump cannot say why

    on_a_fresh_run_if_one_fails(check, scenario, tmp_path_factory, schedule)


def _detector_agrees(out: str, tmp_path, capsys) -> None:
    """The in-loop detector's own findings equal ``diagnose`` on the JSON lines it wrote."""
    code, report, _ = diagnose(os.path.join(out, "detector"), tmp_path, capsys)
    with open(os.path.join(out, "detector", "findings.json")) as f:
        live = json.load(f)
    key = sorted((f["kind"], tuple(f["ranks"]), f["onset_step"]) for f in live)
    assert key == sorted((f["kind"], tuple(f["ranks"]), f["onset_step"]) for f in report["findings"])
    assert key and code == 1, report["findings"]


def test_a_skipped_collective_is_named_from_the_profiler_and_the_flight_recorder(tmp_path_factory, tmp_path, capsys):
    out = run_job("skip_collective", tmp_path_factory)
    code, report, text = diagnose(os.path.join(out, "profiler"), tmp_path, capsys)
    assert code == 1, text
    (f,) = [f for f in report["findings"] if f["kind"] == "collective_mismatch"]
    assert f["ranks"] == [SLOW_RANK] and f["onset_step"] == ONSET, f
    code, report, text = diagnose(os.path.join(out, "fr"), tmp_path, capsys)
    assert code == 1, text
    kinds = {f["kind"] for f in report["findings"]}
    assert kinds & {"hang", "collective_mismatch"}, report["findings"]
    assert "rank 0 in all_reduce" in text and "rank 1 in " in text  # the calls each rank is stuck in


@pytest.mark.host_noise
def test_a_clean_run_reports_nothing_in_any_format(tmp_path_factory, tmp_path, capsys):
    """A real 2-rank clean run is silent in every format. Host noise: on a loaded 2-core CI host (2026-12-05) the
    JSON lines of one clean run showed rank 1's compute slower from step 3 (slow_compute, confidence 0.72), the
    same contention as the 100-clean-steps test; the synthetic clean traces of test_detectors always run."""
    out = run_job("clean", tmp_path_factory)
    for sub in ("profiler", "jsonl", "detector", "fr"):
        code, report, text = diagnose(os.path.join(out, sub), tmp_path, capsys)
        assert code == 0 and report["findings"] == [], (sub, report["findings"])
        assert "no straggler found" in text
    with open(os.path.join(out, "detector", "findings.json")) as f:
        assert json.load(f) == []
