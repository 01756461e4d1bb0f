"""Command line, data pipeline, checkpoint layout and the training config checks."""

from __future__ import annotations

import pytest
import torch

from k3.data import batch, list_files, load_corpus
from k3.train import TrainConfig


def test_cli_registers_train_and_bench():
    from moonep.console import build_parser

    parser = build_parser(packages=["k3"])
    args = parser.parse_args(
        [
            "train",
            "--preset",
            "tiny",
            "--world-size",
            "2",
            "--cp",
            "2",
            "--steps",
            "7",
            "--seed",
            "3",
            "--data",
            "/tmp",
            "--run-dir",
            "/tmp/r",
            "--resume",
        ]
    )
    assert (args.preset, args.world_size, args.cp, args.steps, args.seed, args.resume) == ("tiny", 2, 2, 7, 3, True)
    assert callable(args.func)
    assert callable(parser.parse_args(["bench", "train", "--quick"]).func)


def test_stdlib_corpus_split_is_deterministic_and_disjoint():
    """Would catch a split that depends on file order or leaks validation files into training."""
    a, b = load_corpus(max_bytes=1 << 20), load_corpus(max_bytes=1 << 20)
    assert a.train.tobytes() == b.train.tobytes() and a.val.tobytes() == b.val.tobytes()
    assert len(a.val) > 0 and len(a.train) > 3 * len(a.val)  # val may overshoot its 5% by one file
    assert torch.equal(batch(a.train, 0, 5, 4, 16), batch(a.train, 0, 5, 4, 16))
    assert not torch.equal(batch(a.train, 0, 5, 4, 16), batch(a.train, 0, 6, 4, 16))
    assert batch(a.train, 0, 5, 4, 16).shape == (4, 17)


def test_data_folder(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i}.txt").write_text(f"hello world {i}\n" * 20)
    c = load_corpus(str(tmp_path))
    assert c.source == str(tmp_path) and len(c.train) + len(c.val) > 40 * 200
    assert len(list_files(str(tmp_path), (".txt",))) == 40
    with pytest.raises(ValueError, match="data"):
        load_corpus(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"global_batch": 6, "world_size": 4}, "global_batch"),
        ({"cp": 3, "world_size": 4}, "cp"),
        ({"balance": "aux"}, "balance"),
        ({"steps": 0}, "steps"),
        ({"seed": -1}, "seed: must be >= 0, got -1"),
    ],
)
def test_train_config_checks(change, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**change)


def _claimed_without_checkpoint(tmp_path) -> str:
    """A run killed before its first checkpoint: run.json claimed, no latest.json."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "run.json").write_text('{"run_id": "x", "config_hash": "y", "identity": {}}')
    return "--run-dir", str(tmp_path / "run"), "--resume"


def _file(tmp_path, *below: str) -> str:
    (tmp_path / "f").write_text("not a folder")
    return str(tmp_path.joinpath("f", *below))


@pytest.mark.parametrize(
    "flags, named",
    [
        (lambda t: ("--run-dir", str(t / "missing"), "--resume"), "--resume: run folder {t}/missing does not exist"),
        (lambda t: ("--run-dir", str(t), "--resume"), "--resume: run folder {t} holds no checkpoint (no {t}/checkp"),
        (_claimed_without_checkpoint, "--resume: run folder {t}/run holds no checkpoint"),
        (lambda t: ("--run-dir", _file(t)), "run_dir: {t}/f exists and is not a folder"),
        (lambda t: ("--run-dir", _file(t, "run")), "run_dir: {t}/f/run (its part {t}/f) exists and is not a folder"),
        (lambda t: ("--run-dir", str(t / "run"), "--trace-dir", _file(t)), "trace_dir: {t}/f exists and is not a"),
        (lambda t: ("--run-dir", str(t / "run"), "--seed", "-1"), "seed: must be >= 0, got -1"),
    ],
    ids=[
        "resume-missing",
        "resume-empty",
        "resume-claimed",
        "run-dir-file",
        "run-dir-below-file",
        "trace-dir-file",
        "seed",
    ],
)
def test_train_refuses_bad_run_flags_in_one_line(tmp_path, capsys, flags, named):
    """Catches: --resume of a mistyped or empty folder silently training from scratch (exit 0), a file as
    --run-dir / --trace-dir ending in a NotADirectoryError / FileExistsError traceback, and --seed -1 failing
    inside a rank with a message that names no flag. All refused before any rank starts."""
    from moonep.console import main

    argv = ["train", "--no-progress", "--world-size", "1", "--steps", "1", *flags(tmp_path)]
    assert main(argv, packages=["k3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + named.format(t=tmp_path)) and err.count("\n") == 1, err
    assert "Traceback" not in err and not (tmp_path / "missing").exists() and not (tmp_path / "run" / "errors").exists()


@pytest.mark.spawns
def test_bench_schema():
    """One world size, one timed step: the JSON fields the bench promises."""
    from k3.bench import run_bench

    out = run_bench("tiny", (1,), steps=1)
    (row,) = out["results"]
    assert row["world_size"] == 1 and row["tokens_per_s"] > 0 and row["peak_rss_mb"] > 0


@pytest.mark.parametrize(
    "extra,named",
    [
        (["--world-sizes", "a"], "--world-sizes: 'a' is not a world size"),
        (["--world-sizes", "1,0"], "--world-sizes: '0' is not a world size"),
        (["--world-sizes", "3"], "global_batch: 16 is not divisible by the data-parallel size 3"),
        (["--steps", "0"], "--steps: must be >= 1, got 0"),
    ],
)
def test_bench_refuses_bad_flags_in_one_line(capsys, extra, named):
    """Catches: a ValueError traceback for --world-sizes a / 0, and a StatisticsError after training for
    --steps 0."""
    from moonep.console import main

    assert main(["bench", "train", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named}") and "Traceback" not in err, err
