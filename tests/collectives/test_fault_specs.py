"""Fault-injection spec parsing (``collectives.faults``): the one grammar of ``moonep train`` and the tools' demo."""

import pytest

from collectives.faults import (
    DataDelay,
    LinkDelay,
    Slowdown,
    parse_data_delays,
    parse_link_delay_specs,
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
