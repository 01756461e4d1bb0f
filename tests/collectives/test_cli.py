"""The moonep command line: help, the collectives benchmark JSON, and the round-trip demo."""
import json
import os
import subprocess
import sys

from moonep.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_parser_has_collectives_commands():
    parser = build_parser()
    args = parser.parse_args(["bench", "collectives", "--world-size", "3", "--backend", "mpi", "--json", "x.json"])
    assert (args.world_size, args.backend, args.json) == (3, "mpi", "x.json") and callable(args.func)
    assert callable(parser.parse_args(["roundtrip"]).func)


def test_bench_collectives_quick_writes_stable_json(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "collectives", "--quick", "--world-size", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "torch" and report["world_size"] == 2
    ops = {(r["op"], r["bytes"]) for r in report["results"]}
    assert {op for op, _ in ops} == {"all_to_all", "all_gather"}
    for r in report["results"]:
        assert r["raw_s"] > 0 and r["ours_s"] > 0 and r["ours_validated_s"] > 0
        assert r["iterations"] >= 3 and r["overhead"] > -1.0 and r["overhead_validated"] > -1.0
    assert set(report["summary"]) == {"goal_overhead_ge_1MiB", "median_overhead_ge_1MiB",
                                      "max_overhead_ge_1MiB", "met"}


def test_roundtrip_demo_via_python_m(tmp_path):
    out = tmp_path / "rt.json"
    proc = subprocess.run([sys.executable, "-m", "collectives", "roundtrip", "--world-size", "3", "--json",
                           str(out)], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data back intact" in proc.stdout
    report = json.loads(out.read_text())
    assert report["world_size"] == 3 and all(r["verified"] for r in report["results"])
