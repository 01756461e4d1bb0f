"""The stable JSON, the probe merge, plots, and the CLI commands (exit codes, --json, bad input)."""

import contextlib
import json
import os
import threading
import time
from pathlib import Path

import pytest

from moonep.console import main
from tests.tools.synth import make_records, write_dir
from tools.analysis import load_tables
from tools.findings import diagnose
from tools.follow import Tail, follow
from tools.report import SCHEMA_VERSION, analyse, apply_probe

FINDING_KEYS = ["kind", "ranks", "onset_step", "confidence", "what_if_step_time_s"]


def test_json_schema_is_stable(tmp_path):
    """Catches: renamed or missing keys that scripts depend on."""
    report, _ = analyse(write_dir(tmp_path, make_records(slow=(1, 1.5, 5))))
    assert report["schema_version"] == SCHEMA_VERSION == 1
    for key in (
        "findings",
        "ranks",
        "steps",
        "step_time_s",
        "rank_scores",
        "wait_matrix_s",
        "collectives",
        "probe",
        "warnings",
    ):
        assert key in report
    (f,) = report["findings"]
    assert list(f)[:5] == FINDING_KEYS
    assert f["kind"] == "slow_compute" and f["ranks"] == [1] and isinstance(f["onset_step"], int)
    assert 0 <= f["confidence"] <= 1 and f["what_if_step_time_s"] < report["step_time_s"]
    assert len(report["wait_matrix_s"]["seconds"]) == 4
    json.dumps(report, allow_nan=False)


def test_probe_names_the_pair_inside_a_slow_group(tmp_path):
    t = load_tables(write_dir(tmp_path, make_records(link=(0.02, 5))))
    findings = diagnose(t)
    probe = {"slow_pairs": [{"ranks": [1, 3], "seconds": 0.02, "ratio": 90.0}]}
    (f,) = apply_probe(findings, probe)
    assert f.kind == "slow_link" and f.ranks == [1, 3] and f.evidence["probe_pair"] == [1, 3]
    # probe-only: a finding with unknown onset
    (g,) = apply_probe([], probe)
    assert g.ranks == [1, 3] and g.onset_step is None


