"""Command line: the stable JSON keys of ``moonep simulate run``, infeasible exits, search, whatif, calibrate."""

import json

import pytest

from moonep.console import build_parser, main
from simulator.hardware import load_hardware
from simulator.specs import load_model

STABLE = (
    "step_time_s",
    "tokens_per_s_per_gpu",
    "tflops_per_gpu",
    "mfu",
    "memory_gib_per_gpu",
    "breakdown",
    "feasible",
    "reason",
)


def test_run_json(tmp_path, capsys):
    out = tmp_path / "out.json"
    rc = main(
        [
            "simulate",
            "run",
            "--model",
            "k3",
            "--hardware",
            "h200",
            "--gpus",
            "4096",
            "--pp",
            "16",
            "--ep",
            "64",
            "--seq-len",
            "8192",
            "--global-batch-tokens",
            str(64 * 2**20),
            "--recompute",
            "full",
            "--dispatcher",
            "classic",
            "--maxvio",
            "0.2",
            "--inference-context",
            "131072",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert all(k in data for k in STABLE) and data["feasible"] is True
    assert data["parallel"]["dp"] == 256
    # inference memory, from the spec alone: the MLA layers cache (kv_lora_rank + rope) bf16 values per token, the
    # KDA layers a fp32 [H, K, K] state per sequence plus the bf16 conv taps of q, k, v, whatever the context
    spec, inf, gib = load_model("k3"), data["inference_memory_gib"], 2.0**30
    kinds = [attn for attn, _ in spec.layer_kinds()]
    kv_per_token = kinds.count("mla") * (spec.kv_lora_rank + spec.qk_rope_dim) * 2
    width = spec.kda_heads * spec.kda_head_dim
    state = kinds.count("kda") * (spec.kda_heads * spec.kda_head_dim**2 * 4 + 3 * width * (spec.kda_conv - 1) * 2)
    assert inf["kv_bytes_per_token"] == kv_per_token
    assert inf["mla_kv"] * gib == kv_per_token * 131072
    assert inf["kda_state"] * gib == state and inf["kda_state_bytes_per_sequence"] == state
    assert inf["total"] == inf["weights"] + inf["mla_kv"] + inf["kda_state"]
    assert "step time" in capsys.readouterr().out


def test_run_infeasible_exit_and_reason(tmp_path):
    out = tmp_path / "oom.json"
    # a valid layout that does not fit: exit 1, the reason in the JSON
    rc = main(
        ["simulate", "run", "--model", "llama3-405b", "--hardware", "h100", "--gpus", "64", "--tp", "8"]
        + ["--recompute", "none", "--json", str(out)]
    )
    data = json.loads(out.read_text())
    assert rc == 1 and data["feasible"] is False and "out of memory" in data["reason"]


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--gpus", "64", "--tp", "8", "--dp", "7"], "--dp 7"),
        (["--gpus", "8", "--tp", "16"], "TP x CP x PP = 16"),
        (["--gpus", "8", "--tp", "-2"], "--tp must be >= 1"),
        (["--gpus", "-8"], "--gpus must be >= 1"),
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
        ({"efficiency": {"gemm_half_gflop": -1}}, "Efficiency.gemm_half_gflop must be a finite number >= 0"),
        ({"efficiency": {"moe_copy_ns": float("inf")}}, "Efficiency.moe_copy_ns must be a finite number >= 0"),
        ({"fp8_tflops": float("nan")}, "HardwareSpec.fp8_tflops must be a finite number >= 0, got nan"),
        ({"reserved_gib": float("nan")}, "HardwareSpec.reserved_gib must be a finite number >= 0, got nan"),
        ({"hbm_gib": float("inf")}, "HardwareSpec.hbm_gib must be a finite number > 0, got inf"),
        ({"nvlink_latency_us": -5}, "HardwareSpec.nvlink_latency_us must be a finite number >= 0, got -5"),
        ({"nic_latency_us": float("nan")}, "HardwareSpec.nic_latency_us must be a finite number >= 0, got nan"),
        ({"price_per_gpu_hour": float("inf")}, "HardwareSpec.price_per_gpu_hour must be a finite number >= 0"),
        ({"pcie_gbps": 0}, "HardwareSpec.pcie_gbps must be a finite number > 0, got 0"),  # was ZeroDivisionError
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


def test_run_plots(tmp_path):
    rc = main(
        [
            "simulate",
            "run",
            "--model",
            "kimi-k2",
            "--hardware",
            "h200",
            "--gpus",
            "512",
            "--pp",
            "8",
            "--ep",
            "32",
            "--seq-len",
            "4096",
            "--global-batch-tokens",
            str(4096 * 1024),
            "--recompute",
            "full",
            "--schedule",
            "dualpipe",
            "--plots",
            str(tmp_path),
        ]
    )
    assert rc == 0
    for name in ("timeline.png", "memory.png", "maxvio.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name  # a PNG, not an empty file
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert {rank for rank, *_ in timeline["ops"]} == set(range(8))  # --pp 8: every pipeline rank has ops
    assert timeline["makespan_s"] == max(end for *_, end in timeline["ops"])
    assert all(start < end for *_, start, end in timeline["ops"])
    sweep = json.loads((tmp_path / "maxvio.json").read_text())
    assert set(sweep) == {"maxvio", "moonep", "classic"} and sweep["maxvio"][0] == 0.0
    assert len(sweep["moonep"]) == len(sweep["classic"]) == len(sweep["maxvio"])
    assert sweep["moonep"][0] == sweep["classic"][0]  # balanced routing: the two dispatchers cost the same
    assert sweep["classic"] == sorted(sweep["classic"])  # skew only slows the classic dispatcher down


def test_search_cli(tmp_path):
    out = tmp_path / "s.json"
    rc = main(
        [
            "simulate",
            "search",
            "--model",
            "gpt-175b",
            "--hardware",
            "h100",
            "--gpus",
            "128",
            "--global-batch-tokens",
            str(256 * 2048),
            "--schedules",
            "1f1b",
            "--recompute-modes",
            "selective",
            "--micro-batches",
            "1",
            "--event-top",
            "1",
            "--json",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert rc == 0 and data["results"]
    assert data["evaluated"] == data["candidates"]  # no --max-seconds: the whole space
    assert data["feasible"] + sum(data["infeasible_reasons"].values()) == data["evaluated"]
    assert data["configs_per_s"] == pytest.approx(data["evaluated"] / data["seconds"])
    top = build_parser().parse_args(["simulate", "search", "--gpus", "1"]).top  # the --top default
    assert len(data["results"]) == min(top, data["feasible"])
    speeds = [r["tokens_per_s_per_gpu"] for r in data["results"]]
    assert speeds == sorted(speeds, reverse=True)
    assert "event_step_time_s" in data["results"][0] and "event_step_time_s" not in data["results"][-1]
    for r in data["results"]:
        assert (r["parallel"]["schedule"], r["parallel"]["recompute"], r["parallel"]["micro_batch"]) == (
            "1f1b",
            "selective",
            1,
        )  # the flags narrowed the space


def test_whatif_cli(tmp_path):
    out = tmp_path / "w.json"
    rc = main(
        [
            "simulate",
            "whatif",
            "--model",
            "gpt-175b",
            "--hardware",
            "h100",
            "--gpus",
            "64",
            "--tp",
            "8",
            "--pp",
            "4",
            "--seq-len",
            "2048",
            "--global-batch-tokens",
            str(64 * 2048),
            "--slow",
            "5=1.4",
            "--link",
            "12:nic=0.5",
            "--link",
            "leaf:0=0.5",
            "--json",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert rc == 0 and data["slowdown"] > 1.0 and data["slowdown"] == data["step_s"] / data["baseline_step_s"]
    causes = [{k: v for k, v in a.items() if k != "slowdown_alone"} for a in data["attribution"]]
    assert sorted(causes, key=str) == sorted(
        [{"rank": 5, "compute_factor": 1.4}, {"rank": 12, "tier": "nic", "factor": 0.5}, {"leaf": 0, "factor": 0.5}],
        key=str,
    )  # the flags, parsed
    alone = [a["slowdown_alone"] for a in data["attribution"]]
    assert alone == sorted(alone, reverse=True) and alone[-1] >= 1.0 and alone[0] <= data["slowdown"]


@pytest.mark.spawns
def test_calibrate_writes_usable_profile(tmp_path):
    """Measures through collectives.launch (2 local ranks) and the profile drives a simulation."""
    prof = tmp_path / "hw.json"
    assert main(["simulate", "calibrate", "--quick", "--world-size", "2", "--out", str(prof)]) == 0
    data = json.loads(prof.read_text())
    m = data["measured"]
    assert (m["world_size"], m["backend"], m["quick"]) == (2, "torch", True)
    assert m["all_to_all_gbps_per_rank"] > 0 and data["bf16_tflops"] == m["gemm_tflops"] > 0
    assert data["nvlink_gbps"] == data["nic_gbps"] == max(m["all_to_all_gbps_per_rank"], 1e-3)
    assert data["host"]["ranks"] == 2  # a CPU profile carries the host block, measured on the 2 ranks
    assert load_hardware(str(prof)).bf16_tflops == data["bf16_tflops"]  # loadable as --hardware
    out = tmp_path / "r.json"
    main(
        [
            "simulate",
            "run",
            "--model",
            "gpt-22b",
            "--hardware",
            str(prof),
            "--gpus",
            "2",
            "--tp",
            "2",
            "--seq-len",
            "2048",
            "--global-batch-tokens",
            "4096",
            "--json",
            str(out),
        ]
    )
    res = json.loads(out.read_text())
    assert res["hardware"] == data["name"]
    assert res["feasible"] or res["reason"].startswith("out of memory")  # 22B in the profile's 16 GiB: still priced
    assert res["tokens_per_s_per_gpu"] == pytest.approx(4096 / res["step_time_s"] / 2)  # tokens / step / GPUs
    assert sum(res["breakdown"].values()) == pytest.approx(res["step_time_s"])
