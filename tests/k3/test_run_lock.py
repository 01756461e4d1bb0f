"""The run folder's lock: a second run into a folder another run holds is refused on every rank, naming the first
run, and leaves the first run's files alone; a stale lock (its process gone) is taken over; a lock left by another
host is named, not guessed at. The first run is a real one started in this process (the world-size-1 gloo
communicator, the same ``_start`` as a launched rank); the second is 2 launched ranks, or ``moonep train``."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import socket
import subprocess
import sys

import pytest

from collectives import launch
from k3 import checkpoint as ck
from k3.run_folder import LOCK_FILE, acquire_run_lock, check_run_lock
from k3.train import TrainConfig, _start, train
from tests.k3.files import read_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    """A small corpus: loads in milliseconds."""
    folder = tmp_path_factory.mktemp("text")
    for i in range(40):
        (folder / f"f{i}.txt").write_text(f"hello world {i}\n" * 20)
    return str(folder)


def _tc(run_dir: str, text: str, **kw) -> TrainConfig:
    base = {
        "steps": 1,
        "world_size": 1,
        "val_every": 1000,
        "ckpt_every": 0,
        "progress": False,
        "data": text,
        "run_dir": run_dir,
    }
    return TrainConfig(**{**base, **kw})


def _cli(argv: list[str]) -> tuple[int, str]:
    from moonep.console import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["train", "--no-progress", *argv], packages=["k3"])
    return rc, err.getvalue()


def _start_each_rank(comm, train: dict, out: str) -> None:
    """Rank body: start a run; record what this rank saw (its error, or that it started)."""
    try:
        _start(comm, TrainConfig(**train))
        seen = "started"
    except ck.CheckpointError as exc:
        seen = str(exc)
    with open(os.path.join(out, f"rank{comm.rank}.json"), "w") as f:
        json.dump(seen, f)


@pytest.mark.spawns
def test_second_run_into_a_held_folder_is_refused_on_every_rank(comm1, text, tmp_path):
    """Two runs started into one fresh folder: the second (2 launched ranks, then `moonep train --resume` once the
    first has a checkpoint) is refused on both ranks, naming the first run's id, pid and host; the first run's
    claim and checkpoint stay its own. Would catch the second run claiming the folder (the first run's next
    checkpoint would then name another run) and a refusal on rank 0 only (rank 1 training alone or waiting)."""
    run_dir, out = str(tmp_path / "run"), tmp_path / "seen"
    out.mkdir()
    tc, first, start = _start(comm1, _tc(run_dir, text))
    run_id = first.run["run_id"]
    second = _tc(run_dir, text, world_size=2, steps=2)
    launch(_start_each_rank, 2, timeout=30, job_timeout=90, train=dataclasses.asdict(second), out=str(out))
    seen = [read_json(out / f"rank{r}.json") for r in range(2)]
    words = [f"in use by run {run_id}", f"pid {os.getpid()} on host {socket.gethostname()}", LOCK_FILE]
    assert all(w in seen[0] for w in words) and "\n" not in seen[0], seen
    assert seen[1] == f"rank 0: {seen[0]}"
    first.step(0)
    first.save(1)  # the first run goes on: its claim was not replaced
    assert ck.read_run(run_dir)["run_id"] == run_id and ck.read_manifest(run_dir)[1]["run_id"] == run_id
    rc, err = _cli(["--world-size", "1", "--steps", "2", "--data", text, "--run-dir", run_dir, "--resume"])
    assert rc == 2 and err.count("\n") == 1 and f"in use by run {run_id}" in err, err
    first.lock.release()  # the first run ends cleanly: the lock file is emptied, and a resume goes on from it
    assert os.path.getsize(os.path.join(run_dir, LOCK_FILE)) == 0
    resumed = train(_tc(run_dir, text, steps=2, resume=True))
    assert resumed["start"] == 1 and len(resumed["losses"]) == 1
    assert ck.read_manifest(run_dir)[1]["run_id"] == run_id and ck.read_manifest(run_dir)[1]["step"] == 2


@pytest.mark.spawns
def test_stale_lock_of_an_exited_process_is_taken_over(comm1, text, tmp_path):
    """A process that took the lock and died without releasing it leaves its record behind; the next run on this
    host takes the lock over (flock ended with the process) and records itself."""
    run_dir = str(tmp_path / "run")
    code = f"import os; from k3.run_folder import acquire_run_lock; acquire_run_lock({run_dir!r}, 'dead'); os._exit(3)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr[-2000:]
    left = read_json(os.path.join(run_dir, LOCK_FILE))
    assert left["run_id"] == "dead" and left["host"] == socket.gethostname() and left["pid"] != os.getpid()
    check_run_lock(run_dir)  # the check before launching passes too
    tc, trainer, start = _start(comm1, _tc(run_dir, text))
    try:
        mine = read_json(os.path.join(run_dir, LOCK_FILE))
        assert mine["run_id"] == trainer.run["run_id"] and mine["pid"] == os.getpid() and start == 0
        with pytest.raises(ck.CheckpointError, match=f"in use by run {mine['run_id']}"):
            acquire_run_lock(run_dir)  # and it is held again
    finally:
        trainer.lock.release()


def test_unreleased_lock_of_another_host_is_named_not_taken(comm1, text, tmp_path):
    """A lock record from another machine that nobody holds here: that run may still be running there (a flock
    over a shared filesystem may not reach this host), so the run is refused, naming the host and what to do,
    before anything is claimed; `moonep train` says it in one line, exit 2."""
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    record = {"run_id": "f00d", "pid": 4242, "host": "elsewhere.example", "started": "2025-01-01T00:00:00+0000"}
    with open(os.path.join(run_dir, LOCK_FILE), "w") as f:
        json.dump(record, f)
    with pytest.raises(ck.CheckpointError) as info:
        _start(comm1, _tc(run_dir, text))
    msg = str(info.value)
    assert "run f00d (pid 4242 on host elsewhere.example" in msg and f"remove {run_dir}/{LOCK_FILE}" in msg, msg
    assert ck.read_run(run_dir) is None  # nothing claimed
    rc, err = _cli(["--world-size", "1", "--steps", "1", "--data", text, "--run-dir", run_dir])
    assert rc == 2 and err.count("\n") == 1 and "another machine" in err, err
    assert read_json(os.path.join(run_dir, LOCK_FILE)) == record  # left for its owner


@pytest.mark.spawns
def test_record_of_a_live_process_without_its_flock_is_refused_until_it_ends(tmp_path):
    """Where flock does nothing (some filesystems), the record is the only sign of a live run: a record naming a
    live process on this host is refused; once that process has ended, its record is stale and is taken over."""
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"run_id": "beef", "pid": other.pid, "host": socket.gethostname(), "started": "now"}
        with open(os.path.join(run_dir, LOCK_FILE), "w") as f:
            json.dump(record, f)
        with pytest.raises(ck.CheckpointError, match=f"names run beef \\(pid {other.pid} on host .*a live process"):
            check_run_lock(run_dir)
    finally:
        other.kill()
        other.wait(timeout=30)
    lock = acquire_run_lock(run_dir, "next")
    assert read_json(os.path.join(run_dir, LOCK_FILE))["run_id"] == "next"
    lock.release()
