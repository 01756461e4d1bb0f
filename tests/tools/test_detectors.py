"""Detectors on synthetic trace records (fast): each kind found, on the right ranks, near the onset; adversarial
inputs (noise, slightly slow ranks, spikes, bad files) raise no alarm and never stop the analysis."""

import json
import math
import os
import pickle
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tools.synth import make_records, write_dir
from tools.analysis import build_tables, load_tables
from tools.detect import Finding, Thresholds, _rolling, _rolling_loop, episode, level_shift
from tools.findings import diagnose, rank_scores
from tools.trace_lines import TraceWarning, parse_lines
from tools.traces import load_dir, load_dir_coverage


def run(tmp_path, **kw):
    return diagnose(load_tables(write_dir(tmp_path, make_records(**kw))))


@pytest.mark.parametrize("seed", range(5))
def test_clean_noisy_runs_raise_nothing(tmp_path, seed):
    """Catches: false alarms from 2-3% timing noise on identical ranks (the MAD of 4 ranks is ~0)."""
    assert run(tmp_path, steps=100, noise=0.03, seed=seed) == []


def test_one_rank_slightly_slow_below_threshold_is_not_blamed(tmp_path):
    """Catches: a 5% slower rank (within hardware variation) being reported as a straggler."""
    assert run(tmp_path, slow=(1, 1.05, 0), noise=0.02) == []


def test_isolated_spikes_are_not_persistent(tmp_path):
    """Catches: a single slow step (GC pause, preempted core) on a rank triggering an alarm."""
    recs = make_records(steps=60)
    for r, step in ((1, 10), (2, 30), (3, 31), (0, 50)):
        for rec in recs[r]:
            if rec["step"] == step and rec["op"] == "expert_compute":
                rec["t_exit"] += 0.05
    assert diagnose(build_tables(_load(tmp_path, recs))) == []


def _load(tmp_path, recs):
    return load_dir(write_dir(tmp_path, recs))


@pytest.mark.parametrize("factor", [1.2, 1.5, 3.0])
def test_slow_compute_found_on_right_rank_near_onset(tmp_path, factor):
    """Catches: blaming the waiting ranks (their collectives are long) instead of the slow one."""
    f = run(tmp_path, slow=(2, factor, 15), steps=40)
    assert [x.kind for x in f] == ["slow_compute"]
    assert f[0].ranks == [2] and 15 <= f[0].onset_step <= 15 + 10 and f[0].confidence > 0.5
    assert f[0].what_if_step_time_s < float(np.median(load_tables(tmp_path).step_time_s[20:]))


def test_waiting_inside_a_collective_is_not_transfer(tmp_path):
    """Catches: counting the wait for a late rank as transfer time (a slow rank would look like a slow link)."""
    f = run(tmp_path, slow=(3, 2.0, 10), validate=False)
    assert [(x.kind, x.ranks) for x in f] == [("slow_compute", [3])]


def test_data_loader_blamed_not_compute(tmp_path):
    f = run(tmp_path, data_slow=(1, 0.01, 8))
    assert [(x.kind, x.ranks) for x in f] == [("data_loader", [1])] and 8 <= f[0].onset_step <= 18


def test_routing_imbalance_not_blamed_on_hardware(tmp_path):
    """Catches: the hot expert's rank reported as slow_compute (someone would swap a healthy GPU)."""
    f = run(tmp_path, tokens=[64, 64, 200, 64])
    assert [(x.kind, x.ranks) for x in f] == [("routing_imbalance", [2])]


def test_slow_rank_that_is_also_hot_gets_both_findings(tmp_path):
    f = run(tmp_path, tokens=[64, 64, 200, 64], slow=(2, 1.5, 10))
    assert sorted((x.kind, tuple(x.ranks)) for x in f) == [("routing_imbalance", (2,)), ("slow_compute", (2,))]


def test_slow_link_from_transfer_time_not_arrival(tmp_path):
    f = run(tmp_path, link=(0.02, 12))
    assert [x.kind for x in f] == ["slow_link"] and f[0].ranks == [0, 1, 2, 3] and 12 <= f[0].onset_step <= 22
    assert f[0].what_if_step_time_s < 0.03  # the 20 ms the link adds is removed


def test_pipeline_stage_imbalance_not_individual_ranks(tmp_path):
    f = run(tmp_path, stages=[0, 0, 1, 1])
    assert [(x.kind, x.ranks) for x in f] == [("pipeline_stage", [2, 3])]


