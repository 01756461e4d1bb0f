"""A damaged trace folder of any format (our JSON lines, a profiler trace, Flight Recorder dumps): ``moonep
diagnose`` answers 0, 1 or 2 with readable lines, never a traceback. Hypothesis damages a real folder: fields
of records, events and entries set to values of the wrong type, sign or size, or removed. Found this way: a
``group`` or ``bytes`` of the wrong type in a JSON line, a header without ``rank``, a non-dict ``args`` of a
profiler event, a dict ``pid``, a gap in a dump's sequence numbers (the hang verdict's ``next`` on nothing), a
rank without calls in some step (``max`` of nothing), non-numeric dump times, sizes and dtypes."""

from __future__ import annotations

import contextlib
import copy
import functools
import gzip
import io
import json
import os
import random
import shutil
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tools.cli  # noqa: F401 (at collection: it imports torch, whose first import asks ldconfig, a process)
from moonep.console import main
from tests.tools.synth import make_records
from tools.report import analyse

FIXTURES = Path(__file__).parent / "fixtures"
WRONG = [None, -1, 0, 1e30, float("nan"), float("inf"), "x", "", [], [0, 1], [-3], {}, {"a": 1}, True, 2**70, 10**400]
"""``10**400``: a JSON integer no float holds (``float()`` and ``math.isfinite`` raise OverflowError on it)."""


def _nodes(obj, path=()):
    """Every (path, value) under ``obj``."""
    yield path, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        yield from _nodes(value, (*path, key))


def _damage(doc, rng: random.Random, times: int, paths: list | None = None):
    """``doc`` with ``times`` nodes (of ``paths``, default all) set to a wrong value or removed."""
    paths = paths or [p for p, _ in _nodes(doc) if p]
    for path in rng.sample(paths, min(times, len(paths))):
        parent = doc
        with contextlib.suppress(KeyError, IndexError, TypeError):  # an earlier change removed the way there
            for key in path[:-1]:
                parent = parent[key]
            if rng.random() < 0.75:
                parent[path[-1]] = copy.deepcopy(rng.choice(WRONG))
            else:
                del parent[path[-1]]
    return doc


def _diagnose(folder: Path, partial: bool) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["diagnose", str(folder), *(["--partial"] if partial else [])], packages=["tools"])
    return code, err.getvalue()


def _json_lines(folder: Path, rng: random.Random, times: int) -> None:
    for rank, records in make_records(ranks=2, steps=10, slow=(1, 2.0, 0)).items():
        lines = [json.dumps(_damage(r, rng, 1) if rng.random() < times / 20 else r) for r in records]
        header = {"op": "header", "kind": "header", "rank": rank, "world_size": 2, "t_enter": 0.0, "t_exit": 0.0}
        (folder / f"rank{rank}.jsonl").write_text("\n".join([json.dumps(header), *lines]) + "\n")


@functools.cache
def _profiler_traces() -> tuple:
    """(file name, document, every path in it) of the real two-rank profiler trace, read once."""
    out = []
    for path in sorted((FIXTURES / "kineto").iterdir()):
        doc = json.loads(gzip.decompress(path.read_bytes()))
        out.append((path.name.removesuffix(".gz"), doc, [p for p, _ in _nodes(doc) if p]))
    return tuple(out)


def _profiler(folder: Path, rng: random.Random, times: int) -> None:
    for name, doc, paths in _profiler_traces():
        (folder / name).write_text(json.dumps(_damage(copy.deepcopy(doc), rng, times, paths)))


def _flight_recorder(folder: Path, rng: random.Random, times: int) -> None:
    for name in ("fr0.json", "fr1.json"):
        doc = json.loads((FIXTURES / "flight_recorder" / name).read_text())
        (folder / name).write_text(json.dumps(_damage(doc, rng, times)))


WRITERS = {"jsonl": (_json_lines, 12), "kineto": (_profiler, 60), "flight_recorder": (_flight_recorder, 30)}
"""format -> (writer of a folder damaged ``times`` times, the most damage drawn)."""


def test_each_writer_undamaged_is_read_as_its_format(tmp_path):
    """The property below would hold vacuously if the folders were not read at all."""
    for fmt, (write, _) in WRITERS.items():
        (tmp_path / fmt).mkdir()
        write(tmp_path / fmt, random.Random(0), 0)
        code, err = _diagnose(tmp_path / fmt, partial=False)
        report, _ = analyse(tmp_path / fmt)
        assert code in (0, 1) and report["format"] == fmt and report["steps"]["count"] >= 8, (fmt, err)


@settings(max_examples=90, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(sorted(WRITERS)), rng=st.randoms(use_true_random=False), data=st.data())
def test_a_damaged_folder_is_answered_never_a_traceback(tmp_path_factory, fmt, rng, data):
    write, most = WRITERS[fmt]
    folder = tmp_path_factory.mktemp(fmt)
    write(folder, rng, data.draw(st.integers(1, most), label="times"))
    code, err = _diagnose(folder, partial=data.draw(st.booleans(), label="partial"))
    assert code in (0, 1, 2) and "Traceback" not in err, err
    assert code != 2 or err.startswith("error: "), err


