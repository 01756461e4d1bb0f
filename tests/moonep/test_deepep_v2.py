"""moonep.compat.deepep_v2.ElasticBuffer (DeepEP V2), checked as DeepEP's tests/elastic/test_ep.py checks its own
buffer (bitwise against a reference built from all-gathered inputs) and called as torchtitan's DeepEP path calls
it, on real gloo ranks; the checks are in deepep_v2_checks.py, run by deepep_battery's job."""

import pytest

from tests.moonep.deepep_battery import job
from tests.moonep.deepep_v2_checks import CHECKS


@pytest.mark.spawns
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_deepep_v2(world_size, check):
    assert job(world_size)[check] is None, job(world_size)[check]


def test_v2_names_are_reachable_as_in_deep_ep_2():
    from moonep.compat import deepep, deepep_v2

    assert deepep.ElasticBuffer is deepep_v2.ElasticBuffer and deepep.EPHandle is deepep_v2.EPHandle
    assert deepep.ElasticBuffer.get_buffer_size_hint(None, 8, 16) == 0
