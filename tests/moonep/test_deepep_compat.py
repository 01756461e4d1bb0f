"""moonep.compat.deepep.Buffer (DeepEP V1 normal mode), called as DeepEP's own intranode test and as vLLM /
Megatron call it, on real gloo ranks; the checks are in deepep_battery.py (one launched job per world size, shared
with test_deepep_v2.py)."""

import pytest

from tests.moonep.deepep_battery import job

V1 = ["v1_layout_and_round_trip", "v1_dispatch", "v1_surface"]


@pytest.mark.spawns
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("check", V1)
def test_deepep_v1(world_size, check):
    assert job(world_size)[check] is None, job(world_size)[check]


def test_bad_construction_is_refused():
    from moonep.compat.deepep import Buffer

    with pytest.raises(ValueError, match="normal mode"):
        Buffer(None, low_latency_mode=True)
    with pytest.raises(ValueError, match="Communicator or a torch ProcessGroup"):
        Buffer(object())
