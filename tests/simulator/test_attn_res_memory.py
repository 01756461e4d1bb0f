"""K3's Block AttnRes in the memory model (issue 27): the simulator's AttnRes term is what moonep's K3 code keeps
(measured under saved_tensors_hooks by `moonep bench k3-memory`), a K3 plan's activation memory changes by exactly
that term, the released implementation's fp32 stacks are priced on request, and the README's K3 vs DeepSeek-V3
budget table is the code's output."""

from dataclasses import replace
from pathlib import Path

import pytest

from k3.saved_memory import run_memory_bench
from simulator.hardware import load_hardware
from simulator.layers import attn_res_bytes, attn_res_sources
from simulator.memory import rank_memory
from simulator.parallel import ParallelConfig
from simulator.saved_bytes import activation_budget, format_budget, simulated
from simulator.specs import load_model

K3 = load_model("k3")


def test_sources_follow_the_block_schedule():
    """Released K3: 93 layers in blocks of 12 -> 185 mixes, 2 sources at the first, 9 at the output side."""
    sources = attn_res_sources(K3)
    assert len(sources) == 2 * K3.num_layers - 1
    assert sources[0] == 2 and sources[-1] == 9 and sources == sorted(sources)


def test_the_term_is_what_the_k3_code_keeps():
    """The bench measures the real k3 modules at two small widths and extrapolates to K3's (its --quick sizes)."""
    bench = run_memory_bench(widths=(1, 2), seq_lens=(40,))
    measured = bench["k3"][0]["attn_res"]
    assert simulated(K3)["attn_res"] == pytest.approx(measured, rel=0.05)


def test_release_stacks_match_the_issue_figures():
    """Two fp32 stacks of n sources per mix: 0.57 MB per token per layer with 5 sources, 1.03 MB with 9."""
    h = K3.hidden
    assert 2 * (2 * 5 * h * 4) == pytest.approx(0.57e6, rel=0.01)
    assert 2 * (2 * 9 * h * 4) == pytest.approx(1.03e6, rel=0.01)
    ours, stacked = attn_res_bytes(K3)
    assert 2 * 2 * 2 * h * 4 < stacked < 2 * 2 * 9 * h * 4 and ours < stacked / 10


@pytest.mark.parametrize("impl", ["moonep", "release"])
def test_a_k3_plan_changes_by_the_attn_res_term(impl):
    hw = load_hardware("h200")
    par = ParallelConfig(
        pp=4, ep=8, dp=8, seq_len=4096, global_batch_tokens=64 * 4096, recompute="selective", attn_res_impl=impl
    )
    with_mixes = rank_memory(K3, hw, par, 0)["activations"]
    without = rank_memory(replace(K3, attn_res=False), hw, par, 0)["activations"]
    per_layer = attn_res_bytes(K3)[1 if impl == "release" else 0]
    layers = -(-K3.num_layers // par.pp)  # rank 0's layers (near-even split)
    in_flight = min(par.micro_batches, par.pp)  # 1F1B rank 0
    tokens = par.micro_batch * par.seq_len
    expected = in_flight * layers * tokens * per_layer
    assert with_mixes - without == pytest.approx(expected, rel=0.05)


def test_readme_budget_table_is_the_code_output():
    rows = activation_budget(load_model("k3")) + activation_budget(load_model("deepseek-v3"))
    readme = (Path(__file__).parents[2] / "simulator" / "README.md").read_text()
    assert format_budget(rows) in readme
    k3_layers = [r for r in rows if r["model"] == "k3"]
    assert all(r["AttnRes mixes"] > 0 for r in k3_layers)
