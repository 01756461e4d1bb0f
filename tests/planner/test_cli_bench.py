"""The ``plan`` command and the ``planner`` bench target: exit codes, JSON schema, exact balance."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch  # at collection: torch's first import asks ldconfig, a process conftest refuses in an unmarked test

from planner import cli


def parser() -> argparse.ArgumentParser:
    """The same tree moonep.console builds, with the planner package alone."""
    root = argparse.ArgumentParser(prog="test")
    commands = root.add_subparsers(dest="command")
    bench = commands.add_parser("bench").add_subparsers(dest="target")
    cli.register(commands, bench)
    return root


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


def test_bench_quick_writes_stable_json(tmp_path, capsys):
    """Schema of `moonep bench planner --quick --json`; the planner's balance is exactly 1.0."""
    out = tmp_path / "bench.json"
    assert run(["bench", "planner", "--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["cases"], "no cases"
    for case in data["cases"]:
        assert {"R", "E", "plan_us", "eplb_us", "balance", "eplb_balance"} <= case.keys()
        assert case["balance"] == 1.0
        assert case["plan_us"] > 0 and case["eplb_us"] > 0 and case["eplb_balance"] >= 1.0
    assert data["sticky"]["balance"] == 1.0 and data["sticky"]["copies_ratio"] >= 0
    assert all(t["balance"] == 1.0 for t in data["topology"])
    assert "plan us" in capsys.readouterr().out


def test_bench_refuses_a_negative_seed_in_one_line(capsys):
    """Catches numpy's "expected non-negative integer" traceback, which named no flag."""
    assert run(["bench", "planner", "--quick", "--seed", "-1"]) == 2
    assert capsys.readouterr().err == "error: --seed: must be >= 0, got -1\n"


def test_plan_command_synthetic_with_plot_and_json(tmp_path, capsys):
    """Before/after loads, replicas and the flow minimum reach the JSON; the chart is written."""
    js, png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = run(
        [
            "plan",
            "--ranks",
            "8",
            "--experts",
            "32",
            "--topk",
            "4",
            "--tokens",
            "64",
            "--synthetic",
            "zipf:1.3",
            "--nodes",
            "2",
            "--json",
            str(js),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    data = json.loads(js.read_text())
    assert sum(data["before"]) == sum(data["after"]) == data["total_rows"]
    assert max(data["after"]) - min(data["after"]) <= 1
    assert data["migrated_rows"] >= data["min_migration"]
    assert "internode" in data
    assert png.stat().st_size > 1000
    assert "balance max/mean" in capsys.readouterr().out


def test_plan_command_router_load(tmp_path):
    """--synthetic router:SKEW plans the counts of top-k lists: no rank sends an expert more than S slots."""
    js = tmp_path / "plan.json"
    assert (
        run(
            [
                "plan",
                "--ranks",
                "4",
                "--experts",
                "16",
                "--topk",
                "4",
                "--tokens",
                "32",
                "--synthetic",
                "router:2.0",
                "--json",
                str(js),
            ]
        )
        == 0
    )
    data = json.loads(js.read_text())
    assert data["total_rows"] == 4 * 32 * 4 and max(data["after"]) - min(data["after"]) <= 1


def test_plan_command_load_file_and_bad_input(tmp_path, capsys):
    """--load reads [R, E]; a bad file or shape mismatch exits 2 with a message, not a traceback."""
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps({"slots_per_expert": np.arange(12).reshape(3, 4).tolist()}))
    assert run(["plan", "--load", str(counts)]) == 2  # 4 experts on 3 ranks: E % R != 0
    assert "E % R" in capsys.readouterr().err
    counts.write_text(json.dumps(np.arange(16).reshape(4, 4).tolist()))
    assert run(["plan", "--load", str(counts), "--ranks", "4"]) == 0
    assert run(["plan", "--load", str(counts), "--ranks", "2"]) == 2
    assert run(["plan", "--synthetic", "zipf:1", "--ranks", "4"]) == 2  # --experts missing
    assert run(["plan", "--synthetic", "uniform:1", "--ranks", "4", "--experts", "8"]) == 2
    assert "zipf:1.2 or router:1.2" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,named",
    [
        (["--topk", "0"], "--topk: must be in [1, --experts=8], got 0"),
        (["--topk", "9"], "--topk: must be in [1, --experts=8], got 9"),
        (["--tokens", "-1"], "--tokens: must be >= 1, got -1"),
        (["--ranks", "0"], "--ranks: must be >= 1, got 0"),
        (["--synthetic", "router:inf"], "router skew must be a finite number >= 0, got inf"),
        (["--synthetic", "zipf:nan"], "zipf skew must be a finite number >= 0, got nan"),
    ],
)
def test_plan_command_refuses_bad_synthetic_sizes(capsys, extra, named):
    """Catches: --topk 0 planned as an empty load (exit 0), --tokens -1 reported as numpy's 'n < 0', router:inf
    planned (exit 0)."""
    base = {"--synthetic": "zipf:1", "--ranks": "4", "--experts": "8", "--topk": "2", "--tokens": "16"}
    base.update(zip(extra[::2], extra[1::2]))
    argv = ["plan"] + [x for kv in base.items() for x in kv]
    assert run(argv) == 2
    assert f"moonep plan: {named}" in capsys.readouterr().err


def test_device_planner_bench_on_cpu_checks_its_plans(tmp_path, capsys):
    """`moonep bench device-planner --device cpu --quick`: the timed plans equal the numpy planner's."""
    out = tmp_path / "device.json"
    assert run(["bench", "device-planner", "--device", "cpu", "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["goal_us"] == 100.0
    (row,) = report["rows"]
    assert (row["R"], row["E"], row["iters"]) == (4, 16, 3)
    assert row["equal_to_numpy_planner"] is True and 0 < row["median_us"] <= row["p90_us"] * 1.0001 + 1e-9


def test_device_planner_bench_on_cuda_or_a_clear_error(capsys):
    """With a GPU the CUDA run's plans equal the numpy planner's; without one, exit 2 naming the reason."""
    code = run(["bench", "device-planner", "--device", "cuda", "--quick"])
    if torch.cuda.is_available():
        assert code == 0 and "True" in capsys.readouterr().out
    else:
        assert code == 2 and "torch.cuda.is_available() is False" in capsys.readouterr().err
