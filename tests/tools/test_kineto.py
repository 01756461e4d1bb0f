"""Profiler (Kineto) traces: a small real trace of torch 2.13 (fixtures/kineto: 2-rank gloo DDP, rank 1 sleeps
30 ms a step from step 5, no ProfilerStep spans), synthetic GPU traces shaped like real ones (NCCL kernels and
compute kernels, which a CPU job cannot produce), bad input, and the pure pieces (step inference, intervals)
against naive twins."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep.console import main
from tools.intervals import length, merge, subtract
from tools.report import analyse
from tools.steps import anchor, steady_period, steps_from_anchor

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "kineto")


def _cli(args, capsys) -> tuple[int, str, str]:
    code = main(["diagnose", *args], packages=["tools"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_real_trace_without_profiler_steps_names_the_sleeping_rank():
    report, tables = analyse(FIXTURE)
    assert report["format"] == "kineto" and report["ranks"] == [0, 1]
    assert report["coverage"]["expected_from"] == "header" and report["coverage"]["complete"]
    assert tables.steps == list(range(14))  # one step per DataLoader fetch: the loop's own numbering
    assert any("steps inferred" in w for w in report["warnings"])
    (f,) = report["findings"]
    assert (f["kind"], f["ranks"], f["onset_step"]) == ("host_idle", [1], 5)
    assert 0.025 < f["evidence"]["excess_s"] < 0.04  # the 30 ms sleep, measured as a gap in the trace
    assert np.all(tables.calls[:, 2:-1] == tables.calls[0, 2])  # the same collectives every step on both ranks


def _doc(rank: int, *, world=2, steps=20, slow_from=None, factor=1.5, pid=None, info=True) -> dict:
    """A synthetic GPU trace in the shape torch writes: ProfilerStep#N host spans, cudaLaunchKernel runtime
    events, compute kernels and an NCCL all-reduce kernel per step whose start waits for the last rank."""
    base, events, corr = 1_000_000.0, [], 0
    pid = pid if pid is not None else 4000 + rank
    t = base
    for step in range(steps):
        scale = factor if slow_from is not None and rank == 1 and step >= slow_from else 1.0
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": pid,
                       "tid": pid, "ts": t, "dur": 30_000.0, "args": {}})  # fmt: skip
        k = t + 100.0
        for j in range(4):  # compute kernels, 4 ms each (x factor on the slow rank)
            corr += 1
            dur = 4000.0 * scale
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": pid,
                           "ts": k, "dur": 5.0, "args": {"correlation": corr}})  # fmt: skip
            events.append({"ph": "X", "cat": "kernel", "name": f"sm90_xmma_gemm_{j}", "pid": 0, "tid": 7,
                           "ts": k, "dur": dur, "args": {"device": 0, "stream": 7, "correlation": corr}})  # fmt: skip
            k += dur
        slowest = t + 100.0 + 4 * 4000.0 * (factor if slow_from is not None and step >= slow_from else 1.0)
        events.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "pid": 0,
                       "tid": 20, "ts": k, "dur": slowest - k + 500.0,
                       "args": {"Collective name": "allreduce", "Process Group Name": "0",
                                "Process Group Ranks": str(list(range(world))), "Seq": step + 1,
                                "In msg nelems": 1 << 20, "Group size": world, "dtype": "Float"}})  # fmt: skip
        t += 30_000.0
    doc = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}], "displayTimeUnit": "ms",
           "baseTimeNanoseconds": 1_700_000_000_000_000_000, "traceEvents": events,
           "trace_id": f"T{rank}{pid}"}  # fmt: skip
    if info:
        doc["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": world, "pg_count": 1}
    return doc


def _write(folder, name: str, doc: dict, gz: bool = True) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name + (".json.gz" if gz else ".json"))
    with (gzip.open if gz else open)(path, "wt") as f:
        json.dump(doc, f)
    return path


def test_gpu_kernels_and_nccl_waits(tmp_path):
    for r in range(2):
        _write(tmp_path, f"node0_{4000 + r}.1.pt.trace", _doc(r, slow_from=5))
    report, tables = analyse(tmp_path)
    (f,) = [f for f in report["findings"] if f["kind"] == "slow_compute"]
    assert f["ranks"] == [1] and f["onset_step"] == 5 and 1.4 < f["evidence"]["ratio"] < 1.6
    assert report["format"] == "kineto" and report["collectives"][0]["op"] == "allreduce"
    assert tables.wait_matrix_s[0, 1] > 0.05 and tables.wait_matrix_s[1, 0] < 1e-3  # rank 0 waited for rank 1
    assert np.allclose(tables.compute_s[0], 0.016, atol=1e-4)  # kernel time, not the host's 30 ms step


def test_clean_gpu_trace_and_rank_from(tmp_path, capsys):
    for r in range(2):
        _write(tmp_path, f"worker{r}", _doc(r, info=False), gz=False)
    code, out, err = _cli([str(tmp_path)], capsys)  # "worker0": no distributedInfo and no rank<N> in the name
    assert code == 2 and "no rank information" in err and "--rank-from" in err and len(err.splitlines()) == 1
    code, out, err = _cli([str(tmp_path), "--rank-from", r"worker(\d+)"], capsys)
    assert code == 0 and "no straggler found" in out, out + err


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    cases = {}
    one = tmp_path / "single"  # a Chrome trace of a single process: no distributedInfo, no rank in the name
    _write(one, "trace", _doc(0, info=False), gz=False)
    cases["single"] = (one, "no rank information")
    cut = tmp_path / "truncated"
    path = _write(cut, "rank0.pt.trace", _doc(0))
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    cases["truncated"] = (cut, "truncated")
    worlds = tmp_path / "worlds"
    _write(worlds, "a", _doc(0, world=2))
    _write(worlds, "b", _doc(1, world=4))
    cases["worlds"] = (worlds, "two world sizes")
    runs = tmp_path / "runs"
    _write(runs, "a", _doc(0, pid=10))
    _write(runs, "b", _doc(0, pid=11))
    _write(runs, "c", _doc(1))
    cases["runs"] = (runs, "two runs")
    copy = tmp_path / "copy"
    shutil.copy(_write(copy, "a", _doc(0)), os.path.join(copy, "b.json.gz"))
    cases["copy"] = (copy, "rank 0 twice")
    for name, (folder, words) in cases.items():
        code, out, err = _cli([str(folder)], capsys)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (name, out, err)
        assert "Traceback" not in err and "no straggler found" not in out, name


def test_mixed_formats_are_incomplete_not_silently_merged(tmp_path, capsys):
    for r in range(2):
        _write(tmp_path, f"gpu{r}", _doc(r))
    with open(tmp_path / "rank0.jsonl", "w") as f:
        f.write(json.dumps({"op": "forward", "rank": 0, "t_enter": 1.0, "t_exit": 2.0, "step": 0}) + "\n")
    code, out, err = _cli([str(tmp_path)], capsys)
    assert code == 2 and "incomplete" in err, out + err
    code, out, err = _cli([str(tmp_path), "--partial", "--world-size", "1"], capsys)
    assert "kineto file(s)" in out and "not merged" in out, out


def test_help_lists_the_formats(capsys):
    with contextlib.suppress(SystemExit):
        main(["diagnose", "--help"], packages=["tools"])
    text = capsys.readouterr().out
    for word in ("rank<N>.jsonl", ".json.gz", "Flight Recorder", "--rank-from"):
        assert word in text


# ---- pure pieces against naive twins --------------------------------------------------------------------------

intervals = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)).map(lambda p: (min(p), max(p))), max_size=8)


def _cells(ivs) -> set[int]:
    """Naive twin: the unit cells an interval list covers."""
    return {x for a, b in ivs for x in range(a, b)}


@settings(max_examples=200, deadline=None)
@given(intervals, intervals)
def test_intervals_match_a_cell_count(a, b):
    assert length(a) == len(_cells(a))
    assert _cells(merge(a)) == _cells(a) and all(x[1] < y[0] for x, y in zip(merge(a), merge(a)[1:]))
    assert _cells(subtract(a, b)) == _cells(a) - _cells(b)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from("pqrs"), max_size=6),
    st.lists(st.sampled_from("abc"), min_size=0, max_size=4),
    st.integers(3, 8),
)
def test_steps_close_at_each_anchor(prologue, body, repeats):
    period = [*body, "Z"]  # "Z": once per iteration, last (an optimizer step)
    labels = prologue + period * repeats
    found = steady_period(labels)
    assert found is not None
    mark = anchor(labels)
    if mark is None:
        return  # the steady tail's period has no label that occurs once in it (e.g. all labels equal)
    steps = steps_from_anchor(labels, mark)
    assert steps == sorted(steps) and steps[0] == 0
    closes = [i for i, x in enumerate(labels) if x == mark]
    for k, i in enumerate(closes):  # the k-th anchor ends step k
        assert steps[i] == k and (i + 1 == len(labels) or steps[i + 1] == k + 1)


def test_a_foreign_timing_log_is_one_warning_and_an_empty_folder_no_verdict(tmp_path, capsys):
    lines = [json.dumps({"step": i, "time_s": 0.05, "loss": 2.0}) for i in range(50)]
    (tmp_path / "rank0.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "train_log.txt").write_text("step 1 loss 2.0\n")
    code, out, err = _cli([str(tmp_path)], capsys)
    assert code == 2 and "no trace records with steps" in err
    assert "no straggler found" not in out  # nothing was diagnosed: no verdict either way
    warned = [x for x in out.splitlines() if x.startswith("warning:")]
    assert len(warned) <= 8 and any("no line is a trace record" in x for x in warned), out
    assert any("ignored 1 file(s)" in x and "train_log.txt" in x for x in warned), out


def test_gloo_spans_with_several_process_groups_are_warned_about(tmp_path):
    for name in os.listdir(FIXTURE):
        with gzip.open(os.path.join(FIXTURE, name), "rt") as f:
            doc = json.load(f)
        doc["distributedInfo"]["pg_count"] = 2
        _write(tmp_path, name.split(".")[0], doc)
    report, _ = analyse(tmp_path)
    assert any("2 process groups" in w and "matched by order" in w for w in report["warnings"]), report["warnings"]


def test_a_missing_rank_file_is_incomplete(tmp_path, capsys):
    first = sorted(os.listdir(FIXTURE))[0]
    shutil.copy(os.path.join(FIXTURE, first), tmp_path)
    code, out, err = _cli([str(tmp_path)], capsys)
    assert code == 2 and "missing ranks [1]" in err, out + err
    code, out, err = _cli([str(tmp_path), "--partial"], capsys)
    assert code == 0 and "PARTIAL" in out, out + err
