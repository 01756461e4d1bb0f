"""Accuracy on 4 real local gloo ranks running the synthetic MoE step (tools/workload.py), one launch each.

These are the issue's acceptance checks: a 1.2x compute slowdown found on the right rank within 10 steps of its
onset; a link delay attributed to its pair (trace signature + pairwise probe); 100 clean steps without an alarm;
a skewed router blamed on routing, not hardware.
"""

import json

import numpy as np
import pytest

from collectives.faults import parse_link_delay_specs, parse_slowdowns
from moonep.console import main
from tools.bench import bench_telemetry
from tools.probe import ProbeConfig, run_probe
from tools.report import analyse
from tools.workload import WorkloadConfig, run_local

WORLD = 4


def diagnose_run(tmp_path, with_tables=False, **cfg):
    run_local(WorkloadConfig(**cfg), WORLD, str(tmp_path), timeout=60, job_timeout=120)
    report, tables = analyse(tmp_path)
    return (report, tables) if with_tables else report


def kinds(report):
    return [(f["kind"], f["ranks"]) for f in report["findings"]]


@pytest.mark.spawns
@pytest.mark.solo
@pytest.mark.host_noise
def test_slowdown_1_2x_found_on_right_rank_within_10_steps(tmp_path):
    report, tables = diagnose_run(
        tmp_path, True, steps=30, slowdowns=tuple(parse_slowdowns("rank=2,factor=1.2,from_step=10"))
    )
    slow = [f for f in report["findings"] if f["kind"] == "slow_compute"]
    assert [f["ranks"] for f in slow] == [[2]], kinds(report)
    assert 10 <= slow[0]["onset_step"] <= 20
    # the host's load moves step times a lot between runs: compare with the same run's steps after the onset
    after = np.median(tables.step_time_s[tables.steps.index(slow[0]["onset_step"]) :])
    assert slow[0]["what_if_step_time_s"] < after


@pytest.mark.spawns
@pytest.mark.solo
def test_link_delay_attributed_to_its_pair(tmp_path):
    """Catches: a slow link blamed on a rank's compute, or on the wrong pair."""
    spec = "src=1,dst=3,ms=80,from_step=4"  # well above this shared host's step jitter (30 ms is found 3 in 4)
    report = diagnose_run(tmp_path, steps=16, link_delays=tuple(parse_link_delay_specs(spec)))
    assert kinds(report) == [("slow_link", [0, 1, 2, 3])]  # the all-to-all says "a link in this group"
    # one noisy step just before the onset may be taken as its start: 2 steps early is tolerated
    assert 4 - 2 <= report["findings"][0]["onset_step"] <= 4 + 10
    probe = run_probe(WORLD, ProbeConfig(rounds=5), link_delay=spec)
    pairs = probe["slow_pairs"]
    assert pairs[0]["ranks"] == [1, 3]  # ...and the probe names the pair, well ahead of any other
    assert all(pairs[0]["seconds"] > 3 * p["seconds"] for p in pairs[1:])
    report, _ = analyse(tmp_path, probe=probe)
    assert kinds(report) == [("slow_link", [1, 3])]


@pytest.mark.spawns
@pytest.mark.solo
@pytest.mark.host_noise
def test_100_clean_steps_raise_no_alarm(tmp_path):
    report = diagnose_run(tmp_path, steps=100)
    assert report["steps"]["count"] == 100
    assert report["findings"] == [], kinds(report)


@pytest.mark.spawns
@pytest.mark.solo
def test_skewed_router_blamed_on_routing_not_hardware(tmp_path):
    report = diagnose_run(tmp_path, steps=24, skew=0.5, hot_rank=1)
    assert ("routing_imbalance", [1]) in kinds(report)
    assert not [f for f in report["findings"] if f["kind"] in ("slow_compute", "slow_link")], kinds(report)


@pytest.mark.spawns
@pytest.mark.solo
def test_clean_probe_has_no_slow_pair(tmp_path, capsys):
    """Through the issue's spelling `moonep diagnose probe --world-size N` (alias of `moonep probe`), at the
    default 5 rounds: with 3, a loaded CI host kept one pair of 4 ranks on 2 cores descheduled in every round
    (5.45 ms, 14.5x the median) and the clean probe reported a slow pair."""
    rc = main(["diagnose", "probe", "--world-size", str(WORLD), "--json", str(tmp_path / "p.json")], packages=["tools"])
    probe = json.loads((tmp_path / "p.json").read_text())
    assert rc == 0 and probe["slow_pairs"] == [] and len(probe["one_way_s"]) == WORLD
    assert "no slow pair" in capsys.readouterr().out


@pytest.mark.spawns
@pytest.mark.solo
def test_demo_command_finds_a_slow_data_loader(tmp_path, capsys):
    rc = main(
        [
            "straggler-demo",
            "--world-size",
            "4",
            "--steps",
            "20",
            "--trace-dir",
            str(tmp_path / "t"),
            "--inject-data-delay",
            "rank=3,ms=15,from_step=5",
            "--json",
            str(tmp_path / "f.json"),
        ],
        packages=["tools"],
    )
    findings = json.loads((tmp_path / "f.json").read_text())["findings"]
    assert rc == 1 and ("data_loader", [3]) in [(f["kind"], f["ranks"]) for f in findings]
    assert "data_loader" in capsys.readouterr().out


@pytest.mark.spawns
@pytest.mark.solo
def test_telemetry_benchmark_reports_ratio(tmp_path):
    result = bench_telemetry(world_size=2, steps=24, blocks=4, interval_s=0.05)
    assert len(result["pair_ratios"]) == 2
    assert result["source"] in ("cpu", "nvml") and result["goal_ratio"] == 1.02
    assert 0.5 < result["ratio"] < 2.0 and result["sampler_duty"] < 0.02
    assert (
        main(
            ["bench", "telemetry", "--steps", "8", "--blocks", "2", "--json", str(tmp_path / "b.json")],
            packages=["tools"],
        )
        == 0
    )
    assert json.loads((tmp_path / "b.json").read_text())["benchmark"] == "telemetry"
