"""Memory per GPU: the Korthikanti et al. Fig. 1 numbers, monotonicity, ZeRO sharding, K3 inference memory."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.hardware import load_hardware
from simulator.memory import GIB, inference_memory, peak_memory, rank_memory
from simulator.parallel import ParallelConfig
from simulator.specs import load_model
from simulator.validation import RUNS, config, memory_table

FAST = settings(max_examples=25, deadline=None)


def test_activation_memory_matches_paper():
    """Fig. 1 activations (no recompute without SP; selective + SP), all four models, within 5%."""
    for row in memory_table():
        assert abs(row["error"]) < 0.05, row


def test_params_and_optimizer_match_paper():
    """18 bytes/param on the most loaded rank, within 12% of Fig. 1 (the paper counts embeddings per stage)."""
    hw = load_hardware("a100")
    for run in RUNS:
        mem = rank_memory(load_model(run.model), hw, config(run, "selective"), 0)
        got = (mem["params"] + mem["grads"] + mem["optimizer"]) / GIB
        assert abs(got / run.params_optimizer_gib - 1) < 0.12, (run.model, got)


K3_PAR = ParallelConfig(pp=16, ep=64, dp=256, seq_len=8192, global_batch_tokens=64 * 2**20, recompute="full")


@FAST
@given(
    mb=st.sampled_from([1, 2, 4]),
    rc=st.sampled_from(["none", "selective", "selective+act", "full"]),
    sched=st.sampled_from(["1f1b", "dualpipe"]),
)
def test_memory_monotone_in_micro_batch(mb, rc, sched):
    """Doubling the micro-batch never lowers peak memory (catches an in-flight count that shrinks wrongly)."""
    spec, hw = load_model("k3"), load_hardware("h200")
    a = replace(K3_PAR, micro_batch=mb, recompute=rc, schedule=sched)
    b = replace(a, micro_batch=2 * mb)
    assert sum(peak_memory(spec, hw, b)[1].values()) >= sum(peak_memory(spec, hw, a)[1].values())


@FAST
@given(model=st.sampled_from(["k3", "deepseek-v3", "llama3-405b"]), tp=st.sampled_from([1, 2, 8]))
def test_recompute_order(model, tp):
    """Activations: none >= selective >= selective+act >= full."""
    spec, hw = load_model(model), load_hardware("h200")
    base = ParallelConfig(tp=tp, pp=8, dp=4, seq_len=4096, global_batch_tokens=4096 * 64)
    acts = [
        rank_memory(spec, hw, replace(base, recompute=r), 0)["activations"]
        for r in ("none", "selective", "selective+act", "full")
    ]
    assert acts == sorted(acts, reverse=True)


def test_zero_stages_shard_more():
    spec, hw = load_model("deepseek-v3"), load_hardware("h800")
    base = ParallelConfig(pp=8, ep=32, dp=64, seq_len=4096, global_batch_tokens=4096 * 1024, recompute="full")
    totals = [sum(rank_memory(spec, hw, replace(base, zero_stage=z), 0).values()) for z in (0, 1, 2, 3)]
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[3]


def test_experts_divided_by_ep():
    """The Megatron estimator bug the survey warns about: expert weights must shrink with EP."""
    spec, hw = load_model("k3"), load_hardware("h200")
    from simulator.layers import layer_stats
    from simulator.parallel import stage_layers

    a = rank_memory(spec, hw, replace(K3_PAR, ep=32), 1)["params"]
    b = rank_memory(spec, hw, replace(K3_PAR, ep=64), 1)["params"]
    experts = sum(layer_stats(spec, spec.layer_kinds()[i]).expert_params for i in stage_layers(spec, K3_PAR)[1])
    assert a - b == pytest.approx(experts * 2 * (1 / 32 - 1 / 64))


def test_k3_inference_memory():
    """K3 hybrid: 576 x 24 bf16 values per token of MLA cache; 69 x 96 x 128 x 128 fp32 KDA state."""
    inf = inference_memory(load_model("k3"), batch=1, context=1)
    assert inf["kv_bytes_per_token"] == 576 * 24 * 2
    state = 69 * 96 * 128 * 128 * 4 + 69 * 3 * (3 * 12288) * 2  # fp32 S + bf16 3-tap conv state of q, k, v
    assert inf["kda_state_bytes_per_sequence"] == state
    long = inference_memory(load_model("k3"), batch=2, context=1_000_000)
    assert long["mla_kv"] == pytest.approx(2 * 1e6 * 576 * 48)
    assert long["kda_state"] == pytest.approx(2 * inf["kda_state_bytes_per_sequence"])
