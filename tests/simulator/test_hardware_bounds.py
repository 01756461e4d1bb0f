"""A hardware profile is the user's file: any number in it inside the documented bounds (``MAX_MAGNITUDE``,
``MAX_SMS``, ``MAX_DOMAIN``) prices to a finite step and finite JSON, or is refused on one line naming the field;
outside them it is refused. Before the bounds, ``bf16_tflops`` 1e-300 and ``gemm_half_gflop`` 1e300 were
ZeroDivisionError tracebacks and ``layer_overhead_s`` 1e300 wrote an infinite step time to the JSON."""

from __future__ import annotations

import json
import math
from dataclasses import fields

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep.console import main
from simulator.analytic import simulate
from simulator.field_checks import MAX_MAGNITUDE
from simulator.hardware import MAX_DOMAIN, MAX_SMS, Efficiency, HardwareSpec, load_hardware
from simulator.parallel import ParallelConfig

NUMBERS = [f.name for f in fields(HardwareSpec) if f.type == "float"]
RATES = ("gemm", "grouped_gemm", "attention", "kda", "hbm", "nvlink", "network")
EFFICIENCY = [f.name for f in fields(Efficiency) if f.type == "float" and f.name not in RATES]
EDGES = st.sampled_from([1 / MAX_MAGNITUDE, 1.0, MAX_MAGNITUDE]) | st.floats(1 / MAX_MAGNITUDE, MAX_MAGNITUDE)


@st.composite
def edge_profiles(draw) -> dict:
    """The H100 preset with up to four numbers pushed anywhere inside their bounds, the edges above all."""
    changes: dict = {}
    for name in draw(st.lists(st.sampled_from(NUMBERS + EFFICIENCY + list(RATES)), max_size=4, unique=True)):
        value = draw(EDGES)
        if name in RATES:
            value = min(value, 1.0)
        if name in EFFICIENCY:
            changes.setdefault("efficiency", {})[name] = (
                min(value, 1.0) if name.endswith(("_overlap", "fp8")) else value
            )
        else:
            changes[name] = value
    if draw(st.booleans()):
        changes["sms"] = draw(st.sampled_from([1, MAX_SMS]))
    return {"base": "h100", **changes}


@settings(max_examples=150, deadline=None)
@given(edge_profiles())
def test_a_profile_inside_the_bounds_prices_finite_or_is_refused(profile: dict):
    try:
        hw = load_hardware(profile)
    except ValueError as exc:  # only the relations between fields may still refuse it
        assert "reserved_gib" in str(exc) and "hbm_gib" in str(exc), exc
        return
    res = simulate("llama3-8b", hw, ParallelConfig(tp=8, global_batch_tokens=2**20), gpus=8)
    if not res.feasible:
        assert res.reason, res
        return
    assert math.isfinite(res.step_time_s) and res.step_time_s > 0, (profile, res.step_time_s)
    json.dumps(res.to_dict(), allow_nan=False)  # raises on NaN or infinity anywhere in the report


@pytest.mark.parametrize(
    "content,named",
    [
        ({"bf16_tflops": 1e-300}, "HardwareSpec.bf16_tflops"),
        ({"hbm_tbps": 1e300}, "HardwareSpec.hbm_tbps"),
        ({"efficiency": {"gemm_half_gflop": 1e300}}, "Efficiency.gemm_half_gflop"),
        ({"efficiency": {"layer_overhead_s": 1e300}}, "Efficiency.layer_overhead_s"),
        ({"efficiency": {"gemm": 1e-300}}, "Efficiency.gemm"),
        ({"sms": 10**20}, f"HardwareSpec.sms must be an integer in [1, {MAX_SMS}]"),
        ({"gpus_per_node": 10**20}, f"HardwareSpec.gpus_per_node must be an integer in [1, {MAX_DOMAIN}]"),
        ({"reserved_gib": 1e6}, "HardwareSpec.reserved_gib 1e+06 must be below hbm_gib 79.6"),
    ],
)
def test_a_profile_past_the_bounds_is_one_line_naming_the_field(tmp_path, capsys, content, named):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"base": "h100", **content}))
    assert main(["simulate", "run", "--gpus", "8", "--model", "llama3-8b", "--hardware", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and named in err and "\n" not in err, err
