"""Command line: the stable JSON keys of ``moonep simulate run``, infeasible exits, search, whatif, calibrate."""
import json

from moonep.cli import main

STABLE = ("step_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "memory_gib_per_gpu", "breakdown",
          "feasible", "reason")


def test_run_json(tmp_path, capsys):
    out = tmp_path / "out.json"
    rc = main(["simulate", "run", "--model", "k3", "--hardware", "h200", "--gpus", "4096", "--pp", "16", "--ep", "64",
               "--seq-len", "8192", "--global-batch-tokens", str(64 * 2**20), "--recompute", "full",
               "--dispatcher", "classic", "--maxvio", "0.2", "--inference-context", "131072", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert all(k in data for k in STABLE) and data["feasible"] is True
    assert data["parallel"]["dp"] == 256 and data["inference_memory_gib"]["kda_state"] > 0
    assert "step time" in capsys.readouterr().out


def test_run_infeasible_exit_and_reason(tmp_path):
    out = tmp_path / "bad.json"
    rc = main(["simulate", "run", "--model", "llama3-405b", "--hardware", "h100", "--gpus", "64", "--tp", "8",
               "--dp", "7", "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 1 and data["feasible"] is False and "!= 64 GPUs" in data["reason"]
    assert main(["simulate", "run", "--gpus", "8", "--tp", "16"]) == 1  # TP x CP x PP larger than the job


def test_run_plots(tmp_path):
    rc = main(["simulate", "run", "--model", "kimi-k2", "--hardware", "h200", "--gpus", "512", "--pp", "8",
               "--ep", "32", "--seq-len", "4096", "--global-batch-tokens", str(4096 * 1024), "--recompute", "full",
               "--schedule", "dualpipe", "--plots", str(tmp_path)])
    assert rc == 0
    for name in ("timeline.png", "timeline.json", "memory.png", "maxvio.png", "maxvio.json"):
        assert (tmp_path / name).stat().st_size > 0


def test_search_cli(tmp_path):
    out = tmp_path / "s.json"
    rc = main(["simulate", "search", "--model", "gpt-175b", "--hardware", "h100", "--gpus", "128",
               "--global-batch-tokens", str(256 * 2048), "--schedules", "1f1b", "--recompute-modes", "selective",
               "--micro-batches", "1", "--event-top", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0 and data["results"] and data["configs_per_s"] > 0


def test_whatif_cli(tmp_path):
    out = tmp_path / "w.json"
    rc = main(["simulate", "whatif", "--model", "gpt-175b", "--hardware", "h100", "--gpus", "64", "--tp", "8",
               "--pp", "4", "--seq-len", "2048", "--global-batch-tokens", str(64 * 2048), "--slow", "5=1.4",
               "--link", "12:nic=0.5", "--link", "leaf:0=0.5", "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0 and data["slowdown"] > 1.0 and len(data["attribution"]) == 3


def test_calibrate_writes_usable_profile(tmp_path):
    """Measures through collectives.launch (2 local ranks) and the profile drives a simulation."""
    prof = tmp_path / "hw.json"
    assert main(["simulate", "calibrate", "--quick", "--world-size", "2", "--out", str(prof)]) == 0
    data = json.loads(prof.read_text())
    assert data["measured"]["all_to_all_gbps_per_rank"] > 0 and data["bf16_tflops"] > 0
    out = tmp_path / "r.json"
    main(["simulate", "run", "--model", "gpt-22b", "--hardware", str(prof), "--gpus", "2", "--tp", "2",
          "--seq-len", "2048", "--global-batch-tokens", "4096", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["step_time_s"] > 0 and res["hardware"].startswith("calibrated")
