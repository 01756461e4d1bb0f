"""The MoE fixed-cost measurement (``simulator.calibrate_moe``): runs on any device, and its terms reach the
profile ``calibrate`` writes. ``calibrate`` itself measures them on a GPU only (none in ``make test``)."""

import math

import pytest

from simulator.calibrate import moe_terms
from simulator.calibrate_moe import measure_moe_fixed
from simulator.hardware import load_hardware


def test_measurement_is_a_line_through_two_sizes():
    m = measure_moe_fixed(256, 32, 8, 2, 3, "cpu", 0.05)
    assert m["tokens"] == [64, 256] and all(s > 0 for s in m["seconds"])
    assert all(math.isfinite(m[k]) and m[k] >= 0 for k in ("moe_copy_ns", "moe_layer_fixed_s", "measured_copy_ns"))
    assert m["moe_copy_ns"] == pytest.approx(max(0.0, m["measured_copy_ns"] - m["modelled_copy_ns"]))


@pytest.mark.parametrize("kw", [{"tokens": 4}, {"top_k": 9}, {"hbm_tbps": 0.0}])
def test_bad_sizes_raise(kw):
    args = {"tokens": 64, "hidden": 8, "experts": 8, "top_k": 2, "repeats": 1, "device": "cpu", "hbm_tbps": 1.0} | kw
    with pytest.raises(ValueError, match="measure_moe_fixed"):
        measure_moe_fixed(**args)


def test_terms_reach_the_profile():
    # profile_from puts moe_terms(measured) into the profile's efficiency block (it needs a GPU or a host block)
    terms = moe_terms({"moe": {"moe_copy_ns": 123.0, "moe_layer_fixed_s": 0.004, "seconds": [1.0, 2.0]}})
    assert terms == {"moe_copy_ns": 123.0, "moe_layer_fixed_s": 0.004} and moe_terms({}) == {}
    eff = load_hardware({"base": "h100", "efficiency": terms}).efficiency
    assert eff.moe_copy_ns == 123.0 and eff.moe_layer_fixed_s == 0.004
