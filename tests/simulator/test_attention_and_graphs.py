"""Core attention priced from its shape (simulator/attention_model.py) and the two speed recipe knobs read from the
Megatron-Bridge recipes: `--fp8-attention` (fp8_dot_product_attention) and `--cuda-graph full` (full-iteration
CUDA graph: the dropless MoE host sync and launches replaced by the graphed fill-and-drain cost); the LM head runs
in bf16 in fp8 runs."""

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moonep.console import main
from simulator import ParallelConfig
from simulator.attention_model import FP8_SPEEDUP, KEY_TILE, head_dim_slowdown, keys_per_query
from simulator.costs import _head_seconds, chunk_cost
from simulator.hardware import load_hardware
from simulator.network import ClusterSpec, cluster_tiers
from simulator.specs import load_model

QWEN = load_model("qwen3-30b-a3b")
GB200 = load_hardware("gb200")
PAR = ParallelConfig(ep=8, etp=1, dp=8, micro_batch=4, seq_len=4096, global_batch_tokens=512 * 4096)
PAR = replace(PAR, precision="fp8", dispatcher="deepep", recompute="none")


@given(seq=st.integers(1, 1 << 17), window=st.integers(0, 1 << 17))
def test_keys_per_query_bounded(seq, window):
    """Never more than every key, never fewer than the causal half; a window costs at most one tile extra."""
    causal = keys_per_query(seq)
    assert seq / 2 <= causal <= seq
    keys = keys_per_query(seq, window)
    assert keys <= causal
    if window:
        assert keys <= window + KEY_TILE
    assert keys_per_query(seq, flash=False) == keys_per_query(seq, window, flash=False) == seq


def test_head_dim_slowdown_is_monotone_and_anchored():
    dims = [16, 32, 64, 80, 96, 112, 128, 192, 256]
    slow = [head_dim_slowdown(d) for d in dims]
    assert slow == sorted(slow, reverse=True)
    assert head_dim_slowdown(64) == pytest.approx(1.27) and head_dim_slowdown(128) == 1.0
    assert head_dim_slowdown(96) == pytest.approx((1.27 + 1.0) / 2)


def _chunk(spec, par, hw=GB200):
    tiers = cluster_tiers(par.gpus, hw, ClusterSpec())
    return chunk_cost(spec, hw, par, list(range(spec.num_layers)), tiers)


def test_fp8_attention_speeds_attention_only():
    base, fp8 = _chunk(QWEN, PAR), _chunk(QWEN, replace(PAR, fp8_attention=True))
    assert base.fwd["attention"] / fp8.fwd["attention"] == pytest.approx(FP8_SPEEDUP)
    assert base.fwd["grouped_gemm"] == fp8.fwd["grouped_gemm"] and base.fwd["gemm"] == fp8.fwd["gemm"]


def test_sliding_window_layers_cost_a_window_plus_a_tile():
    """gpt-oss: every other layer a 128-key window, so its attention is about half of all-full-causal layers."""
    oss = load_model("gpt-oss-120b")
    full = replace(oss, sliding_window_layers=(), sliding_window=0)
    par = replace(PAR, ep=8, dp=8)
    windowed, dense = _chunk(oss, par).fwd["attention"], _chunk(full, par).fwd["attention"]
    expected = 0.5 + 0.5 * (oss.sliding_window + KEY_TILE) / keys_per_query(par.seq_len)
    assert windowed / dense == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("graph, constant", [("full", "moe_layer_graphed_s"), ("modules", "moe_layer_module_graph_s")])
def test_cuda_graphs_replace_the_dropless_sync_cost(graph, constant):
    """Each graph mode swaps the eager per-layer constant for its own, on MoE layers only."""
    eff = GB200.efficiency
    assert getattr(eff, constant) > 0 and eff.moe_layer_fixed_s > 0
    base, graphed = _chunk(QWEN, PAR), _chunk(QWEN, replace(PAR, cuda_graph=graph))
    moe_layers = sum(1 for k in QWEN.layer_kinds() if k[1] == "moe")
    drop = (base.fwd["moe_fixed"] + base.bwd["moe_fixed"]) - (graphed.fwd["moe_fixed"] + graphed.bwd["moe_fixed"])
    assert drop == pytest.approx(moe_layers * (eff.moe_layer_fixed_s - getattr(eff, constant)), rel=1e-9)
    dense = load_model("llama3-8b")
    dense_par = replace(PAR, ep=1, etp=0)
    assert _chunk(dense, dense_par).tf == _chunk(dense, replace(dense_par, cuda_graph=graph)).tf


def test_lm_head_is_bf16_in_fp8_runs():
    t = 4 * 4096.0
    bf16 = replace(PAR, precision="bf16")
    assert _head_seconds(QWEN, GB200, PAR, t, 1.0) == _head_seconds(QWEN, GB200, bf16, t, 1.0)


def _tokens(tmp_path, extra: list[str]) -> float:
    out = tmp_path / "r.json"
    args = ["--model", "qwen3-30b-a3b", "--hardware", "gb200", "--gpus", "8", "--ep", "8", "--etp", "1"]
    args += ["--micro-batch", "4", "--precision", "fp8", "--dispatcher", "deepep", "--recompute", "none"]
    assert main(["simulate", "run", *args, *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())["tokens_per_s_per_gpu"]


def test_cli_flags_reach_the_model(tmp_path):
    base = _tokens(tmp_path, [])
    assert _tokens(tmp_path, ["--fp8-attention"]) > base
    graphed = _tokens(tmp_path, ["--cuda-graph", "full"])
    assert (graphed > base) == (GB200.efficiency.moe_layer_graphed_s < GB200.efficiency.moe_layer_fixed_s)
    modules = _tokens(tmp_path, ["--cuda-graph", "modules"])
    assert (modules > base) == (GB200.efficiency.moe_layer_module_graph_s < GB200.efficiency.moe_layer_fixed_s)
    assert _tokens(tmp_path, ["--cuda-graph", "full", "--fp8-attention"]) > graphed


def test_bad_cuda_graph_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["simulate", "run", "--model", "qwen3-30b-a3b", "--gpus", "8", "--cuda-graph", "layers"])
    assert info.value.code == 2 and "--cuda-graph" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cuda_graph"):
        ParallelConfig(cuda_graph="partial")


def test_fp8_attention_needs_fp8_tensor_cores(capsys):
    args = ["simulate", "run", "--model", "llama3-8b", "--hardware", "a100", "--gpus", "8", "--fp8-attention"]
    assert main(args) == 2
    assert "no FP8 tensor cores (--fp8-attention)" in capsys.readouterr().err


def _best(tmp_path, extra: list[str]) -> dict:
    out = tmp_path / "s.json"
    args = ["simulate", "search", "--model", "qwen3-30b-a3b", "--hardware", "gb200", "--gpus", "8"]
    args += ["--precision", "fp8", "--schedules", "1f1b", "--recompute-modes", "selective", "--micro-batches", "4"]
    assert main([*args, *extra, "--event-top", "0", "--json", str(out)]) == 0
    return json.loads(out.read_text())["results"][0]


def test_search_takes_the_speed_knobs(tmp_path):
    """`search` ranks layouts under the recipe's graph and attention knobs (each result carries them)."""
    plain, fast = _best(tmp_path, []), _best(tmp_path, ["--cuda-graph", "full", "--fp8-attention"])
    assert fast["parallel"]["cuda_graph"] == "full" and fast["parallel"]["fp8_attention"] is True
    assert plain["parallel"]["cuda_graph"] == "none"
    assert fast["tokens_per_s_per_gpu"] > plain["tokens_per_s_per_gpu"]
