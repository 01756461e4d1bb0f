"""The benchmark's quick mode through the real command line, and the CLI's import weight."""

import json
import subprocess
import sys

import pytest
import torch  # noqa: F401  (torch's first import starts ldconfig: at collection, not in a no-process test)

from moonep.console import main


@pytest.mark.spawns
def test_quick_bench_writes_the_stable_schema(tmp_path):
    out = tmp_path / "kda.json"
    assert main(["bench", "kda", "--quick", "--json", str(out)], packages=["cp_kda"]) == 0
    result = json.loads(out.read_text())
    assert set(result) >= {"config", "chunk_vs_recurrent", "cp", "summary"}
    for row in result["chunk_vs_recurrent"].values():
        assert set(row) >= {"chunk", "recurrent", "speedup"} and row["chunk"] > 0
    assert {(e["world_size"], e["strategy"]) for e in result["cp"]} == {(1, "scan"), (2, "scan"), (2, "ring")}
    for e in result["cp"]:
        assert set(e) >= {"world_size", "strategy", "T", "seconds", "bytes_per_rank"}
        assert e["bytes_per_rank"] == e["expected_bytes_per_rank"]
    cfg = result["config"]
    assert result["cp"][0]["bytes_per_rank"] == 4 * cfg["H"] * cfg["K"] * (cfg["K"] + cfg["V"])


@pytest.mark.spawns
def test_cli_module_is_light():
    """``moonep --help`` imports every package's cli module: ours must not pull in torch."""
    code = "import sys, cp_kda.cli; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


@pytest.mark.parametrize("flag", ["--heads", "--head-dim", "--chunk-size"])
@pytest.mark.parametrize("value", [0, 10**20])
def test_bad_sizes_are_one_line(capsys, flag, value):
    """Catches: --heads 0 ending in a ZeroDivisionError, --chunk-size 0 in the kernel's ValueError traceback, 10**20
    in an OverflowError traceback."""
    assert main(["bench", "kda", "--quick", flag, str(value)]) == 2
    assert capsys.readouterr().err == f"error: {flag}: must be in [1, 2147483647], got {value}\n"


@pytest.mark.parametrize(
    "flags,said",
    [
        # an allocator's traceback after seconds of work: the chunk's work grows as its cube (125 GB at 5000)
        (
            ["--quick", "--chunk-size", "5000"],
            "--chunk-size 5000: must be at most the shortest sequence benchmarked, 256",
        ),
        (["--chunk-size", "2000"], "--chunk-size 2000: must be at most the shortest sequence benchmarked, 1024 tokens"),
        # 4 CP ranks x [32768, 10**5] x (3 x 128 + 128 + 1) fp32: 25,049 GiB before any kernel runs
        (
            ["--heads", "100000"],
            "--heads 100000 --head-dim 128 --chunk-size 64: the benchmark's inputs alone need 25048.8 GiB",
        ),
    ],
)
def test_sizes_this_machine_cannot_run_are_one_line_before_any_work(capsys, flags, said):
    assert main(["bench", "kda", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {said}") and err.count("\n") == 1, err
