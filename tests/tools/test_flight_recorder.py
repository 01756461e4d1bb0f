"""Flight Recorder dumps: real torch 2.13 dumps (fixtures/flight_recorder: a 2-rank gloo DDP job whose rank 1
sleeps 30 ms a step from step 5 of 13; JSON from ``_dump_fr_trace_json`` and pickle from ``_dump_fr_trace``),
edited copies for hangs and mismatches, and untrusted pickles that must never run anything."""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil

import pytest

from moonep.console import main
from tools.flight_recorder import analyse_fr
from tools.fr_dumps import SafeUnpickler, load_dump, rank_of, read_flight_recorder
from tools.traces import TraceFormatError

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "flight_recorder")


def _cli(args, capsys) -> tuple[int, str, str]:
    code = main(["diagnose", *args], packages=["tools"])
    out = capsys.readouterr()
    return code, out.out, out.err


def _copy(tmp_path, ext: str) -> str:
    folder = tmp_path / ext
    folder.mkdir()
    for r in (0, 1):
        shutil.copy(os.path.join(FIXTURE, f"fr{r}.{ext}"), folder)
    return str(folder)


@pytest.mark.parametrize("ext", ["json", "pkl"])
def test_real_dumps_name_the_late_rank_and_its_onset(ext, tmp_path, capsys):
    code, out, err = _cli([_copy(tmp_path, ext), "--json", str(tmp_path / "r.json")], capsys)
    assert code == 1, out + err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["format"] == "flight_recorder" and report["coverage"]["ranks"] == [0, 1]
    (f,) = report["findings"]
    assert (f["kind"], f["ranks"], f["onset_step"]) == ("late_arrival", [1], 5)
    assert 0.025 < f["evidence"]["excess_s"] < 0.04  # the 30 ms sleep, from the arrival times
    assert report["flight_recorder"]["last_seq"] == {"0": {"default_pg": 18}, "1": {"default_pg": 18}}
    late = [row for row in report["flight_recorder"]["arrival_skew"] if row["step"] is not None and row["step"] >= 5]
    assert late and all(row["last_rank"] == 1 for row in late if row["skew_s"] > 0.02)


def test_pickle_and_json_forms_hold_the_same_calls():
    for r in (0, 1):
        a, b = load_dump(os.path.join(FIXTURE, f"fr{r}.json")), load_dump(os.path.join(FIXTURE, f"fr{r}.pkl"))
        key = [(e["collective_seq_id"], e["profiling_name"], e["time_created_ns"]) for e in a["entries"]]
        assert key == [(e["collective_seq_id"], e["profiling_name"], e["time_created_ns"]) for e in b["entries"]]


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch " + os.environ["MOONEP_FR_MARKER"],))


def test_a_pickle_holding_objects_is_refused_and_never_run(tmp_path, monkeypatch, capsys):
    marker = tmp_path / "ran"
    monkeypatch.setenv("MOONEP_FR_MARKER", str(marker))
    folder = tmp_path / "evil"
    folder.mkdir()
    with open(folder / "fr_trace_0", "wb") as f:
        pickle.dump({"entries": [_Boom()], "version": "2.10"}, f)
    code, out, err = _cli([str(folder)], capsys)
    assert code == 2 and "refusing to unpickle" in err and "system" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists()
    from collections import OrderedDict

    with open(folder / "fr_trace_0", "wb") as f:
        pickle.dump(OrderedDict(entries=[]), f)
    with pytest.raises(TraceFormatError, match="collections.OrderedDict"):
        load_dump(str(folder / "fr_trace_0"))
    assert issubclass(SafeUnpickler, pickle.Unpickler)


@pytest.mark.parametrize("ext", ["json", "pkl"])
def test_a_truncated_dump_is_one_line(ext, tmp_path, capsys):
    folder = _copy(tmp_path, ext)
    path = os.path.join(folder, f"fr1.{ext}")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    code, out, err = _cli([folder], capsys)
    assert code == 2 and "fr1" in err and ("truncated" in err or "cut short" in err), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _edited(tmp_path, edit) -> str:
    folder = tmp_path / "edited"
    folder.mkdir()
    for r in (0, 1):
        doc = load_dump(os.path.join(FIXTURE, f"fr{r}.json"))
        doc = edit(r, copy.deepcopy(doc))
        (folder / f"fr{r}.json").write_text(json.dumps(doc))
    return str(folder)


def test_a_rank_that_never_entered_the_last_call_is_a_hang(tmp_path, capsys):
    def drop_last(rank, doc):
        if rank == 1:
            doc["entries"] = doc["entries"][:-2]
        return doc

    code, out, err = _cli([_edited(tmp_path, drop_last)], capsys)
    assert code == 1, out + err
    assert "hang" in out and "ranks [1] never entered all_reduce #17" in out and "ranks [0] entered" in out


def test_calls_that_differ_across_ranks_are_a_mismatch(tmp_path):
    def resize(rank, doc):
        if rank == 1:
            doc["entries"][10]["input_sizes"] = [[7]]
        return doc

    folder = _edited(tmp_path, resize)
    run = read_flight_recorder({r: os.path.join(folder, f"fr{r}.json") for r in (0, 1)})
    (f,) = [f for f in analyse_fr(run).findings if f.kind == "collective_mismatch"]
    seq = load_dump(os.path.join(FIXTURE, "fr1.json"))["entries"][10]["collective_seq_id"]
    assert f.ranks == [1] and f.evidence["seq"] == seq and "[[7]]" in f.detail


def test_names_ranks_world_sizes_and_duplicates(tmp_path, capsys):
    folder = tmp_path / "names"
    folder.mkdir()
    for r in (0, 1):
        shutil.copy(os.path.join(FIXTURE, f"fr{r}.json"), folder / f"dump-{'ab'[r]}.json")
    code, out, err = _cli([str(folder)], capsys)
    assert code == 2 and "--rank-from" in err, err
    code, out, err = _cli([str(folder), "--rank-from", r"dump-(\d)"], capsys)
    assert code == 2 and "rank" in err  # the regex must capture digits: "a" is no rank
    assert rank_of("x/dump-a.json", r"dump-(\w)") is None and rank_of("nccl_trace_rank_3.pkl") == 3
    assert rank_of("fr_trace_12") == 12 and rank_of("host.json") is None

    def widen(rank, doc):
        if rank == 1:
            doc["pg_config"] = {k: dict(v, ranks="[0, 1, 2, 3]") for k, v in doc["pg_config"].items()}
        return doc

    code, out, err = _cli([_edited(tmp_path, widen)], capsys)
    assert code == 2 and "two world sizes" in err, err
    both = tmp_path / "both"
    both.mkdir()
    shutil.copy(os.path.join(FIXTURE, "fr0.json"), both / "fr0.json")
    shutil.copy(os.path.join(FIXTURE, "fr0.pkl"), both / "fr0.pkl")
    code, out, err = _cli([str(both)], capsys)
    assert code == 2 and "second Flight Recorder dump of rank 0" in err, err
