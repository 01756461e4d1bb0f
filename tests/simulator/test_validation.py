"""Validation table (simulator/README.md): the dense Megatron A100 runs within 10%, one A100 efficiency set."""

from simulator.validation import RUNS, format_rows, time_table


def test_megatron_a100_runs_within_10_percent():
    rows = time_table()
    assert len(rows) == 2 * len(RUNS)
    bad = [r for r in rows if not r["feasible"] or abs(r["error"]) > 0.10]
    assert not bad, format_rows(rows, "published_s", "predicted_s")


def test_event_engine_also_within_10_percent():
    rows = time_table(engine="event")
    assert all(abs(r["error"]) <= 0.10 for r in rows), format_rows(rows, "published_s", "predicted_s")
