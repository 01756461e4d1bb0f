"""The slack pass and the cost choice on the device give the CPU's plans field by field.

Without a GPU the slack kernel runs under numba's CUDA simulator (tests/conftest.py) with a few threads a block;
``make gpu-check`` runs it on the device. The PTX test compiles the kernel (and the slack functions it re-binds
as device functions) with numba-cuda's real compiler for sm_90, so simulator-only code fails here too.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import CostModel, plan
from tests.planner.loads import FAMILIES, Case, cases, make_counts
from tests.planner.test_device_plan import assert_same_plan, compile_ptx, device_plan

pytestmark = pytest.mark.gpu  # on CPU under numba's CUDA simulator; on the GPU under make gpu-check


@settings(max_examples=30, deadline=None)
@given(cases(max_R=6, max_epn=3, max_scale=80), st.sampled_from([0.01, 0.1, 0.5, 2.0]), st.sampled_from([1, 3, 4]))
def test_device_slack_plan_equals_cpu(case: Case, slack: float, threads: int):
    T = case.counts()
    pad = case.token_padding
    assert_same_plan(plan(T, slack=slack, token_padding=pad), device_plan(T, threads, slack=slack, token_padding=pad))


@settings(max_examples=12, deadline=None)
@given(cases(max_R=5, max_epn=3, max_scale=60), st.integers(0, 2**31 - 1), st.floats(0, 1), st.floats(0, 1))
def test_device_cost_plan_equals_cpu(case: Case, seed: int, row_s: float, copy_s: float):
    """The cost choice (several candidates, picked on the device) and its sticky variant."""
    T = case.counts()
    cost = CostModel(row_seconds=row_s, copy_seconds=copy_s, max_slack=1.0, candidates=4)
    prev = plan(make_counts(FAMILIES[seed % len(FAMILIES)], case.R, case.epn, case.scale, seed))
    assert_same_plan(plan(T, cost=cost), device_plan(T, cost=cost))
    assert_same_plan(plan(T, cost=cost, previous=prev), device_plan(T, cost=cost, previous=prev))


def test_device_slack_at_a_larger_shape():
    for family in ("zipf", "one_rank_hot", "varlen"):
        T = make_counts(family, 16, 4, 300, 1)
        assert_same_plan(plan(T, slack=0.1, token_padding=8), device_plan(T, slack=0.1, token_padding=8))


@pytest.mark.spawns
def test_slack_kernel_compiles_to_ptx():
    sig = "a2, i, i, i, a1, nt.boolean, a1, a1, a1, a1, a1"
    assert compile_ptx("planner._device_slack", "slack_kernel", sig, "'bar.sync' in ptx") == ["True"]
