"""Fault-injection spec parsing (``collectives.faults``): the one grammar of ``moonep train`` and the tools' demo."""

import pytest

from collectives.faults import (
    MAX_FACTOR,
    MAX_MS,
    DataDelay,
    LinkDelay,
    Slowdown,
    parse_data_delays,
    parse_link_delay_specs,
    parse_link_delays,
    parse_slowdowns,
)


def test_parses_all_three_kinds_with_defaults():
    assert parse_slowdowns("rank=2,factor=1.3,from_step=5") == [Slowdown(rank=2, factor=1.3, from_step=5)]
    assert parse_slowdowns(" rank=1 , factor=2 ") == [Slowdown(rank=1, factor=2.0, from_step=0)]
    assert parse_data_delays("rank=0,ms=10;rank=3,ms=1,from_step=2") == [
        DataDelay(rank=0, ms=10.0),
        DataDelay(rank=3, ms=1.0, from_step=2),
    ]
    assert parse_link_delay_specs("src=0,dst=3,ms=20") == [LinkDelay(src=0, dst=3, ms=20.0)]
    assert parse_slowdowns("") == [] and parse_link_delay_specs(";") == []


@pytest.mark.parametrize(
    "spec, words",
    [
        ("rank=1", ["'rank=1'", "missing ['factor']"]),
        ("rank=1,factor=2,speed=3", ["unknown ['speed']"]),
        ("rank=x,factor=2", ["rank='x'", "integer"]),
        ("rank=1,factor=fast", ["factor='fast'", "number"]),
        ("rank=1,factor=0.5", ["'rank=1,factor=0.5'", "factor must be >= 1"]),
        ("rank=-1,factor=2", ["rank must be >= 0"]),
        ("rank=1,factor=2,from_step=-3", ["from_step"]),
        ("rank=1;factor=2", ["'rank=1'"]),
        ("rank1,factor=2", ["key=value", "'rank1'"]),
        ("rank=1,rank=2,factor=2", ["rank= given twice"]),
    ],
)
def test_bad_slowdown_names_the_bad_part(spec, words):
    """Catches: a typo silently running a clean job, or an error that does not say what to fix."""
    with pytest.raises(ValueError) as err:
        parse_slowdowns(spec)
    for w in words:
        assert w in str(err.value)


def test_bad_link_and_data_specs():
    with pytest.raises(ValueError, match="two different ranks"):
        parse_link_delay_specs("src=1,dst=1,ms=2")
    with pytest.raises(ValueError, match="ms must be >= 0"):
        parse_data_delays("rank=0,ms=-1")
    with pytest.raises(ValueError, match=r"missing \['ms'\]"):
        parse_link_delay_specs("src=0,dst=1")


@pytest.mark.parametrize(
    "parse, spec, words",
    [
        (parse_slowdowns, "rank=0,factor=inf", "slowdown factor must be >= 1 and <= 1000, got inf"),
        (parse_slowdowns, "rank=0,factor=nan", "slowdown factor must be >= 1 and <= 1000, got nan"),
        (parse_slowdowns, "rank=0,factor=1000.5", "slowdown factor must be >= 1 and <= 1000"),
        (parse_data_delays, "rank=0,ms=inf", "data delay ms must be >= 0 and <= 3600000, got inf"),
        (parse_data_delays, "rank=0,ms=1e308", "data delay ms must be >= 0 and <= 3600000, got 1e+308"),
        (parse_data_delays, "rank=0,ms=nan", "data delay ms must be >= 0 and <= 3600000, got nan"),
        (parse_link_delay_specs, "src=0,dst=1,ms=inf", "link delay ms must be >= 0 and <= 3600000, got inf"),
        (parse_link_delay_specs, "src=0,dst=1,ms=3600001", "link delay ms must be >= 0 and <= 3600000"),
        (parse_link_delays, "src=0,dst=1,ms=inf", "ms >= 0 and <= 3600000"),
        (parse_link_delays, "src=0,dst=1,ms=nan", "ms >= 0 and <= 3600000"),
    ],
)
def test_unbounded_or_nan_fault_values_are_refused(parse, spec, words):
    """Catches: factor=inf hanging the job, ms=inf / 1e308 overflowing a timestamp inside a rank (a traceback),
    and nan slipping through a one-sided check."""
    with pytest.raises(ValueError) as err:
        parse(spec)
    assert repr(spec) in str(err.value) and words in str(err.value), str(err.value)


def test_fault_values_at_their_caps_are_accepted():
    assert parse_slowdowns("rank=0,factor=1000") == [Slowdown(rank=0, factor=MAX_FACTOR)]
    assert parse_data_delays("rank=0,ms=3600000") == [DataDelay(rank=0, ms=MAX_MS)]
    assert parse_link_delays("src=0,dst=1,ms=3600000") == {(0, 1): 3600.0}


@pytest.mark.parametrize(
    "argv, words",
    [
        (["train", "--steps", "1", "--inject-slowdown", "rank=0,factor=inf"], "slowdown factor must be >= 1"),
        (["train", "--steps", "1", "--inject-data-delay", "rank=0,ms=1e308"], "data delay ms must be >= 0"),
        (["train", "--steps", "1", "--inject-link-delay", "src=0,dst=1,ms=inf"], "link delay ms must be >= 0"),
        (["probe", "--world-size", "2", "--inject-link-delay", "src=0,dst=1,ms=inf"], "link delay ms must be >= 0"),
        (["straggler-demo", "--inject-slowdown", "rank=0,factor=inf"], "slowdown factor must be >= 1"),
        (["straggler-demo", "--inject-link-delay", "src=0,dst=1,ms=inf"], "link delay ms must be >= 0"),
    ],
)
def test_every_fault_flag_command_refuses_inf_in_one_line(tmp_path, capsys, argv, words):
    """The commands that read this grammar: exit 2 and one line, never a hang or a rank's OverflowError
    traceback, and nothing launched (no run folder)."""
    from moonep.console import main

    run_dir = tmp_path / "run"
    extra = ["--world-size", "2", "--no-progress", "--run-dir", str(run_dir)] if argv[0] == "train" else []
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err and "Traceback" not in err, err
    assert not run_dir.exists()