def test_wait_matrix_points_at_the_late_rank(tmp_path):
    t = load_tables(write_dir(tmp_path, make_records(slow=(3, 2.0, 0))))
    column = t.wait_matrix_s.sum(axis=0)
    assert int(np.argmax(column)) == 3 and t.wait_matrix_s[3, 3] == 0.0
    scores = {s["rank"]: s["score"] for s in rank_scores(t)}
    assert scores[3] < 0.6 and min(scores[r] for r in (0, 1, 2)) > 0.9


def test_damaged_lines_are_dropped_alone_and_named(tmp_path):
    """One damaged line drops that line only (named file:line), never its rank: the old reader skipped rank 1's
    whole file for one bad line. NaN/inf times are rejected the same way (json would parse them)."""
    write_dir(tmp_path, make_records(slow=(2, 2.0, 5)))
    with open(tmp_path / "rank0.jsonl", "a") as f:
        f.write('{"op": "all_red')  # cut mid-write
    lines = (tmp_path / "rank1.jsonl").read_text().splitlines()
    lines[3] = "not json at all"
    lines[5] = lines[5].replace('"t_exit": ', '"t_exit": NaN, "was": ')
    (tmp_path / "rank3.jsonl").write_text(
        (tmp_path / "rank3.jsonl").read_text().replace('"t_enter": ', '"t_enter": Infinity, "was": ', 1)
    )
    (tmp_path / "rank1.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.warns(TraceWarning) as caught:
        traces, cov = load_dir_coverage(tmp_path)
    messages = [str(w.message) for w in caught]
    assert any("rank0.jsonl:" in m and "truncated" in m for m in messages), messages
    assert any("rank1.jsonl:4: not JSON" in m for m in messages), messages
    assert any("rank1.jsonl:6: t_exit is nan" in m for m in messages), messages
    assert any("rank3.jsonl:1: t_enter is inf" in m for m in messages), messages
    assert sorted(traces) == [0, 1, 2, 3] and len(cov.dropped) == 4 and not cov.complete
    f = diagnose(build_tables(traces))
    assert [(x.kind, x.ranks) for x in f] == [("slow_compute", [2])]


def test_pickle_and_wrong_types_are_rejected_not_loaded(tmp_path):
    """Catches: trace files ever being unpickled (arbitrary code) or a record with wrong types crashing."""
    write_dir(tmp_path, make_records(steps=10))
    (tmp_path / "rank1.jsonl").write_bytes(pickle.dumps({"op": "x"}) + b"\n")
    (tmp_path / "rank2.jsonl").write_text(json.dumps({"op": "x", "rank": "2", "t_enter": 1, "t_exit": 2}) + "\n")
    (tmp_path / "rank3.jsonl").write_bytes(b"\xff\xfe\n")
    with pytest.warns(TraceWarning):
        traces = load_dir(tmp_path)
    assert sorted(traces) == [0]
    assert diagnose(build_tables(traces)) == []


def test_empty_or_missing_folder_gives_no_findings(tmp_path):
    assert diagnose(load_tables(tmp_path)) == []
    assert diagnose(load_tables(os.path.join(tmp_path, "nope"))) == []


def test_config_and_finding_checks():
    with pytest.raises(ValueError, match="compute_ratio"):
        Thresholds(compute_ratio=1.0)
    with pytest.raises(ValueError, match="kind"):
        Finding(kind="cosmic_ray", ranks=[0], onset_step=0, confidence=0.5, what_if_step_time_s=None)
    with pytest.raises(ValueError, match="confidence"):
        Finding(kind="slow_link", ranks=[0], onset_step=0, confidence=1.5, what_if_step_time_s=None)


_LINE = st.one_of(
    st.builds(
        lambda op, rank, t0, dt, step, cpu: json.dumps(
            {"op": op, "rank": rank, "t_enter": t0, "t_exit": t0 + dt, "step": step, "cpu_s": cpu}
        ),
        st.sampled_from(["forward", "all_reduce", "data_load"]),
        st.integers(0, 3),
        st.floats(allow_nan=True, allow_infinity=True),
        st.one_of(st.floats(-1.0, 1.0), st.just(float("nan"))),
        st.one_of(st.none(), st.integers(0, 9), st.text(max_size=2), st.booleans()),
        st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none()),
    ),
    st.text(max_size=30).map(lambda s: s.replace("\n", " ")),
    st.just('{"op": "x", "rank": 0, "t_enter": NaN, "t_exit": 1}'),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_LINE, max_size=12), st.text(max_size=10).map(lambda s: s.replace("\n", "")))
