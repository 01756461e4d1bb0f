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
