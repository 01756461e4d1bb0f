"""The benchmark's quick mode through the real command line, and the CLI's import weight."""

import json
import subprocess
import sys

import pytest

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
def test_bad_sizes_are_one_line(capsys, flag):
    """Catches: --heads 0 ending in a ZeroDivisionError, --chunk-size 0 in the kernel's ValueError traceback."""
    assert main(["bench", "kda", "--quick", flag, "0"]) == 2
    assert capsys.readouterr().err == f"error: {flag}: must be >= 1, got 0\n"
