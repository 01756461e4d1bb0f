"""What-if: the healthy cluster is the baseline, slower parts never speed things up, input errors explained."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.parallel import ParallelConfig
from simulator.whatif import whatif

DENSE = ParallelConfig(tp=8, pp=4, dp=2, seq_len=2048, global_batch_tokens=64 * 2048, recompute="selective")
MOE = ParallelConfig(pp=4, ep=16, dp=16, seq_len=4096, global_batch_tokens=4096 * 256, recompute="full")


def test_no_perturbation_is_baseline():
    out = whatif("gpt-175b", "h100", DENSE, 64)
    assert out["step_s"] == pytest.approx(out["baseline_step_s"]) and out["slowdown"] == pytest.approx(1.0)


@settings(max_examples=15, deadline=None)
@given(rank=st.integers(0, 63), f1=st.floats(1.0, 2.0), f2=st.floats(1.0, 2.0))
def test_monotone_in_compute_slowdown(rank, f1, f2):
    lo, hi = sorted((f1, f2))
    a = whatif("kimi-k2", "h100", MOE, 64, rank_slowdown={rank: lo}, attribute=False)["step_s"]
    b = whatif("kimi-k2", "h100", MOE, 64, rank_slowdown={rank: hi}, attribute=False)["step_s"]
    assert b >= a * (1 - 1e-12) and a >= whatif("kimi-k2", "h100", MOE, 64)["baseline_step_s"] * (1 - 1e-12)


def test_slow_gpu_slows_its_pipeline_and_is_attributed():
    out = whatif(
        "gpt-175b",
        "h100",
        DENSE,
        64,
        rank_slowdown={3: 1.5, 40: 1.1},
        links=[{"rank": 9, "tier": "nvlink", "factor": 0.5}],
    )
    assert out["slowdown"] > 1.1
    assert out["attribution"][0]["rank"] == 3  # the biggest single cause first


def test_degraded_nic_slows_moe_all_to_all():
    out = whatif("kimi-k2", "h100", MOE, 64, links=[{"rank": 17, "tier": "nic", "factor": 0.25}])
    assert out["slowdown"] > 1.01


def test_bad_rank_is_explained():
    out = whatif("gpt-175b", "h100", DENSE, 64, rank_slowdown={999: 2.0})
    assert out["feasible"] is False and "rank" in out["reason"]
    out = whatif("gpt-175b", "h100", replace(DENSE, dp=3), 64)
    assert out["feasible"] is False and "GPUs" in out["reason"]
