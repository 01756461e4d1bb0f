"""``moonep simulate`` on bad input: one line naming the problem, exit 2 (run, search, whatif, calibrate, model and
hardware files)."""

import json

import pytest

from moonep.console import main


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--gpus", "64", "--tp", "8", "--dp", "7"], "--dp 7"),
        (["--gpus", "8", "--tp", "16"], "TP x CP x PP = 16"),
        (["--gpus", "8", "--tp", "-2"], "--tp must be >= 1"),
        (["--gpus", "-8"], "--gpus must be >= 1"),
        (["--gpus", str(10**20)], "--gpus must be <= 2147483647, got 100000000000000000000"),  # was priced
        (["--gpus", "8", "--seq-len", str(2**31)], "--seq-len must be <= 2147483647"),
        (["--gpus", "8", "--mtp-layers", str(10**20)], "--mtp-layers must be <= 2147483647"),  # was a traceback
        (["--gpus", "8", "--model", "llama3-8b", "--mtp-repeated-layer"], "llama3-8b trains no MTP module"),
        (["--gpus", "8", "--global-batch-tokens", str(2**53 + 1)], "--global-batch-tokens must be <= 9007199254740992"),
        (["--gpus", "8", "--nodes-per-leaf", str(2**31)], "--nodes-per-leaf must be <= 2147483647"),
        (["--gpus", "8", "--seq-len", "0"], "--seq-len"),
        (["--gpus", "8", "--etp", "-1"], "--etp"),
        (["--gpus", "8", "--recompute-modules", "attn"], "recompute_modules"),
        (["--gpus", "8", "--offload-fraction", "2"], "offload_fraction"),
        (["--gpus", "8", "--model", "no-such-model"], "neither a preset"),
        (["--gpus", "8", "--maxvio", "inf"], "--maxvio: must be a finite number >= 0, got inf"),
        (["--gpus", "8", "--maxvio", "nan"], "--maxvio: must be a finite number >= 0, got nan"),
        (["--gpus", "8", "--model", "qwen3-30b-a3b", "--ep", "8", "--maxvio", "inf"], "--maxvio"),  # was OverflowError
        (["--gpus", "8", "--oversubscription", "inf"], "--oversubscription: must be a finite number >= 1"),
        (["--gpus", "8", "--inference-context", "0"], "--inference-context must be >= 1, got 0"),
        (["--gpus", "8", "--inference-context", "-1"], "--inference-context must be >= 1, got -1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(flags, needle, capsys):
    assert main(["simulate", "run", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err, err


_MOE_JOB = ["--model", "qwen3-30b-a3b", "--gpus", "16", "--pp", "2", "--ep", "8"]


@pytest.mark.parametrize("command", ["run", "whatif"])
@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--global-batch-tokens", "12345"], "global batch 12345 tokens is not a whole number of 4096-token"),
        (["--seq-len", "7"], "not a whole number of 7-token sequences"),
        (["--micro-batch", "1000000"], "do not split into DP 8 x micro-batch 1000000"),
        (["--micro-batch", "3"], "do not split into DP 8 x micro-batch 3"),
        (["--gpus", "48", "--tp", "3"], "TP 3 does not divide the 8 GPUs of a node"),
        (["--gpus", "64", "--pp", "64", "--ep", "1"], "48 layers cannot fill 64 pipeline stages"),
        (["--vpp", "2"], "vpp 2 > 1 needs the interleaved schedule"),
        (["--maxvio", "100"], "maxvio 100 > 7, the most routing can make at EP 8"),  # was priced as 101x the mean
        (["--hardware", "a100", "--precision", "fp8"], "has no FP8 tensor cores"),
    ],
)
def test_layout_that_does_not_factor_is_bad_input(command, flags, needle, capsys):
    """Sizes that do not factor are a user's mistake (exit 2, one line), not an answer; only memory is exit 1."""
    assert main(["simulate", command, *_MOE_JOB, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the layout cannot run: ") and needle in err and "\n" not in err, err


_JOB = ["--model", "llama3-8b", "--hardware", "h100", "--gpus", "8"]


@pytest.mark.parametrize(
    "command,flags,needle",
    [
        ("search", ["--maxvio", "inf"], "--maxvio: must be a finite number >= 0, got inf"),
        ("search", ["--schedules", "bogus"], "--schedules: unknown 'bogus'"),
        ("search", ["--schedules", ""], "--schedules: unknown ''"),
        ("search", ["--schedules", "1f1b,"], "--schedules: unknown ''"),
        ("search", ["--recompute-modes", "bogus"], "--recompute-modes: unknown 'bogus'"),
        ("search", ["--micro-batches", "0"], "--micro-batches: must be a comma list of integers >= 1"),
        ("search", ["--micro-batches", "1,-1"], "--micro-batches: must be a comma list of integers >= 1"),
        ("search", ["--max-seconds", "-1"], "--max-seconds: must be a finite number > 0, got -1.0"),
        ("search", ["--max-seconds", "0"], "--max-seconds: must be a finite number > 0, got 0.0"),
        ("search", ["--max-seconds", "nan"], "--max-seconds: must be a finite number > 0, got nan"),
        ("whatif", ["--maxvio", "inf"], "--maxvio: must be a finite number >= 0, got inf"),
        ("whatif", ["--slow", "0=inf"], "--slow 0=inf: slowdown factor must be a finite number >= 1, got inf"),
        ("whatif", ["--slow", "0=nan"], "--slow 0=nan: slowdown factor must be a finite number >= 1, got nan"),
        ("whatif", ["--slow", "0=0"], "--slow 0=0: slowdown factor must be a finite number >= 1"),
        ("whatif", ["--slow", "0=-1"], "--slow 0=-1: slowdown factor must be a finite number >= 1"),
        ("whatif", ["--slow", "99=2"], "--slow 99=2: rank must be an integer in [0, 8), got 99"),
        ("whatif", ["--slow", "0=1=2"], "--slow 0=1=2: expected RANK=FACTOR"),
        ("whatif", ["--link", "0:bogus=0.5"], "--link 0:bogus=0.5: link tier must be one of nvlink, nic, spine"),
        ("whatif", ["--link", "99:nic=0.5"], "--link 99:nic=0.5: link rank must be an integer in [0, 8), got 99"),
        ("whatif", ["--link", "0:nic=2"], "--link 0:nic=2: link factor must be a number in (0, 1], got 2.0"),
        ("whatif", ["--link", "0:nic=0"], "--link 0:nic=0: link factor must be a number in (0, 1], got 0.0"),
        ("whatif", ["--link", "0:nic=nan"], "--link 0:nic=nan: link factor must be a number in (0, 1]"),
        ("whatif", ["--link", "leaf:99=0.5"], "--link leaf:99=0.5: leaf must be an integer in [0, 1), got 99"),
        ("whatif", ["--link", "leaf:x=0.5"], "--link leaf:x=0.5: expected RANK:TIER=FACTOR"),
    ],
)
def test_search_and_whatif_bad_input_is_one_line_and_exit_2(command, flags, needle, capsys):
    assert main(["simulate", command, *_JOB, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err and "Traceback" not in err, err


_SPEC = {"name": "t", "hidden": 1024, "num_layers": 8, "vocab": 32000, "num_heads": 16, "ffn_hidden": 4096}
_MOE = {**_SPEC, "num_experts": 8, "top_k": 2, "moe_ffn_hidden": 512}


@pytest.mark.parametrize(
    "content,needle",
    [
        ({"name": "x", "num_layers": 2, "vocab": 10, "num_heads": 2, "ffn_hidden": 8}, "hidden"),  # missing
        ({"name": "x", "hidden": "64", "num_layers": 2, "vocab": 10, "num_heads": 2, "ffn_hidden": 8}, "hidden"),
        ({"name": "x", "hidden": 64, "num_layers": 2, "vocab": 10, "num_heads": 2, "ffn_hidden": -8}, "ffn_hidden"),
        ({"num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2}, "hidden_size"),  # HF, missing
        ({"hidden_size": 64.5, "num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2}, "hidden_size"),
        (
            {
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "vocab_size": 10,
                "num_attention_heads": 2,
                "intermediate_size": "big",
            },
            "intermediate_size",
        ),
        ([1, 2], "one JSON object"),
        ({"hidden_size": 1e300, "num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2}, "hidden_size"),
        ({"name": "x", "hidden": 10**30, "num_layers": 2, "vocab": 10, "num_heads": 2, "ffn_hidden": 8}, "hidden"),
        ({**_SPEC, "hidden": 8, "num_heads": 16}, "num_heads 16 > hidden 8"),
        ({**_MOE, "expert_groups": 16}, "expert_groups 16 must divide num_experts 8"),
        ({**_MOE, "expert_groups": 3}, "expert_groups 3 must divide num_experts 8"),
        ({**_MOE, "expert_groups": 4, "groups_per_token": 5}, "groups_per_token 5 must be <= expert_groups 4"),
        ({**_MOE, "first_k_dense": 20}, "first_k_dense 20 must be <= num_layers 8"),
    ],
)
def test_bad_model_file_names_the_field(tmp_path, capsys, content, needle):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(content))
    assert main(["simulate", "run", "--gpus", "8", "--model", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err and "Traceback" not in err, err


def test_calibrate_bad_model_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({"hidden_size": 1e300, "num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2})
    )
    assert main(["simulate", "calibrate", "--quick", "--model", str(path), "--out", str(tmp_path / "hw.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "hidden_size" in err and "\n" not in err, err  # was a TypeError in torch


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--world-size", "0"], "--world-size must be >= 1, got 0"),
        (["--micro-batch", "0", "--model", "k3-tiny"], "--micro-batch must be >= 1, got 0"),
        (["--seq-len", "0", "--model", "k3-tiny"], "--seq-len must be >= 1, got 0"),
        (["--micro-batch", "2"], "--seq-len and --micro-batch size a --model's calibration: pass --model too"),
    ],
)
def test_calibrate_bad_sizes_are_one_line(tmp_path, capsys, extra, needle):
    """Catches: --world-size 0 running a 1-rank calibration, --seq-len 0 falling back to the model's own length
    (a long run), --micro-batch without --model silently ignored."""
    assert main(["simulate", "calibrate", "--quick", *extra, "--out", str(tmp_path / "hw.json")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {needle}"


@pytest.mark.parametrize(
    "content,needle",
    [
        ({"efficiency": {"elementwise_bytes": float("nan")}}, "Efficiency.elementwise_bytes must be a finite number"),
        ({"efficiency": {"gemm_half_gflop": -1}}, "Efficiency.gemm_half_gflop must be a finite number in [0, 1e+12]"),
        ({"efficiency": {"moe_copy_ns": float("inf")}}, "Efficiency.moe_copy_ns must be a finite number in [0, 1e+12]"),
        ({"fp8_tflops": float("nan")}, "HardwareSpec.fp8_tflops must be a finite number in [0, 1e+12], got nan"),
        ({"reserved_gib": float("nan")}, "HardwareSpec.reserved_gib must be a finite number in [0, 1e+12], got nan"),
        ({"hbm_gib": float("inf")}, "HardwareSpec.hbm_gib must be a finite number in [1e-12, 1e+12], got inf"),
        ({"nvlink_latency_us": -5}, "HardwareSpec.nvlink_latency_us must be a finite number in [0, 1e+12], got -5"),
        (
            {"nic_latency_us": float("nan")},
            "HardwareSpec.nic_latency_us must be a finite number in [0, 1e+12], got nan",
        ),
        ({"price_per_gpu_hour": float("inf")}, "HardwareSpec.price_per_gpu_hour must be a finite number in [0, 1e+12]"),
        (
            {"pcie_gbps": 0},
            "HardwareSpec.pcie_gbps must be a finite number in [1e-12, 1e+12], got 0",
        ),  # was ZeroDivisionError
        ({"base": 5}, "hardware 'base' must be a preset name"),
    ],
)
def test_bad_hardware_number_names_the_field(tmp_path, capsys, content, needle):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"base": "h100", **content}))  # json writes NaN / Infinity as Python's json reads them
    argv = ["simulate", "run", "--gpus", "8", "--model", "llama3-8b", "--hardware", str(path)]
    assert main([*argv, "--offload-fraction", "0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err and "Traceback" not in err, err


def test_bad_hardware_file_names_the_field(tmp_path, capsys):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"base": "h100", "nic_gbps": "fast"}))
    assert main(["simulate", "run", "--gpus", "8", "--model", "llama3-8b", "--hardware", str(path)]) == 2
    assert "nic_gbps" in capsys.readouterr().err
    path.write_text(json.dumps({"name": "x", "bf16_tflops": 1.0}))
    assert main(["simulate", "run", "--gpus", "8", "--model", "llama3-8b", "--hardware", str(path)]) == 2
    assert "hbm_gib" in capsys.readouterr().err
