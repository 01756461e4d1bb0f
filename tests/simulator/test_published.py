"""The published runs (simulator/published.py, simulator/calibration_runs.py) and the five constants fitted to them
(simulator/software_fit.py): every row cited and feasible with the memory techniques its source states, no
family biased one way, the errors no worse than the README reports, `moonep simulate run` reproducing every
row, and the shipped constants being the fit's optimum.

The issue's acceptance (MoE and dense MAE <= 8%, every row within 15%) is NOT met by the MoE family (the README's
"Validation" section gives the table and why); the bounds below are the model as it stands, so a change that
makes it worse fails here."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from moonep.console import main
from simulator import software_fit
from simulator.calibration_runs import ROWS as CALIBRATION
from simulator.published import DENSE_ROWS, MOE_ROWS, ROWS
from simulator.validation import (
    BAND,
    KNOWN_MISSES,
    cli_args,
    format_published,
    published_model,
    published_table,
    row_key,
)

TABLE = published_table()
TRACKED = [r for r in TABLE if row_key(r) not in KNOWN_MISSES]


def _family(kind: str) -> list[float]:
    return [r["predicted"] / r["published"] for r in TRACKED if r["kind"] == kind]


def test_enough_rows_with_sources():
    assert len(MOE_ROWS) >= 12 and len(DENSE_ROWS) >= 8
    for r in ROWS + CALIBRATION:
        assert r.source.startswith(("DGX-", "Parmar et al.")) and ("https://" in r.source or "arXiv" in r.source)


def test_one_row_per_model_system_precision():
    """The selection rule for the Megatron-Bridge tables: the newest row of each (model, system, precision), plus
    the named extra rows (the papers give one row per data-parallel size)."""
    seen = {}
    for r in (r for r in ROWS if "NeMo" in r.source):
        key = (r.model, r.system, r.precision)
        assert key not in seen or row_key(r) in KNOWN_MISSES or row_key(seen[key]) in KNOWN_MISSES, key
        seen[key] = r


@pytest.mark.parametrize("row", TABLE, ids=lambda r: f"{r['model']}-{r['system']}-{r['gpus']}-pp{r['pp']}")
def test_every_recipe_that_ran_fits_in_memory(row):
    assert row["feasible"], row["reason"]


def test_no_family_is_biased_one_way():
    """The issue's finding was one sign per family (MoE 0.80, dense 1.11); the mean ratio now straddles 1."""
    for kind, (lo, hi) in (("moe", (0.93, 1.10)), ("dense", (0.95, 1.05))):
        ratios = _family(kind)
        assert lo <= sum(ratios) / len(ratios) <= hi, (kind, format_published(TABLE))
        assert min(ratios) < 1 < max(ratios), kind


def test_errors_no_worse_than_reported():
    """Regression guard at the README's numbers (dense meets the issue's 8%; MoE does not, see the README)."""
    for kind, mae_cap, inside_min in (("moe", 0.091, 12), ("dense", 0.05, 11)):
        errors = [abs(x - 1) for x in _family(kind)]
        assert sum(errors) / len(errors) <= mae_cap, (kind, format_published(TABLE))
        assert sum(e <= BAND for e in errors) >= inside_min, (kind, format_published(TABLE))


def test_the_documented_miss_is_still_a_miss():
    """Issue 18's row stays as published; if the model ever lands it inside the band, drop it from KNOWN_MISSES."""
    missed = [r for r in TABLE if row_key(r) in KNOWN_MISSES]
    assert len(missed) == len(KNOWN_MISSES) == 1
    assert all(abs(r["error"]) > BAND for r in missed)


def test_both_flop_conventions_reported():
    for r in TABLE:
        assert 0 < r["tflops_causal"] < r["tflops_full_square"]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r.model}-{r.system}-{r.gpus}-pp{r.pp}")
