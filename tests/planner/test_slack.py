"""Bounded-slack and cost-aware plans (planner.slack): the row bound, the proof's claims, the twin, the σ=0 identity,
the cost choice, bad input. The device kernel's twin of the slack pass is in test_device_slack.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import CostModel, plan, row_bound, verify
from planner.reference import plan_reference, slack_reference
from planner.slack import SLACK_DEN, _slack_target, slack_caps
from tests.planner.loads import Case, Topo, cases

FIELDS = ("caps", "alloc", "donor", "experts_to_copy", "cu_seqlens", "send_counts", "flows")
SLACKS = st.one_of(st.sampled_from([0.0, 1e-9, 0.01, 0.1, 0.25, 1.0, 64.0]), st.floats(0, 3))


def groups(T: np.ndarray) -> np.ndarray:
    R, E = T.shape
    return T.sum(0).reshape(R, E // R).sum(1)


def own_rows(p) -> np.ndarray:
    """[R] rows each rank computes of its own experts."""
    E, R = p.alloc.shape
    return p.alloc[np.arange(E), np.arange(E) // (E // R)].reshape(R, E // R).sum(1)


def pass_tables(T, slack: float, prev_donor=None):
    """(ok, caps, hint) of the CPU slack pass for a fixed slack."""
    R = T.shape[0]
    caps, hint, room = (np.zeros(R, np.int64) for _ in range(3))
    sticky = prev_donor is not None
    donor_in = np.asarray(prev_donor, np.int64) if sticky else np.full(R, -1, np.int64)
    num = math.floor(slack * SLACK_DEN)
    ok = slack_caps(np.ascontiguousarray(groups(T), np.int64), num, 1, 2, donor_in, sticky, caps, hint, room)
    return ok, caps, hint


@settings(max_examples=200, deadline=None)
@given(cases(max_R=10, max_scale=120), SLACKS, st.booleans(), st.data())
def test_slack_plan_keeps_the_bound_and_every_guarantee(case: Case, slack: float, sticky: bool, data):
    """Any load, any σ (sticky or not, padded, extra slots): rows <= ceil((1+σ) total / R), one donor per
    receiver, <= epn replicas, the routing bijection (verify); a successful pass gives replicas only to receivers
    and leaves every rank with load <= U its own rows."""
    T = case.counts()
    R, E = T.shape
    slots = data.draw(st.sampled_from([None, case.epn + 1]))
    prev = plan(np.random.default_rng(case.seed).integers(0, 30, (R, E)), slots_per_rank=slots) if sticky else None
    p = plan(T, slack=slack, previous=prev, token_padding=case.token_padding, slots_per_rank=slots)
    verify(p, T, slack=slack)
    U, g = row_bound(int(T.sum()), R, slack), groups(T)
    ok, caps, hint = pass_tables(T, slack, None if prev is None else prev.donor)
    if math.floor(slack * SLACK_DEN) == 0:  # σ rounds to 0: the exact plan
        assert np.array_equal(p.alloc, plan(T, previous=prev, slots_per_rank=slots).alloc)
    elif ok:
        assert np.array_equal(p.caps, caps) and np.array_equal(p.donor, hint)
        keeps = (g <= U) & (hint < 0)
        assert np.array_equal(own_rows(p)[keeps], g[keeps])  # no rank below the bound gives rows away
        assert np.array_equal(p.caps[g > U], np.full(int((g > U).sum()), U))
        if g.max(initial=0) <= U:
            assert p.num_replicas == 0
    else:  # fragmented rooms: the exact plan, which is inside the bound too
        assert np.array_equal(p.caps, plan(T, previous=prev, slots_per_rank=slots).caps)


@settings(max_examples=150, deadline=None)
@given(cases(max_R=10, max_scale=80), st.integers(0, 3), st.data())
def test_slack_zero_is_the_exact_plan_bit_for_bit(case: Case, variant: int, data):
    T = case.counts()
    R, E = T.shape
    kwargs: dict = {"token_padding": case.token_padding}
    if variant & 1:
        kwargs["previous"] = plan(np.random.default_rng(case.seed).integers(0, 30, (R, E)))
    if variant & 2:
        rpn = data.draw(st.sampled_from([d for d in range(1, R + 1) if R % d == 0]))
        kwargs["topology"] = Topo(R // rpn, rpn, 20)
    p, q = plan(T, slack=0.0, **kwargs), plan(T, **kwargs)
    for name in FIELDS:
        assert np.array_equal(getattr(p, name), getattr(q, name)), name


@settings(max_examples=200, deadline=None)
@given(cases(max_R=10, max_scale=120), SLACKS, st.booleans(), st.integers(2, 9), st.data())
def test_slack_pass_equals_twin(case: Case, slack: float, sticky: bool, n: int, data):
    """The compiled pass and the list twin agree on caps and pairs for every candidate U; the whole plan equals
    the reference planner run with those caps and pairs."""
    T = case.counts()
    R = T.shape[0]
    prev = np.random.default_rng(case.seed).integers(-1, R, R) if sticky else None
    k = data.draw(st.integers(1, n - 1))
    num = math.floor(slack * SLACK_DEN)
    g = np.ascontiguousarray(groups(T), np.int64)
    caps, hint, room = (np.zeros(R, np.int64) for _ in range(3))
    donor_in = prev if sticky else np.full(R, -1, np.int64)
    ok = slack_caps(g, num, k, n, donor_in, sticky, caps, hint, room)
    want = slack_reference(T, int(_slack_target(g, num, k, n)), prev)
    assert bool(ok) == (want is not None)
    if want is not None:
        assert caps.tolist() == want[0] and hint.tolist() == want[1]
        p = plan(T, slack=slack) if (k, n) == (1, 2) and not sticky and num > 0 else None
        if p is not None:
            ref = plan_reference(T, caps, None, 1, prev_donor=hint, prev_copy=np.full((R, T.shape[1] // R), -1))
            for name, got in zip(FIELDS, ref):
                assert np.array_equal(getattr(p, name), got), name


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 500), min_size=1, max_size=12), st.integers(0, 400), st.floats(0, 2))
def test_one_donor_takes_the_fewest_receivers(loads: list[int], extra: int, slack: float):
    """With one rank over the bound, its excess goes to the fewest receivers any one-donor plan could use."""
    loads[0] += extra
    R = len(loads)
    T = np.diag(loads).astype(np.int64)  # rank r routes only to its own first expert: group loads = loads
    U = row_bound(sum(loads), R, slack)
    if sum(v > U for v in loads) != 1 or loads[0] <= U:
        return
    ok, caps, hint = pass_tables(T, slack)
    rooms = sorted((U - v for v in loads[1:] if v < U), reverse=True)
    fewest = next(k for k in range(1, len(rooms) + 1) if sum(rooms[:k]) >= loads[0] - U)
    assert ok and int((hint >= 0).sum()) == fewest


@settings(max_examples=80, deadline=None)
@given(cases(max_R=8, max_scale=120), st.floats(0, 1), st.floats(0, 1))
def test_cost_choice_is_never_worse_than_exact(case: Case, row_s: float, copy_s: float):
    T = case.counts()
    cost = CostModel(row_seconds=row_s, copy_seconds=copy_s, max_slack=0.5, candidates=5)
    p, exact = plan(T, cost=cost), plan(T)
    verify(p, T, slack=0.5)

    def secs(q):
        return float(cost.rank_seconds(q.cu_seqlens[:, -1], q.donor, q.experts_to_copy).max())

    assert secs(p) <= secs(exact)
    tp = plan(torch.tensor(T), cost=cost).to_plan()  # tensor path: chosen on the device, same plan
    for name in FIELDS:
        assert np.array_equal(getattr(p, name), getattr(tp, name)), name


def test_cost_extremes():
    """Free copies keep the exact plan; free rows drop every replica the slack ceiling allows."""
    T = np.array([[300, 10, 10, 10], [200, 10, 10, 10]])
    assert np.array_equal(plan(T, cost=CostModel(row_seconds=1, copy_seconds=0)).alloc, plan(T).alloc)
    p = plan(T, cost=CostModel(row_seconds=0, copy_seconds=1, max_slack=1.0))
    assert p.num_replicas == 0 and plan(T).num_replicas > 0
    few = plan(T, cost=CostModel(row_seconds=0, copy_seconds=1, max_slack=0.1))  # the ceiling binds
    assert few.caps.max() <= row_bound(T.sum(), 2, 0.1) and few.num_replicas > 0


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"slack": -0.1}, "slack must be in"),
        ({"slack": float("nan")}, "slack must be a finite"),
        ({"slack": True}, "slack must be a finite"),
        ({"slack": 65.0}, "slack must be in"),
        ({"slack": 0.1, "caps": [4, 4]}, "cannot be combined"),
        ({"slack": 0.1, "cost": CostModel(row_seconds=1, copy_seconds=1)}, "not both"),
        ({"cost": "fast"}, "cost must be a planner.CostModel"),
    ],
)
def test_bad_slack_options_are_named(kwargs, words):
    for counts in (np.array([[4, 2], [1, 1]]), torch.tensor([[4, 2], [1, 1]])):
        with pytest.raises(ValueError, match=words):
            plan(counts, **kwargs)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"row_seconds": -1, "copy_seconds": 1}, "row_seconds"),
        ({"row_seconds": 1, "copy_seconds": float("inf")}, "copy_seconds"),
        ({"row_seconds": 1, "copy_seconds": 1, "max_slack": -1}, "max_slack"),
        ({"row_seconds": 1, "copy_seconds": 1, "candidates": 1}, "candidates"),
    ],
)
def test_bad_cost_models_are_named(kwargs, words):
    with pytest.raises(ValueError, match=words):
        CostModel(**kwargs)


def test_cost_model_from_shape_prices_a_gated_mlp():
    c = CostModel.from_shape(H=256, F=512, weight_bytes=2, flops=1e12, bandwidth=1e10)
    assert c.row_seconds == pytest.approx(18 * 256 * 512 / 1e12)
    assert c.copy_seconds == pytest.approx(3 * 256 * 512 * 6 / 1e10)