def test_every_line_is_kept_valid_or_dropped_and_named(lines, tail):
    """Adversarial lines (NaN/inf times and cpu_s, wrong types, garbage, a cut last line): parsing never raises,
    every kept record has finite times and cpu_s, and each non-empty line is either kept or named as dropped."""
    text = "".join(line + "\n" for line in lines) + tail
    dropped: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        records = parse_lines("f.jsonl", text, dropped)
    for rec in records:
        for key in ("t_enter", "t_exit", "cpu_s"):
            value = rec.get(key)
            assert value is None or (not isinstance(value, float) or math.isfinite(value)), rec
        assert rec["t_exit"] >= rec["t_enter"]
    expected = sum(1 for line in lines if line.strip()) + (1 if tail.strip() else 0)
    assert len(records) + len(dropped) == expected
    assert all(d.startswith("f.jsonl:") and "line dropped" in d for d in dropped)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.lists(st.one_of(st.floats(0, 10), st.just(float("nan"))), min_size=1, max_size=12), min_size=1, max_size=3
    ).filter(lambda rows: len({len(r) for r in rows}) == 1),
    st.integers(1, 6),
    st.sampled_from([np.nanmedian, np.nanmin]),
)
def test_vectorised_rolling_matches_its_loop_twin(rows, w, fn):
    a = np.array(rows)
    assert np.allclose(_rolling(a, w, fn), _rolling_loop(a, w, fn), equal_nan=True)


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0.001, 0.01),
    st.floats(1.5, 8.0),
    st.integers(0, 30),
    st.integers(0, 4),
    st.integers(0, 2**31 - 1),
)
def test_a_rise_splits_an_episode_only_when_it_is_large(low, factor, rise, before_onset, seed):
    """``level_shift`` on a noisy step function: a milder level from ``onset`` for ``rise`` steps, then
    ``factor`` times it. It names the rise exactly when the rise is a clear factor over the milder level (a
    margin either side of ``shift_factor`` for the +-5% noise) and the milder level ran ``min_before`` steps;
    it never splits a flat level."""
    th = Thresholds()
    rng = np.random.default_rng(seed)
    n = before_onset + rise + th.persist_steps
    excess = np.zeros(n)
    excess[before_onset:] = low
    excess[before_onset + rise :] = low * factor
    excess *= 1 + 0.05 * rng.uniform(-1, 1, n)
    got = level_shift(excess, before_onset, th)
    flat = level_shift(np.full(n, low) * (1 + 0.05 * rng.uniform(-1, 1, n)), before_onset, th)
    assert flat is None
    if rise == 0 or factor < th.shift_factor * 0.85:
        assert got is None, (got, rise, factor)
    elif rise >= th.min_before and factor > th.shift_factor * 1.15:
        assert got == before_onset + rise, (got, rise, factor)
    elif rise < th.min_before:
        assert got is None


def _episode_of(ratio: list[float], th: Thresholds):
    r = np.array(ratio)
    raw = r >= th.compute_ratio
    return episode(r, raw, np.nan_to_num(_rolling(r, th.window)) >= th.compute_ratio, th)


@pytest.mark.parametrize("noise_at, dip_at", [(2, None), (3, None), (2, 6), (None, 5)])
def test_onset_walks_back_through_the_fault_not_through_noise_before_it(noise_at, dip_at):
    """A 1.5x slowdown from step 4: a step host noise pushed just past ``compute_ratio`` (1.13x) shortly before it
    is not its start (a clean-clone CI run reported onset 2 that way), while a one-step dip inside the fault (the
    peers slowed by the same hog) is still crossed."""
    th = Thresholds()
    ratio = [1.0] * 4 + [1.5] * 26
    if noise_at is not None:
        ratio[noise_at] = 1.13
    if dip_at is not None:
        ratio[dip_at] = 1.0
    ep = _episode_of(ratio, th)
    assert ep is not None and ep.onset == 4, ep


def test_a_mild_fault_keeps_its_own_first_step():
    """At 1.15x the halfway mark is below ``compute_ratio``: every flagged step of the fault counts, as before."""
    ep = _episode_of([1.0] * 10 + [1.15] * 20, Thresholds())
    assert ep is not None and ep.onset == 10