def test_cli_reproduces_recipe(tmp_path, row):
    out = tmp_path / "r.json"
    assert main(["simulate", "run", *cli_args(row), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    mine = next(r for r in TABLE if row_key(r) == row_key(row) and r["precision"] == row.precision)
    assert data["feasible"] and data["tokens_per_s_per_gpu"] == pytest.approx(mine["predicted"], rel=1e-9)
    assert set(data["flops"]) == {"full_square", "causal"} and "overlapped_fraction" in data["ep_overlap"]


def test_event_engine_agrees_on_published_rows():
    event = published_table(engine="event")
    for a, e in zip(TABLE, event):
        assert e["feasible"] and abs(e["predicted"] / a["predicted"] - 1) <= 0.03, (a, e)


def test_shipped_constants_are_the_fit():
    """Each shipped constant is a minimum of the fit's loss along its own axis (a step either way is worse), so
    the presets are what `python -m simulator.software_fit` returns, to its tolerance."""
    rows = software_fit.fit_rows()
    shipped = software_fit.shipped()
    base = software_fit.loss(rows, shipped)
    for key in shipped:
        step = 0.02 if key.startswith("sustained") else 0.0003
        for sign in (-1, 1):
            moved = {**shipped, key: shipped[key] + sign * step}
            assert software_fit.loss(rows, moved) > base, (key, sign)


PLANTED = {
    "sustained_hopper": 0.7,
    "sustained_blackwell": 0.8,
    "moe_layer_fixed_s": 0.001,
    "moe_layer_graphed_s": 0.002,
    "moe_layer_module_graph_s": 0.0035,
}
START = {
    "sustained_hopper": 0.9,
    "sustained_blackwell": 0.9,
    "moe_layer_fixed_s": 0.003,
    "moe_layer_graphed_s": 0.004,
    "moe_layer_module_graph_s": 0.001,
}


def _planted_rows(slower: str = "", factor: float = 1.0) -> tuple:
    """Rows whose published numbers are the simulator's own at ``PLANTED`` (the rows of each CUDA-graph mode pin its
    constant), those of model ``slower`` made ``factor`` x slower than that."""
    rows = software_fit.fit_rows()
    moe = tuple(r for r in rows if r.is_moe and (r.system == "h100" or r.cuda_graph != "none"))
    rows = moe + tuple(r for r in rows if not r.is_moe)[:4]
    errs = software_fit.log_errors(rows, PLANTED)
    scale = [math.exp(e) / (factor if r.model == slower else 1.0) for r, e in zip(rows, errs)]
    return tuple(dataclasses.replace(r, tokens_per_s_per_gpu=r.tokens_per_s_per_gpu * k) for r, k in zip(rows, scale))


def _assert_planted(got: dict) -> None:
    for key in ("sustained_hopper", "sustained_blackwell"):
        assert got[key] == pytest.approx(PLANTED[key], abs=0.01), key
    for key in ("moe_layer_fixed_s", "moe_layer_graphed_s", "moe_layer_module_graph_s"):
        assert got[key] == pytest.approx(PLANTED[key], abs=0.0002), key


def test_the_fit_recovers_planted_constants():
    # 12 golden-section steps narrow each bracket to 0.3% of its width: 0.0016 and 0.03 ms, inside the tolerances
    _assert_planted(software_fit.fit(_planted_rows(), start=START, sweeps=2, iters=12))


def test_one_models_unexplained_cost_does_not_move_the_fit():
    """The fit's error is absolute: one model's rows made 1.5x slower than the simulator at the planted constants
    (as gpt-oss-120b's unexplained Blackwell cost makes its published rows) leave the constants where the other
    rows put them; a squared error lets those rows pull every constant."""
    _assert_planted(software_fit.fit(_planted_rows("gpt-oss-120b", 1.5), start=START, sweeps=2, iters=12))


def test_readme_table_is_the_code_output():
    readme = (Path(__file__).parents[2] / "simulator" / "README.md").read_text()
    assert format_published(TABLE) in readme


def test_mtp_rows_are_the_ones_the_tables_count_mtp_flops_for():
    """Which DeepSeek-V3 runs trained the MTP module is read from the recipes (``mtp_num_layers``); the tables' own
    model TFLOP/s per token say the same: about 260 GFLOP with the module, 249 without."""
    rows = [r for r in ROWS + CALIBRATION if r.model == "deepseek-v3"]
    assert {r.mtp for r in rows} == {True, False}
    for r in rows:
        gflop = r.tflops_per_gpu * 1e3 / r.tokens_per_s_per_gpu
        assert abs(gflop - (260 if r.mtp else 249)) < 2.5, (r.system, r.release, gflop)


def test_recipe_layouts_split_the_middle_evenly():
    """A recipe's pipeline layout (``layout=first+last``) leaves the same number of layers in every middle chunk, as
    the recipes' layout strings and Megatron's ``account_for_*_in_pipeline_split`` do."""
    for r in (r for r in ROWS + CALIBRATION if r.pp_layout):
        first, last = r.pp_layout
        spec, chunks = published_model(r), r.pp * r.vp
        assert (spec.num_layers - first - last) % (chunks - 2) == 0, (r.model, r.system, r.release)