def test_a_gap_in_the_sequence_numbers_still_names_the_hanging_rank(tmp_path):
    """Rank 1's dump lost its last entry and rank 0's lost the one before it: rank 1 is behind, and the first
    call it lacks is the last one, not the lost one."""
    for name in ("fr0.json", "fr1.json"):
        shutil.copy(FIXTURES / "flight_recorder" / name, tmp_path / name)
    docs = {n: json.loads((tmp_path / n).read_text()) for n in ("fr0.json", "fr1.json")}
    top = max(e["collective_seq_id"] for e in docs["fr0.json"]["entries"])
    docs["fr1.json"]["entries"] = [e for e in docs["fr1.json"]["entries"] if e["collective_seq_id"] < top]
    docs["fr0.json"]["entries"] = [e for e in docs["fr0.json"]["entries"] if e["collective_seq_id"] != top - 1]
    docs["fr1.json"]["entries"] = [e for e in docs["fr1.json"]["entries"] if e["collective_seq_id"] != top - 1]
    for name, doc in docs.items():
        (tmp_path / name).write_text(json.dumps(doc))
    out = tmp_path / "f.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["diagnose", str(tmp_path), "--partial", "--json", str(out)], packages=["tools"])
    hangs = [f for f in json.loads(out.read_text())["findings"] if f["kind"] == "hang"]
    assert code == 1 and [(f["ranks"], f["evidence"]["seq"]) for f in hangs] == [([1], top)], hangs
    os.remove(out)


def _overflow(path: Path) -> None:
    """One time of the file set to ``10**400``: the last record's ``t_enter``, the first complete profiler event's
    ``ts``, the last dump entry's ``time_created_ns``."""
    if path.suffix == ".jsonl":
        lines = path.read_text().splitlines()
        lines[-1] = json.dumps({**json.loads(lines[-1]), "t_enter": 10**400})
        path.write_text("\n".join(lines) + "\n")
        return
    doc = json.loads(path.read_text())
    if "traceEvents" in doc:
        next(e for e in doc["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X")["ts"] = 10**400
    else:
        doc["entries"][-1]["time_created_ns"] = 10**400
    path.write_text(json.dumps(doc))


def test_an_integer_past_a_floats_range_is_a_damaged_value_in_every_format(tmp_path):
    """A time of 400 digits: once an OverflowError traceback in each reader (``math.isfinite`` on a JSON line,
    ``float(ts)`` on a profiler event, ``/ 1e9`` on a dump entry); now that line, event or entry is dropped."""
    for fmt, (write, _) in WRITERS.items():
        folder = tmp_path / fmt
        folder.mkdir()
        write(folder, random.Random(0), 0)
        for path in folder.iterdir():
            _overflow(path)
        code, err = _diagnose(folder, partial=True)
        assert code in (0, 1, 2) and "Traceback" not in err, (fmt, err)


def _far_rank(folder: Path, fmt: str, how: str) -> None:
    """A rank or world size far past any job in one place of a format's files (see the test below)."""
    if fmt == "jsonl":
        path = folder / "rank0.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        if how == "world":
            lines[0]["world_size"] = 10**20
        else:
            lines[1]["group"] = [0, 10**12]
            lines = lines[1:]  # no header: the ranks expected come from the groups
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    elif fmt == "kineto":
        path = next(folder.iterdir())
        doc = json.loads(path.read_text())
        doc["distributedInfo"]["world_size" if how == "world" else "rank"] = 10**20 if how == "world" else 10**12
        path.write_text(json.dumps(doc))
    else:
        os.rename(folder / "fr1.json", folder / ("fr99999999999.json" if how == "rank" else "fr1.json"))
        doc = json.loads((folder / "fr0.json").read_text())
        if how == "world":
            for cfg in doc["pg_config"].values():
                cfg["ranks"] = json.dumps([0, 10**12])
        (folder / "fr0.json").write_text(json.dumps(doc))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["world", "rank"])
@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_a_rank_past_any_job_is_damage_not_a_walk_over_every_rank_below_it(tmp_path, fmt, how):
    """``world_size: 10**20`` in a header once hung ``diagnose`` (it listed the ranks missing below it), and so
    did a group naming rank 10**12 with no header, a profiler trace's ``distributedInfo`` and a dump's name."""
    write, _ = WRITERS[fmt]
    write(tmp_path, random.Random(0), 0)
    _far_rank(tmp_path, fmt, how)
    for partial in (False, True):
        code, err = _diagnose(tmp_path, partial=partial)
        assert code in (0, 1, 2) and "Traceback" not in err and err.count("\n") <= 1, err
        assert code != 2 or err.startswith("error: "), err
