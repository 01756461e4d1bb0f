"""Per-expert totals near 2**31: every planner (CPU kernel, device kernel, reference twin) returns a verified plan
or refuses with an error naming the expert and its total, never hangs (issue 28: a wrapped int32 alloc entry made
stage C spin forever although every count and cap fit)."""

from __future__ import annotations

import faulthandler
import json
import subprocess
import sys
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from planner import plan, verify
from planner._inputs import INT32_MAX, expert_total_message
from planner.reference import plan_reference
from tests.planner.loads import Topo
from tests.planner.test_device_plan import device_plan  # the simulator on CPU; the GPU under NUMBA_ENABLE_CUDASIM=0

NEAR_LIMIT = (0, 1, 2**29, 2**30 - 1, 2**30, 2**30 + 1, 2**31 - 2, INT32_MAX)
"""counts that fit int32 alone but whose sums over 2-4 ranks straddle 2**31."""


@pytest.mark.spawns
def test_cli_refuses_an_expert_total_of_2_31_in_one_line(tmp_path):
    """The issue's exact case: two counts of 2**30 on one expert; one line on stderr, exit 2, no hang."""
    load = tmp_path / "counts.json"
    load.write_text(json.dumps([[2**30, 0], [2**30, 0]]))
    out = subprocess.run(
        [sys.executable, "-m", "moonep.console", "plan", "--load", str(load)],
        capture_output=True,
        text=True,
        timeout=90,  # compiles the kernel if numba's cache is stale (~15 s); the bug spun forever
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [f"moonep plan: {expert_total_message(0, 2**31)}"]
    assert "expert 0 has 2147483648 routed slots" in out.stderr


def expected_error(T: np.ndarray) -> str | None:
    """The refusal the planners owe these counts (all <= INT32_MAX), or None when a plan must come back."""
    cnt = T.sum(0)
    big = np.nonzero(cnt > INT32_MAX)[0]
    if big.size:
        return expert_total_message(int(big[0]), int(cnt[big[0]]))
    if -(-int(T.sum()) // T.shape[0]) > INT32_MAX:  # the largest default cap
        return "counts too large for int32 plan tables"
    return None


def check_outcome(make, T: np.ndarray, want: str | None):
    """``make()`` returns a plan that verifies (want None; returned) or raises ValueError starting with ``want``."""
    if want is None:
        p = make()
        verify(p, T, routes=False)  # routes=False: routing materialises every one of ~2**31 slots
        return p
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value).startswith(want), str(err.value)
    return None


def near_limit_counts(shape: tuple[int, int]) -> st.SearchStrategy[np.ndarray]:
    """[R, R*epn] int64 counts drawn from NEAR_LIMIT for shape (R, epn)."""
    R, epn = shape
    n = R * R * epn
    return st.lists(st.sampled_from(NEAR_LIMIT), min_size=n, max_size=n).map(
        lambda v: np.array(v, np.int64).reshape(R, R * epn)
    )


@contextmanager
def watchdog(seconds: float):
    """Ends the whole process, with every thread's traceback, if the block outlives ``seconds``.

    A spinning numba loop holds the GIL, so pytest-timeout's signal and thread methods never run (a 15-minute
    hang on the old kernel proved it); faulthandler's watchdog is a C thread that needs no GIL."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


FIELDS = ("slots_per_expert", "caps", "alloc", "donor", "experts_to_copy", "send_counts", "cu_seqlens", "flows")


@pytest.mark.timeout(300)  # the suite's; it cannot interrupt a GIL-holding kernel: ``watchdog`` does per example
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # capfd
@given(
    T=st.sampled_from([(1, 2), (2, 1), (2, 2), (3, 1), (4, 1)]).flatmap(near_limit_counts),
    pad=st.sampled_from([1, 8]),
)
@example(T=np.array([[2**30, 0], [2**30, 0]]), pad=1)  # the case: spun forever
@example(T=np.array([[INT32_MAX, 0]]), pad=8)  # a segment padded past 2**31 (the simulator and verify wrapped it)
def test_counts_near_int32_plan_or_refuse_by_name(T, pad, capfd):
    """CPU kernel (plain, topology, CPU tensor), device kernel under the simulator and the reference twin: each
    verifies or refuses with the same named error, and the kernels' plans agree field by field."""
    # an example takes under a second once compiled, a cold compile ~15 s; capture off: the watchdog's traceback
    # must reach the terminal
    with capfd.disabled(), watchdog(120):
        check_planners(T, pad)


def check_planners(T: np.ndarray, pad: int) -> None:
    """The property of ``test_counts_near_int32_plan_or_refuse_by_name`` for one input."""
    want = expected_error(T)
    plans = [
        check_outcome(lambda: plan(T, token_padding=pad), T, want),
        check_outcome(lambda: plan(torch.from_numpy(T), token_padding=pad).to_plan(), T, want),
        check_outcome(lambda: device_plan(T, threads=3, token_padding=pad).to_plan(), T, want),
    ]
    if T.shape[0] == 4:
        check_outcome(lambda: plan(T, token_padding=pad, topology=Topo(2, 2)), T, want)
    for f in FIELDS if want is None else ():
        assert all(np.array_equal(getattr(plans[0], f), getattr(p, f)) for p in plans[1:]), f
    if want is not None and want.startswith("expert"):  # the twin lists every slot: only its refusal is cheap
        with pytest.raises(ValueError) as err:
            plan_reference(T, token_padding=pad)
        assert str(err.value) == want
