"""The published Megatron-Bridge rows (simulator/published.py), held out of every fit (simulator/moe_fit.py): each
row within 15% of its measured tokens/s/GPU with the recipe as given (the documented misses,
validation.KNOWN_MISSES, are expected failures with their reason); every row feasible in memory
and reproduced by `moonep simulate run`."""

import json

import pytest

from moonep.console import main
from simulator.published import DENSE_ROWS, MOE_ROWS, ROWS
from simulator.validation import BAND, KNOWN_MISSES, cli_args, format_published, mean_abs_error, published_table

TABLE = published_table()


def test_enough_rows_with_sources():
    assert len(MOE_ROWS) >= 6 and len(DENSE_ROWS) >= 3
    assert all(r.source.startswith("https://docs.nvidia.com/nemo/megatron-bridge/") for r in ROWS)


def _key(r: dict) -> tuple:
    return (r["model"], r["system"], r["gpus"])


def _row_param(r: dict):
    """A known miss is an expected failure with its reason (not a pass, and not a pinned divergence)."""
    marks = [pytest.mark.xfail(reason=KNOWN_MISSES[_key(r)], strict=False)] if _key(r) in KNOWN_MISSES else []
    return pytest.param(r, marks=marks, id=f"{r['model']}-{r['system']}-{r['gpus']}")


@pytest.mark.parametrize("row", [_row_param(r) for r in TABLE])
def test_row_within_band_and_feasible(row):
    assert row["feasible"], row["reason"]
    assert abs(row["error"]) <= BAND, format_published(TABLE)


def test_enough_rows_in_band():
    """The issue's minimum: six MoE and three dense rows within the band, out of sample."""
    inside = [r for r in TABLE if abs(r["error"]) <= BAND]
    assert sum(r["kind"] == "moe" for r in inside) >= 6 and sum(r["kind"] == "dense" for r in inside) >= 3
    assert set(KNOWN_MISSES) <= {_key(r) for r in TABLE}


def test_mean_errors():
    """A broad drift guard: the MAE of each kind over the rows that are not documented misses stays within 10%
    (a documented miss is tracked by its own expected failure above; the README gives the MAE with and without
    it)."""
    tracked = [r for r in TABLE if _key(r) not in KNOWN_MISSES]
    for kind in ("moe", "dense"):
        assert mean_abs_error(tracked, kind) <= 0.10, (kind, format_published(TABLE))


def test_both_flop_conventions_reported():
    for r in TABLE:
        assert 0 < r["tflops_causal"] < r["tflops_full_square"]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r.model}-{r.system}-{r.gpus}")
def test_cli_reproduces_recipe(tmp_path, row):
    out = tmp_path / "r.json"
    assert main(["simulate", "run", *cli_args(row), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    mine = next(r for r in TABLE if (r["model"], r["system"], r["gpus"]) == (row.model, row.system, row.gpus))
    assert data["feasible"] and data["tokens_per_s_per_gpu"] == pytest.approx(mine["predicted"], rel=1e-9)
    assert set(data["flops"]) == {"full_square", "causal"} and "overlapped_fraction" in data["ep_overlap"]


def test_event_engine_agrees_on_published_rows():
    event = published_table(engine="event")
    for a, e in zip(TABLE, event):
        assert e["feasible"] and abs(e["predicted"] / a["predicted"] - 1) <= 0.03, (a, e)
