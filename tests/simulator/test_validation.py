"""Validation table (simulator/README.md): the dense Megatron A100 runs within 10%, one A100 efficiency set."""

from pathlib import Path

import pytest

from simulator.hardware import A100_EFFICIENCY, A100_GEMM_CEILING, SUSTAINED, load_hardware
from simulator.validation import RUNS, format_a100_tables, format_rows, time_table


def test_megatron_a100_runs_within_10_percent():
    rows = time_table()
    assert len(rows) == 2 * len(RUNS)
    bad = [r for r in rows if not r["feasible"] or abs(r["error"]) > 0.10]
    assert not bad, format_rows(rows, "published_s", "predicted_s")


def test_event_engine_also_within_10_percent():
    rows = time_table(engine="event")
    assert all(abs(r["error"]) <= 0.10 for r in rows), format_rows(rows, "published_s", "predicted_s")


def test_readme_a100_tables_are_the_code_output():
    readme = (Path(__file__).parents[2] / "simulator" / "README.md").read_text()
    for table in format_a100_tables():
        assert table in readme


def test_a100_gemms_keep_hoppers_sustained_share_of_their_measured_ceiling():
    """A100's GEMM ceiling is a measurement like H100's; the share a training step keeps of it is the one the
    Hopper rows fit (``software_fit``), so a refit moves both, and no A100 run sets it."""
    assert A100_EFFICIENCY.gemm == pytest.approx(A100_GEMM_CEILING * SUSTAINED["hopper"])
    assert load_hardware("a100").efficiency == A100_EFFICIENCY
