"""The MoE fit (simulator/moe_fit.py) is held out from the validation table: it uses only 25.11 calibration rows
chosen by rules that never look at a validation error, it never prices a validation recipe, the shipped presets
are what it returns, and it recovers a planted constant."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator import moe_fit
from simulator.hardware import BLACKWELL_EFFICIENCY, HOPPER_EFFICIENCY
from simulator.published import MOE_ROWS, ROWS
from simulator.validation import published_config

USED = {s: moe_fit.calibration_rows(s)[0] for s in ("h100", "b200")}


def test_split_is_explicit_and_disjoint():
    held_out = {moe_fit.recipe_key(r) for r in ROWS}
    for system, used in USED.items():
        assert used, f"no calibration row for {system}"
        assert all(moe_fit.recipe_key(r) not in held_out and r.system == system for r in used)
    assert all("25.11 NeMo Container" in r.source for r in moe_fit.CANDIDATES)
    assert not any("25.11" in r.source for r in MOE_ROWS)  # validation MoE rows: other releases' tables
    left = [w for s in USED for _, w in moe_fit.calibration_rows(s)[1]]
    assert any("same recipe" in w for w in left)  # the duplicate rule is exercised, not dead code


def test_fit_never_prices_a_validation_row(monkeypatch):
    seen = []
    real = moe_fit.simulate

    def spy(model, hw, par, gpus, **kw):
        seen.append((model, gpus, par))
        return real(model, hw, par, gpus, **kw)

    monkeypatch.setattr(moe_fit, "simulate", spy)
    moe_fit.fitted_presets()
    assert len(seen) > 20
    for r in ROWS:  # not even on another system: no validation model, size and recipe is priced by the fit
        assert (r.model, r.gpus, published_config(r)) not in seen


def test_fit_ignores_the_validation_numbers(monkeypatch):
    before = moe_fit.fitted_presets()
    doubled = tuple(dataclasses.replace(r, tokens_per_s_per_gpu=2 * r.tokens_per_s_per_gpu) for r in ROWS)
    monkeypatch.setattr(moe_fit, "ROWS", doubled)
    assert moe_fit.fitted_presets() == before


def test_presets_are_the_fit():
    fit = moe_fit.fitted_presets()
    assert HOPPER_EFFICIENCY.moe_copy_ns == pytest.approx(fit["h100"], abs=1.0)
    assert BLACKWELL_EFFICIENCY.moe_copy_ns == pytest.approx(fit["b200"], abs=1.0)
    assert HOPPER_EFFICIENCY.moe_layer_fixed_s == 0 and BLACKWELL_EFFICIENCY.moe_layer_fixed_s == 0


@settings(max_examples=6, deadline=None)
@given(planted=st.floats(0.0, 1500.0), system=st.sampled_from(["h100", "b200"]))
def test_fit_recovers_a_planted_constant(planted, system):
    rows = []
    for r in USED[system]:
        res = moe_fit.simulate(r.model, moe_fit.with_copy_ns(system, planted), published_config(r), r.gpus)
        rows.append(dataclasses.replace(r, tokens_per_s_per_gpu=res.tokens_per_s_per_gpu))
    assert moe_fit.fit_copy_ns(rows) == pytest.approx(planted, abs=0.5)


def test_fit_refuses_bad_row_sets():
    with pytest.raises(ValueError, match="exactly one system"):
        moe_fit.fit_copy_ns([])
    with pytest.raises(ValueError, match="exactly one system"):
        moe_fit.fit_copy_ns(USED["h100"] + USED["b200"])


def test_calibration_table_reports_every_candidate():
    table = moe_fit.calibration_table()
    assert len(table) == len(moe_fit.CANDIDATES)
    for r in table:
        assert r["used"] != bool(r["why_not"])
        if r["used"]:
            assert abs(r["error"]) < 0.01  # one row per system and one constant: the fit meets it
