"""The moonep command line: help, the collectives benchmark JSON, and the round-trip demo."""

import inspect
import json
import os
import statistics
import subprocess
import sys

import pytest

from collectives.bench import QUICK_SIZES, MiB, round_trip
from moonep.console import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_parser_has_collectives_commands():
    parser = build_parser()
    args = parser.parse_args(["bench", "collectives", "--world-size", "3", "--backend", "mpi", "--json", "x.json"])
    assert (args.world_size, args.backend, args.json) == (3, "mpi", "x.json") and callable(args.func)
    assert callable(parser.parse_args(["roundtrip"]).func)


_SECONDS = "must be a number of seconds in (0, 31536000] (a year)"


@pytest.mark.parametrize(
    "argv,named",
    [
        (["roundtrip", "--world-size", "0"], "--world-size: must be >= 1, got 0"),
        (["roundtrip", "--world-size", "2", "--hidden", "0"], "--hidden: must be >= 1, got 0"),
        (["roundtrip", "--world-size", "2", "--timeout", "-1"], f"--timeout: {_SECONDS}, got -1.0"),
        (["roundtrip", "--world-size", "2", "--timeout", "nan"], f"--timeout: {_SECONDS}, got nan"),
        (["bench", "collectives", "--timeout", "inf"], f"--timeout: {_SECONDS}, got inf"),  # was a traceback
        (["bench", "collectives", "--timeout", "1e300"], f"--timeout: {_SECONDS}, got 1e+300"),
        (["bench", "collectives", "--world-size", "-2"], "--world-size: must be >= 1, got -2"),
    ],
)
def test_bad_job_arguments_are_one_line_before_any_rank_starts(capsys, argv, named):
    """Catches: a ValueError traceback from launch (world size, timeout) or a ZeroDivisionError on every rank
    (--hidden 0) for a user's typo."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: {named}\n", err


@pytest.mark.spawns
def test_bench_collectives_quick_writes_stable_json(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "collectives", "--quick", "--world-size", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"backend", "world_size", "threads_per_rank", "results", "summary"}
    assert (report["backend"], report["world_size"], report["threads_per_rank"]) == ("torch", 2, 1)  # launch's
    # one row per op and --quick size; each rank sends (all-to-all) or receives (all-gather) the size rounded down
    # to a multiple of the world size
    assert sorted((r["op"], r["bytes"]) for r in report["results"]) == sorted(
        (op, max(1, n // 2) * 2) for op in ("all_to_all", "all_gather") for n in QUICK_SIZES
    )
    for r in report["results"]:
        assert set(r) == {
            "op",
            "bytes",
            "iterations",
            "raw_s",
            "ours_s",
            "ours_validated_s",
            "raw_gbps",
            "ours_gbps",
            "overhead",
            "overhead_validated",
        }
        assert r["iterations"] == 3  # --quick
        assert r["raw_s"] > 0 and r["ours_s"] > 0 and r["ours_validated_s"] > 0
        assert r["raw_gbps"] == pytest.approx(r["bytes"] / r["raw_s"] / 1e9)
        assert r["ours_gbps"] == pytest.approx(r["bytes"] / r["ours_s"] / 1e9)
        assert r["overhead"] > -1.0 and r["overhead_validated"] > -1.0  # ratios of positive times, minus 1
    big = [r["overhead"] for r in report["results"] if r["bytes"] >= MiB]
    s = report["summary"]
    assert set(s) == {"goal_overhead_ge_1MiB", "median_overhead_ge_1MiB", "max_overhead_ge_1MiB", "met"}
    assert len(big) == 2 and s["median_overhead_ge_1MiB"] == pytest.approx(statistics.median(big))
    assert s["max_overhead_ge_1MiB"] == max(big)
    assert s["met"] == (s["median_overhead_ge_1MiB"] <= s["goal_overhead_ge_1MiB"])


@pytest.mark.spawns
def test_roundtrip_demo_via_python_m(tmp_path):
    out = tmp_path / "rt.json"
    proc = subprocess.run(
        [sys.executable, "-m", "collectives", "roundtrip", "--world-size", "3", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data back intact" in proc.stdout
    report = json.loads(out.read_text())
    assert report["world_size"] == 3 and all(r["verified"] for r in report["results"])
    sizes = inspect.signature(round_trip).parameters["sizes"].default  # the demo's sizes; rows of 1024 bf16
    assert [r["bytes_per_rank"] for r in report["results"]] == [max(3, n // 2048) * 2048 for n in sizes]
    for r in report["results"]:
        assert r["dispatch_gbps"] == pytest.approx(r["bytes_per_rank"] / r["dispatch_s"] / 1e9)


@pytest.mark.parametrize("hidden", [10**20, 10**12])
def test_a_row_width_this_machine_cannot_hold_is_one_line_before_any_rank_starts(capsys, hidden):
    """Catches: --hidden 10**20, an OverflowError traceback on every rank; 10**9 at 2 ranks, the OOM killer."""
    assert main(["roundtrip", "--world-size", "2", "--hidden", str(hidden)]) == 2
    err = capsys.readouterr().err
    need = 2 * 12 * hidden * 2 / 2**30  # 2 ranks x 12 bytes x [2 rows, hidden]
    assert err.startswith(f"error: --hidden {hidden}: 2 ranks' rows need {need:.1f} GiB, more than this machine's ")
    assert err.count("\n") == 1, err