def test_cli_diagnose_json_plots_and_exit_codes(tmp_path, capsys):
    clean = write_dir(tmp_path / "clean", make_records())
    slow = write_dir(tmp_path / "slow", make_records(slow=(3, 1.4, 10)))
    assert main(["diagnose", clean, "--json", str(tmp_path / "c.json")], packages=["tools"]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["findings"] == []
    assert (
        main(
            ["diagnose", slow, "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "plots")],
            packages=["tools"],
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "slow_compute" in out and "ranks [3]" in out
    assert sorted(os.listdir(tmp_path / "plots")) == ["rank_step_heatmap.png", "timeline.png", "wait_matrix.png"]
    assert (tmp_path / "plots" / "wait_matrix.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["diagnose", str(tmp_path / "missing")], packages=["tools"]) == 2


@pytest.mark.parametrize("steps", [1, 4, 7])
def test_a_trace_too_short_for_a_verdict_says_so_not_no_straggler(tmp_path, capsys, steps):
    """Catches: a 2x slow rank in a 4-step profiler window reported as "no straggler found", exit 0."""
    short = write_dir(tmp_path / "short", make_records(steps=steps, slow=(1, 2.0, 0)))
    report, _ = analyse(short)
    assert report["findings"] == [] and report["steps"] == {"first": 0, "last": steps - 1, "count": steps, "needed": 8}
    assert main(["diagnose", short], packages=["tools"]) == 2
    out, err = capsys.readouterr()
    assert "no straggler found" not in out and f"no verdict: {steps} step" in out
    assert err.startswith(f"error: {short}: {steps} step") and "\n" not in err.strip() and "--partial" in err
    assert main(["diagnose", short, "--partial"], packages=["tools"]) == 0
    assert "no verdict" in capsys.readouterr().out
    long = write_dir(tmp_path / "long", make_records(steps=8, slow=(1, 2.0, 0)))  # the same rank, the needed steps
    assert main(["diagnose", long], packages=["tools"]) == 1 and "ranks [1]" in capsys.readouterr().out


def test_demo_refuses_fewer_steps_than_a_verdict_needs(capsys):
    assert main(["straggler-demo", "--steps", "7"], packages=["tools"]) == 2
    assert "--steps 7: the diagnosis needs 8" in capsys.readouterr().err


def test_cli_rejects_bad_injection_naming_the_part(capsys):
    assert main(["straggler-demo", "--inject-slowdown", "rank=1,factr=2"], packages=["tools"]) == 2
    assert "'rank=1,factr=2'" in capsys.readouterr().err


def _writer(path, steps, delay):
    recs = make_records(steps=steps, slow=(2, 2.0, 10))
    with contextlib.ExitStack() as stack:
        files = {r: stack.enter_context(open(os.path.join(path, f"rank{r}.jsonl"), "w")) for r in recs}
        for step in range(steps):
            for r, rs in recs.items():
                lines = [json.dumps(x) for x in rs if x["step"] == step]
                files[r].write("\n".join(lines) + "\n")
                files[r].write('{"op": "half')  # a record mid-write at every poll boundary...
                files[r].flush()
                files[r].seek(files[r].tell() - len('{"op": "half'))  # ...overwritten by the next step
                files[r].truncate()
            time.sleep(delay)


def test_follow_alerts_while_the_run_goes(tmp_path, capsys):
    """Catches: --follow only reporting at the end, or choking on a partial last line."""
    writer = threading.Thread(target=_writer, args=(tmp_path, 40, 0.02))
    writer.start()
    try:
        alerts = follow(tmp_path, interval_s=0.1, max_seconds=3.0)
    finally:
        writer.join()
    assert [(f.kind, f.ranks) for f in alerts] == [("slow_compute", [2])]
    out = capsys.readouterr().out
    assert out.count("ALERT") == 1 and "slow_compute ranks [2]" in out


def test_tail_reads_only_appended_complete_lines(tmp_path):
    recs = make_records(steps=4)
    write_dir(tmp_path, {0: recs[0][:3]})
    tail = Tail(tmp_path)
    assert tail.poll() == 3
    with open(tmp_path / "rank0.jsonl", "a") as f:
        f.write(json.dumps(recs[0][3]) + "\n" + json.dumps(recs[0][4])[:10])
    assert tail.poll() == 1 and tail.poll() == 0
    with open(tmp_path / "rank0.jsonl", "a") as f:
        f.write(json.dumps(recs[0][4])[10:] + "\n")
    assert tail.poll() == 1


def test_cli_follow_is_bounded(tmp_path, capsys):
    write_dir(tmp_path, make_records(data_slow=(0, 0.02, 3)))
    assert (
        main(["diagnose", str(tmp_path), "--follow", "--interval", "0.05", "--max-seconds", "0.1"], packages=["tools"])
        == 1
    )
    assert "data_loader ranks [0]" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--interval", "0"),
        ("--interval", "nan"),
        ("--interval", "inf"),
        ("--max-seconds", "-1"),
        ("--max-seconds", "nan"),
    ],
)
def test_cli_follow_refuses_bad_timing_in_one_line(tmp_path, capsys, flag, value):
    """Catches: --interval 0 ending in a ValueError traceback, --max-seconds -1 returning 0 without a poll, --interval
    inf an OverflowError in the poll's sleep."""
    args = ["diagnose", str(tmp_path), "--follow", "--interval", "0.05", "--max-seconds", "0.1", flag, value]
    assert main(args, packages=["tools"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}: must be a number of seconds in (0, 31536000]") and "\n" not in err.strip()


@pytest.mark.parametrize(
    "folder,extra,named,mode",
    [
        ("trace", ["--follow", "--json", "f.json"], "--json", "diagnose --follow"),
        ("trace", ["--follow", "--max-seconds", "1", "--partial", "--world-size", "2"], "--partial, --world-size", ""),
        ("trace", ["--interval", "1"], "--interval", "diagnose of a trace folder"),
        ("trace", ["--max-seconds", "1", "--rounds", "3"], "--max-seconds, --rounds", "diagnose of a trace folder"),
        ("trace", ["--nbytes", "64"], "--nbytes", "diagnose of a trace folder"),
        ("trace", ["--inject-link-delay", "src=0,dst=1,ms=5"], "--inject-link-delay", "diagnose of a trace folder"),
        ("probe", ["--world-size", "2", "--plot", "p"], "--plot", "diagnose probe --world-size N"),
        ("probe", ["--world-size", "2", "--follow", "--interval", "1"], "--follow, --interval", "diagnose probe"),
    ],
)
def test_diagnose_names_flags_its_mode_would_ignore(tmp_path, monkeypatch, capsys, folder, extra, named, mode):
    """Catches: ``--follow --json f`` writing nothing, ``--interval`` or ``--rounds`` without ``--follow`` or the
    probe doing nothing, ``diagnose probe --plot`` drawing nothing: each ran with the flag silently dropped. The
    check comes first: no poll, and no rank started (the probe cases would launch two)."""
    if folder == "trace":
        folder = write_dir(tmp_path / "t", make_records())
    monkeypatch.chdir(tmp_path)
    assert main(["diagnose", folder, *extra], packages=["tools"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named}: not used by ") and mode in err and err.count("\n") == 1, err
    assert not (tmp_path / "f.json").exists() and not (tmp_path / "p").exists()


@pytest.mark.parametrize("value", ["0", "inf", "1e300"])
def test_bench_telemetry_refuses_a_bad_interval_before_any_rank_starts(capsys, value):
    """Catches: --interval inf running the bench while every rank's sampling thread died with an OverflowError
    traceback (the bench then compared two runs without a sampler and printed a ratio)."""
    assert main(["bench", "telemetry", "--interval", value], packages=["tools"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --interval: must be a number of seconds in (0, 31536000] (a year), got {float(value)!r}\n"


def test_demo_refuses_a_hot_rank_outside_the_job(capsys):
    """Catches: --hot-rank 9 on 4 ranks silently skewing rank 1 (9 % 4) and reporting it as the hot rank."""
    args = ["straggler-demo", "--world-size", "4", "--skew", "0.5", "--hot-rank", "9"]
    assert main(args, packages=["tools"]) == 2
    assert "error: hot_rank 9 is not a rank of a 4-rank job (0..3)" in capsys.readouterr().err


def test_simulated_what_if_maps_findings_to_the_simulator():
    """Catches: the simulator's slowdown applied the wrong way round (what-if above the measured step)."""
    from simulator import ParallelConfig
    from tools.simwhatif import simulated_what_if

    par = ParallelConfig(tp=8, pp=4, dp=2, seq_len=2048, global_batch_tokens=131072)
    slow = {"kind": "slow_compute", "ranks": [5], "evidence": {"ratio": 1.3}}
    res = simulated_what_if(slow, "gpt-175b", "h100", par, 64, measured_step_s=10.0)
    assert res["slowdown"] > 1.05 and res["what_if_step_time_s"] < 10.0
    assert simulated_what_if({"kind": "data_loader", "ranks": [1]}, "gpt-175b", "h100", par, 64) is None


# ------------------------------------------------------------------------- no verdict without the evidence
def _with_headers(path, world_size):
    """Prepend the writer's header line (collectives/trace.py) to every rank file."""
    for name in os.listdir(path):
        p = os.path.join(path, name)
        header = json.dumps(
            {"op": "header", "kind": "header", "rank": int(name[4:-6]), "world_size": world_size, "t_enter": 1.0}
        )
        with open(p) as f:
            body = f.read()
        with open(p, "w") as f:
            f.write(header + "\n" + body)


def _strict_json(path):
    def no_constant(name):
        raise AssertionError(f"{path} holds {name}, which is not JSON")

    with open(path) as f:
        return json.loads(f.read(), parse_constant=no_constant)


def test_one_damaged_line_no_longer_hides_a_straggler(tmp_path, capsys):
    """The issue's case: damaging one line of the slow rank's file dropped the whole rank, and diagnose said
    'no straggler found' (exit 0). Now the line alone is dropped and named; without --partial the verdict is
    refused (exit 2); with it, the 1.5x straggler is still found (exit 1) and the JSON says what was dropped."""
    trace = write_dir(tmp_path / "t", make_records(slow=(2, 1.5, 10)))
    rank2 = Path(trace) / "rank2.jsonl"
    lines = rank2.read_text().splitlines()
    lines[7] = lines[7].replace('"t_exit": ', '"t_exit": NaN, "was": ')
    rank2.write_text("\n".join(lines) + "\n")
    assert main(["diagnose", trace], packages=["tools"]) == 2
    out, err = capsys.readouterr()
    assert "rank2.jsonl:8: t_exit is nan (not finite); line dropped" in out
    assert "incomplete trace" in err and "1 lines dropped" in err and "--partial" in err
    js = str(tmp_path / "r.json")
    assert main(["diagnose", trace, "--partial", "--json", js], packages=["tools"]) == 1
    report = _strict_json(js)
    assert [(f["kind"], f["ranks"]) for f in report["findings"]] == [("slow_compute", [2])]
    cov = report["coverage"]
    assert cov["lines_dropped"] == 1 and "rank2.jsonl:8" in cov["dropped"][0] and cov["complete"] is False
    assert "coverage: 4/4 ranks (expected from groups), 40 steps, 1 lines dropped" in capsys.readouterr().out


@pytest.mark.parametrize("how", ["header", "--world-size"])
def test_missing_rank_file_is_noticed(tmp_path, capsys, how):
    """A rank whose file is gone (here the last one, which no group record of the others can reveal when its
    collectives are per-rank) is named; the expected count comes from the writers' header or --world-size."""
    recs = make_records(ranks=4)
    trace = write_dir(tmp_path / "t", {r: v for r, v in recs.items() if r != 3})
    for name in os.listdir(trace):  # groups now only name ranks 0-2: the header / flag is the only evidence
        p = Path(trace) / name
        p.write_text(p.read_text().replace("[0, 1, 2, 3]", "[0, 1, 2]"))
    extra = ["--world-size", "4"] if how == "--world-size" else []
    if how == "header":
        _with_headers(trace, 4)
    js = str(tmp_path / "r.json")
    assert main(["diagnose", trace, "--json", js, *extra], packages=["tools"]) == 2
    assert "missing ranks [3]" in capsys.readouterr().err
    cov = _strict_json(js)["coverage"]
    assert cov["missing_ranks"] == [3] and cov["expected_ranks"] == 4
    assert cov["expected_from"] == ("header" if how == "header" else "world_size")
    assert main(["diagnose", trace, "--partial", *extra], packages=["tools"]) == 0  # judged on what is there
    assert "no straggler found in what this PARTIAL trace holds" in capsys.readouterr().out


def test_rank_that_stopped_early_is_incomplete(tmp_path, capsys):
    recs = make_records(ranks=4)
    recs[1] = [r for r in recs[1] if r["step"] < 30]
    trace = write_dir(tmp_path / "t", recs)
    assert main(["diagnose", trace], packages=["tools"]) == 2
    assert "ranks short of steps {'1': 10}" in capsys.readouterr().err


def test_empty_folder_is_an_error_even_with_partial(tmp_path, capsys):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "rank0.jsonl").write_text("")
    for extra in ([], ["--partial"]):
        assert main(["diagnose", str(tmp_path / "e"), *extra], packages=["tools"]) == 2
        assert "nothing to diagnose" in capsys.readouterr().err


def _probe(R: int, pairs=()) -> dict:
    return {"one_way_s": [[None if i == j else 1e-4 for j in range(R)] for i in range(R)], "slow_pairs": list(pairs)}


@pytest.mark.parametrize(
    "content,named",
    [
        ("", "not JSON"),
        ("[1]", "not a probe result: no one_way_s"),
        ("{}", "not a probe result: no one_way_s"),
        (json.dumps(_probe(4, [{"src": 0}])), "slow_pairs entry {'src': 0} needs ranks [src, dst] in 0..3"),
        (json.dumps(_probe(4, [{"ranks": [0, 9], "seconds": 1.0, "ratio": 5.0}])), "needs ranks [src, dst] in 0..3"),
        (json.dumps(_probe(3)), "the probe covers 3 ranks, the trace 4"),
    ],
)
def test_diagnose_refuses_a_bad_probe_json_in_one_line(tmp_path, capsys, content, named):
    """Catches: JSONDecodeError / AttributeError / KeyError tracebacks for a broken --probe-json, and an empty or
    other-sized probe silently ignored."""
    trace = write_dir(tmp_path / "trace", make_records())
    probe = tmp_path / "probe.json"
    probe.write_text(content)
    assert main(["diagnose", str(trace), "--probe-json", str(probe)], packages=["tools"]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err


def test_diagnose_refuses_ranks_beyond_the_expected_world_size(tmp_path, capsys):
    """Catches: 4 rank files diagnosed as a complete 2-rank job ('coverage 4/2 ranks', exit 0)."""
    trace = write_dir(tmp_path, make_records(ranks=4))
    assert main(["diagnose", str(trace), "--world-size", "2"], packages=["tools"]) == 2
    assert "incomplete trace (ranks [2, 3] beyond the 2 expected)" in capsys.readouterr().err


def test_unwritable_output_paths_are_one_line(tmp_path, capsys):
    """Catches: IsADirectoryError / FileExistsError tracebacks for --json naming a folder and --trace-dir naming
    a file."""
    trace = write_dir(tmp_path / "trace", make_records(ranks=2, steps=12))
    assert main(["diagnose", str(trace), "--json", str(tmp_path)], packages=["tools"]) in (2,)
    assert capsys.readouterr().err.endswith(f"error: --json {tmp_path}: Is a directory\n")
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["straggler-demo", "--trace-dir", str(afile)], packages=["tools"]) == 2
    assert f"error: --trace-dir: {afile} exists and is not a folder" in capsys.readouterr().err


def test_probe_refuses_a_payload_no_rank_can_allocate(capsys):
    """Catches: --nbytes 99999999999999 reaching every rank's allocator (a RuntimeError traceback)."""
    assert main(["probe", "--world-size", "2", "--nbytes", "99999999999999"], packages=["tools"]) == 2
    assert "nbytes in [4, 1073741824], got 5, 99999999999999" in capsys.readouterr().err
