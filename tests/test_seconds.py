"""``moonep_base.seconds_problem``: the one rule for a wait a user gives in seconds (collective timeouts, sampling
and polling periods). Every value it accepts must be one the waits it guards can take."""

import datetime
import math
import threading

from hypothesis import given
from hypothesis import strategies as st

from moonep_base import MAX_SECONDS, seconds_problem


@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.booleans(), st.text(max_size=3)))
def test_accepts_exactly_the_waits_a_thread_and_gloo_can_take(value):
    problem = seconds_problem(value)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    assert (problem is None) == (number and 0 < value <= MAX_SECONDS)
    if problem is None:
        assert math.isfinite(value) and value <= threading.TIMEOUT_MAX
        # torch.distributed takes its timeout as a timedelta and gloo counts it in microseconds in an int64
        assert datetime.timedelta(seconds=value).total_seconds() * 1e6 < 2**63
    else:
        assert problem.startswith(f"must be a number of seconds in (0, {MAX_SECONDS}] (a year), got ")
