"""The stable JSON, the probe merge, plots, and the CLI commands (exit codes, --json, bad input)."""

import json
import os
import threading
import time

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
    assert sorted(os.listdir(tmp_path / "plots")) == ["rank_step_heatmap.png", "wait_matrix.png"]
    assert (tmp_path / "plots" / "wait_matrix.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["diagnose", str(tmp_path / "missing")], packages=["tools"]) == 2


def test_cli_rejects_bad_injection_naming_the_part(capsys):
    assert main(["straggler-demo", "--inject-slowdown", "rank=1,factr=2"], packages=["tools"]) == 2
    assert "'rank=1,factr=2'" in capsys.readouterr().err


def _writer(path, steps, delay):
    recs = make_records(steps=steps, slow=(2, 2.0, 10))
    files = {r: open(os.path.join(path, f"rank{r}.jsonl"), "w") for r in recs}
    try:
        for step in range(steps):
            for r, rs in recs.items():
                lines = [json.dumps(x) for x in rs if x["step"] == step]
                files[r].write("\n".join(lines) + "\n")
                files[r].write('{"op": "half')  # a record mid-write at every poll boundary...
                files[r].flush()
                files[r].seek(files[r].tell() - len('{"op": "half'))  # ...overwritten by the next step
                files[r].truncate()
            time.sleep(delay)
    finally:
        for f in files.values():
            f.close()


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


def test_simulated_what_if_maps_findings_to_the_simulator():
    """Catches: the simulator's slowdown applied the wrong way round (what-if above the measured step)."""
    from simulator import ParallelConfig
    from tools.simwhatif import simulated_what_if

    par = ParallelConfig(tp=8, pp=4, dp=2, seq_len=2048, global_batch_tokens=131072)
    slow = {"kind": "slow_compute", "ranks": [5], "evidence": {"ratio": 1.3}}
    res = simulated_what_if(slow, "gpt-175b", "h100", par, 64, measured_step_s=10.0)
    assert res["slowdown"] > 1.05 and res["what_if_step_time_s"] < 10.0
    assert simulated_what_if({"kind": "data_loader", "ranks": [1]}, "gpt-175b", "h100", par, 64) is None
