"""``moonep plan --load FILE``: any file is planned or refused in one line naming the file and the problem.

Found by damaging the file: rows of unequal length printed numpy's "inhomogeneous shape" text; a count of 1e30
wrapped to a negative int64 and was refused as "a negative count"; JSON ``true`` was planned as the count 1; a
file that is not UTF-8 or not JSON was refused without its name; an all-zero load reported balance 0.000 before
and 1.000 after.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from planner._inputs import as_counts
from tests.planner.test_cli_bench import run


def plan_file(tmp_path, content: str | bytes, capsys, *extra: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``plan --load`` on a file holding ``content``, then ``extra`` flags."""
    path = tmp_path / "load.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's cast warnings were part of the old answer
        rc = run(["plan", "--load", str(path), *extra])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    "content, named",
    [
        ("[[1, 2], [3]]", "load.json must be 2-D [R, E] with rows of equal length"),
        ("[[1e30, 2], [3, 4]]", "load.json must hold counts below 2**63, got 1e+30 at index (0, 0)"),
        ("[[true, 2], [3, 4]]", "load.json: row 0, column 0: true is not a count"),
        ('[[1, "2"], [3, 4]]', 'load.json: row 0, column 1: "2" is not a count'),
        ("[[1, 2], [3, 100000000000000000000000]]", "load.json: row 1, column 1: 100000000000000000000000 does not"),
        ("[[1, 2], [3, 4]", "load.json: not a JSON file (Expecting"),
        (b"\xff\xfe[[1]]", "load.json: not a JSON file ('utf-8' codec"),
        ('{"counts": [[1, 2]]}', "load.json: a JSON object needs the key 'slots_per_expert', got keys ['counts']"),
        ('{"slots_per_expert": 3}', "load.json: expected an [R, E] list of lists of counts, got int"),
        ("[[-1, 2], [3, 4]]", "load.json must be non-negative, got -1 at index (0, 0)"),
        ("[[1.5, 2], [3, 4]]", "load.json must hold integer counts"),
    ],
)
def test_a_bad_load_file_is_one_line_naming_the_file(tmp_path, capsys, content, named):
    rc, _, err = plan_file(tmp_path, content, capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("moonep plan: ") and named in err, err


def test_an_empty_load_is_balanced_before_and_after(tmp_path, capsys):
    """No routed rows: max/mean is 1.0 on both sides, as ``planner.metrics.balance`` says (0.000 before, once)."""
    js = tmp_path / "plan.json"
    (tmp_path / "zero.json").write_text("[[0, 0], [0, 0]]")
    assert run(["plan", "--load", str(tmp_path / "zero.json"), "--json", str(js)]) == 0
    data = json.loads(js.read_text())
    assert data["balance_before"] == data["balance_after"] == 1.0 and data["total_rows"] == 0
    assert "before 1.000, after 1.000" in capsys.readouterr().out


def test_the_library_names_ragged_and_huge_counts():
    """The same checks serve ``plan()`` / ``verify()`` callers who pass nested lists or float arrays."""
    with pytest.raises(ValueError, match=r"counts must be 2-D \[R, E\] with rows of equal length"):
        as_counts([[1, 2], [3]], "counts", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"below 2\*\*63, got -1e\+19 at index \(1, 0\)"):
            as_counts(np.array([[1.0, 2.0], [-1e19, 4.0]]), "counts", 2)


LEAF = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=3)
JSON_VALUE = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["slots_per_expert", "x"]), inner),
    max_leaves=12,
)


@st.composite
def near_loads(draw) -> list:
    """An [R, E] load (E a multiple of R) with up to two cells, or one row's length, damaged."""
    R, per = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    rows = [draw(st.lists(st.integers(0, 50), min_size=R * per, max_size=R * per)) for _ in range(R)]
    for _ in range(draw(st.integers(0, 2))):
        r, e = draw(st.integers(0, R - 1)), draw(st.integers(0, R * per - 1))
        rows[r][e] = draw(LEAF | st.integers(-3, 2**40) | st.floats(-1e20, 1e20))
    if draw(st.booleans()) and draw(st.booleans()):
        rows[0] = rows[0][:-1]
    return rows


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=JSON_VALUE | near_loads() | near_loads().map(lambda rows: {"slots_per_expert": rows}))
def test_any_json_is_planned_or_refused_in_one_line(tmp_path, capsys, value):
    """Whatever JSON the file holds: exit 0 with every routed row planned and the ranks within one row of each
    other, or exit 2 and one ``moonep plan:`` line; never a traceback, a numpy warning or another exit code."""
    js = tmp_path / "plan.json"
    js.unlink(missing_ok=True)
    rc, _, err = plan_file(tmp_path, json.dumps(value), capsys, "--json", str(js))
    assert rc in (0, 2), (rc, err)
    event("planned" if rc == 0 else "refused")  # the statistics show both happen
    if rc == 2:
        assert err.startswith("moonep plan: ") and err.count("\n") == 1, err
        return
    counts = value["slots_per_expert"] if isinstance(value, dict) else value
    data = json.loads(js.read_text())
    assert data["total_rows"] == sum(sum(int(c) for c in row) for row in counts)
    assert sum(data["after"]) == data["total_rows"] and max(data["after"]) - min(data["after"]) <= 1
