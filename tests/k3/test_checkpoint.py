"""Checkpoints that know their run and prove their bytes: every corrupt or foreign checkpoint is refused with one
line naming the file and the fault; a kill at any point of a write leaves the previous step or the new one, never a
mix. In-process cases use the world-size-1 gloo communicator (the same code path as many ranks); the kill points
and the user-facing error run real ranks through the launcher."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from collectives import LaunchError, launch
from k3 import checkpoint as ck
from k3.train import TrainConfig, _start, prepare_run
from tests.k3.files import read_json, read_jsonl, write_json

SMALL = {
    "steps": 1,
    "val_every": 1000,
    "ckpt_every": 0,
    "progress": False,
    "max_data_bytes": 1 << 20,
    "warmup": 2,
    "world_size": 1,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, comm1):
    """A real one-step checkpoint of tiny at world size 1 (model + full optimizer state)."""
    run_dir = str(tmp_path_factory.mktemp("ckpt") / "run")
    tc, trainer, start = _start(comm1, TrainConfig(run_dir=run_dir, **SMALL))
    trainer.step(0)
    trainer.save(1)
    return run_dir, trainer.state_tensors()


def _copy(saved, tmp_path) -> str:
    dst = str(tmp_path / "run")
    shutil.copytree(saved[0], dst)
    return dst


def _shard(run_dir: str, rank: int = 0) -> str:
    return os.path.join(run_dir, "checkpoints", "step_000001", f"rank_{rank}.safetensors")


def _rehash(run_dir: str, rank: int = 0) -> None:
    """What a buggy writer would leave: a shard whose manifest entry matches its (wrong) content."""
    mpath = os.path.join(run_dir, "checkpoints", "step_000001", "manifest.json")
    manifest = read_json(mpath)
    data = Path(_shard(run_dir, rank)).read_bytes()
    manifest["shards"][rank].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    write_json(mpath, manifest)


def _resume(comm, run_dir: str, **kw):
    return _start(comm, TrainConfig(run_dir=run_dir, resume=True, **{**SMALL, "steps": 2, **kw}))


def _flip(run_dir, rank=0):
    path = Path(_shard(run_dir, rank))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # inside the last tensor's bytes: safetensors itself would load it without complaint
    path.write_bytes(bytes(data))


def _truncate(run_dir, rank=0):
    path = Path(_shard(run_dir, rank))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def _garbage(run_dir, rank=0):
    Path(_shard(run_dir, rank)).write_bytes(os.urandom(4096))
    _rehash(run_dir, rank)  # even with a matching checksum, garbage is refused by the parser, in one line


def _edit_tensors(change):
    def corrupt(run_dir, rank=0):
        tensors = load_file(_shard(run_dir, rank))
        change(tensors)
        save_file(tensors, _shard(run_dir, rank))
        _rehash(run_dir, rank)

    return corrupt


def _drop_optim(t):
    del t[next(k for k in sorted(t) if k.startswith("optim.") and k.endswith(".momentum"))]


def _extra_optim(t):
    t["optim.model.norm.weight.exp_avg_max"] = torch.zeros(1)


def _reshape_optim(t):
    key = next(k for k in sorted(t) if k.endswith(".exp_avg"))
    t[key] = torch.zeros(3)


CORRUPTIONS = {
    "flipped byte": (_flip, "sha256 differs"),
    "truncated shard": (_truncate, "bytes, the manifest says"),
    "garbage shard (rehashed)": (_garbage, "not a readable safetensors file"),
    "optimizer key missing": (_edit_tensors(_drop_optim), "1 tensor(s) missing ['optim."),
    "optimizer key extra": (_edit_tensors(_extra_optim), "1 unexpected ['optim.model.norm.weight.exp_avg_max']"),
    "optimizer state reshaped": (_edit_tensors(_reshape_optim), "expected torch.float32"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_shard_is_refused_in_one_line(saved, tmp_path, comm1, case):
    """Would catch flipped bytes trained on, optimizer state loading loosely (restarting at zero, or a KeyError a
    step later), and 30-line tracebacks from the parser."""
    corrupt, words = CORRUPTIONS[case]
    run_dir = _copy(saved, tmp_path)
    corrupt(run_dir)
    with pytest.raises(ck.CheckpointError) as info:
        _resume(comm1, run_dir)
    msg = str(info.value)
    assert "\n" not in msg and words in msg and "rank_0.safetensors" in msg, msg


def test_intact_checkpoint_restores_every_tensor(saved, tmp_path, comm1):
    """The control for the cases above: the same copy, unharmed, restores bit for bit and resumes at step 1."""
    run_dir = _copy(saved, tmp_path)
    tc, trainer, start = _resume(comm1, run_dir)
    assert start == 1 and tc.schedule_steps == 1  # the first run's --steps, not this run's 2
    again = trainer.state_tensors()
    assert set(again) == set(saved[1]) and all(torch.equal(again[k], saved[1][k]) for k in again)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"optimizer": "adamw"}, "optimizer 'muon' in the checkpoint, 'adamw' now"),
        ({"seed": 1}, "seed 0 in the checkpoint, 1 now"),
        ({"balance": "none"}, "balance 'qb' in the checkpoint, 'none' now"),
        ({"cp": 2, "world_size": 2}, "cp 1 in the checkpoint, 2 now"),
        ({"world_size": 2}, "world_size 1 in the checkpoint, 2 now"),
        ({"preset": "small"}, "preset 'tiny' in the checkpoint, 'small' now"),
        ({"schedule_steps": 50}, "schedule_steps 1 in the checkpoint, 50 now"),
    ],
)
def test_changed_flags_on_resume_are_named(saved, change, words):
    """Each differing field is named (both values), before any rank starts: prepare_run is what train() runs."""
    tc = TrainConfig(run_dir=saved[0], resume=True, **{**SMALL, **change})
    with pytest.raises(ck.CheckpointError, match="differs from the checkpointed one") as info:
        prepare_run(tc, tc.world_size)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_reused_run_dir_without_resume_is_refused(saved):
    with pytest.raises(ck.CheckpointError, match="pass --resume to continue it, or choose another --run-dir"):
        prepare_run(TrainConfig(run_dir=saved[0], **SMALL), 1)


@pytest.mark.parametrize("pointer", ["ABS", "../other/checkpoints/step_000001", "step_000001/../../x"])
def test_pointer_outside_its_run_dir_is_never_followed(saved, tmp_path, pointer):
    """latest.json must name a step folder of its own run dir: an absolute path (the old format) or a relative
    escape would resume another run's files."""
    run_dir = _copy(saved, tmp_path)
    path = os.path.join(run_dir, "checkpoints", "latest.json")
    latest = read_json(path)
    latest["dir"] = os.path.join(saved[0], "checkpoints", "step_000001") if pointer == "ABS" else pointer
    write_json(path, latest)
    with pytest.raises(ck.CheckpointError, match="never followed outside its own run folder"):
        prepare_run(TrainConfig(run_dir=run_dir, resume=True, **SMALL), 1)


def test_copied_run_dir_resumes_from_its_own_files(saved, tmp_path, comm1):
    """A copy is a complete run: it resumes from the copy even when the original is damaged."""
    original = _copy(saved, tmp_path / "a")
    copy = str(tmp_path / "b")
    shutil.copytree(original, copy)
    _flip(original)
    tc, trainer, start = _resume(comm1, copy)
    assert start == 1


def test_step_folder_from_another_run_is_refused(saved, tmp_path, comm1):
    """A step folder copied in from another run (same layout, valid checksums) names the two run ids."""
    run_dir = _copy(saved, tmp_path)
    mpath = os.path.join(run_dir, "checkpoints", "step_000001", "manifest.json")
    manifest = read_json(mpath)
    manifest["run_id"] = "0" * 32
    write_json(mpath, manifest)
    with pytest.raises(ck.CheckpointError, match="the files name different runs"):
        _resume(comm1, run_dir)


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda m: m.pop("state"), "state lacks an integer step"),
        (lambda m: m["state"].pop("optimizer_steps"), "state lacks optimizer_steps"),
        (lambda m: m.update(shards=["rank_0.safetensors"]), "shards is not a list of objects"),
        (lambda m: m.update(format=2), "format 2, this reader knows 1"),
    ],
)
def test_malformed_manifest_is_refused(saved, tmp_path, comm1, edit, words):
    """A manifest edited by hand or by another tool: one line, never a KeyError a step later."""
    run_dir = _copy(saved, tmp_path)
    mpath = os.path.join(run_dir, "checkpoints", "step_000001", "manifest.json")
    manifest = read_json(mpath)
    edit(manifest)
    write_json(mpath, manifest)
    with pytest.raises(ck.CheckpointError, match=words):
        _resume(comm1, run_dir)


def test_leftovers_are_cleaned_at_start(saved, tmp_path):
    """Temporary folders, stray temp files and step folders newer than the pointer go; the published step stays."""
    run_dir = _copy(saved, tmp_path)
    base = os.path.join(run_dir, "checkpoints")
    for name in (".tmp-step_000002", "step_000002", "step_000009"):
        os.makedirs(os.path.join(base, name))
    Path(base, "latest.json.tmp.123").touch()
    removed = ck.clean_run_dir(run_dir)
    assert sorted(os.path.basename(p) for p in removed) == [
        ".tmp-step_000002",
        "latest.json.tmp.123",
        "step_000002",
        "step_000009",
    ]
    assert sorted(os.listdir(base)) == ["latest.json", "run.json", "step_000001"]


# ------------------------------------------------------------------------------------- kills, on real ranks
def _two_steps(comm, run_dir: str, kill: str) -> None:
    """Rank body: step 1 published, then step 2 written with ``kill`` (``point:rank``) armed."""
    run = ck.claim_run(run_dir, {"world_size": comm.world_size}) if comm.rank == 0 else None
    comm.barrier()
    for step in (1, 2):
        if step == 2:
            os.environ["MOONEP_CHECKPOINT_KILL"] = kill
        tensors = {"w": torch.full((64,), float(10 * step + comm.rank))}
        ck.save_checkpoint(comm, run_dir, step, tensors, {"step": step}, run)


KILLS = ["shard_partial:1", "shard_written:1", "digests_agreed:0", "manifest_written:0", "renamed:0"]
KILLS.append("latest_written:0")


@pytest.mark.spawns
@pytest.mark.parametrize("kill", KILLS)
def test_kill_at_each_point_of_a_write_leaves_one_whole_step(tmp_path, kill):
    """Every rank's shard after the kill belongs to the same step (1 or 2, whichever the pointer names) and
    passes its checksum; leftovers are cleaned. Would catch a pointer moved before every shard is in, a shard
    written into a published folder, or a rename that publishes half a step."""
    run_dir = str(tmp_path / "run")
    with pytest.raises(LaunchError) as info:
        launch(_two_steps, 2, timeout=20, job_timeout=60, run_dir=run_dir, kill=kill)
    assert f"exited with status {ck.KILL_STATUS}" in info.value.details or info.value.rank is not None
    folder, manifest = ck.read_manifest(run_dir)
    step = manifest["step"]
    assert step == (2 if kill == "latest_written:0" else 1), (kill, step)
    for rank in range(2):
        assert torch.equal(ck.read_shard(folder, manifest, rank)["w"], torch.full((64,), float(10 * step + rank)))
    ck.clean_run_dir(run_dir)
    kept = ["latest.json", "run.json", "step_000001"] + (["step_000002"] if step == 2 else [])
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == kept


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """A 2-rank run of `moonep train` (one step, a small corpus) and the command that made it."""
    from moonep.console import main

    root = tmp_path_factory.mktemp("two")
    run_dir, data = str(root / "run"), root / "text"
    data.mkdir()
    for i in range(40):  # a small corpus: loads in milliseconds
        (data / f"f{i}.txt").write_text(f"hello world {i}\n" * 20)
    base = ["train", "--no-progress", "--data", str(data), "--world-size", "2", "--steps", "1", "--run-dir", run_dir]
    assert main(base, packages=["k3"]) == 0
    return run_dir, base


@pytest.mark.spawns
def test_rank_fault_reaches_the_user_as_one_line_on_every_rank(two_ranks, tmp_path):
    """2 real ranks resume a checkpoint whose rank-1 shard is damaged: every rank raises the same error (rank 0's
    names rank 1 and the file), `moonep train` prints one line with the traceback path and exits 2."""
    from moonep.console import main

    run_dir = str(tmp_path / "run")
    shutil.copytree(two_ranks[0], run_dir)
    _flip(run_dir, rank=1)
    base = two_ranks[1][:-1] + [run_dir]
    rc, err = _cli_err(main, [*base[:-4], "--steps", "2", *base[-2:], "--resume"])
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("error: rank 0: CheckpointError: rank 1: ") and "rank_1.safetensors: sha256" in err
    trace = os.path.join(run_dir, "errors", "rank0.traceback")
    assert f"(traceback: {trace})" in err and "Traceback" in Path(trace).read_text()
    for rank in range(2):  # every rank raised, none was left waiting
        assert read_json(os.path.join(run_dir, "errors", f"rank{rank}.json"))["type"] == "CheckpointError"


def _resume_each_damage(comm, src: str, work: str, cases: list[str]) -> list[str]:
    """Rank body: for each case rank 0 copies the run and damages rank 1's shard, then every rank resumes."""
    seen = []
    train = read_json(os.path.join(src, "train.json"))
    for i, case in enumerate(cases):
        run_dir = os.path.join(work, str(i))
        if comm.rank == 0:
            shutil.copytree(src, run_dir)
            CORRUPTIONS[case][0](run_dir, 1)
        comm.barrier()
        try:
            _start(comm, TrainConfig(**{**train, "run_dir": run_dir, "resume": True, "steps": 2}))
            seen.append("no error")
        except ck.CheckpointError as exc:
            seen.append(str(exc))
    with open(os.path.join(work, f"rank{comm.rank}.json"), "w") as f:
        json.dump(seen, f)
    return seen


@pytest.mark.spawns
def test_every_damage_fails_on_every_rank(two_ranks, tmp_path):
    """Each damaged-shard case on 2 launched ranks, the damage in rank 1's shard only: both ranks raise within
    the timeout (rank 1 its own error, rank 0 the same one naming rank 1), and the job goes on to the next case."""
    cases = list(CORRUPTIONS)
    launch(_resume_each_damage, 2, timeout=30, job_timeout=240, src=two_ranks[0], work=str(tmp_path), cases=cases)
    mine = read_json(tmp_path / "rank1.json")
    peer = read_json(tmp_path / "rank0.json")
    for case, own, seen in zip(cases, mine, peer):
        words = CORRUPTIONS[case][1]
        assert words in own and "rank_1.safetensors" in own and "\n" not in own, (case, own)
        assert seen == f"rank 1: {own}", (case, seen)


def _cli_err(main, argv):
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv, packages=["k3"])
    return rc, err.getvalue()


_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False), st.text("xyz ", max_size=4)
)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.sampled_from(list("abcdef")), _VALUES), st.dictionaries(st.sampled_from(list("abcdef")), _VALUES)
)
def test_identity_problem_names_exactly_the_differing_fields(recorded, current):
    """None iff the identities agree; otherwise one line naming every differing field with both values, and no
    field that agrees."""
    problem = ck.identity_problem(recorded, current)
    differ = sorted(k for k in set(recorded) | set(current) if recorded.get(k) != current.get(k))
    if not differ:
        assert problem is None
        return
    assert "\n" not in problem
    named = [part.split(" ", 1)[0] for part in problem.split("; ")]
    assert named == differ, (problem, differ)


@pytest.mark.spawns
@pytest.mark.slow
def test_training_killed_mid_checkpoint_resumes_the_last_complete_step(two_ranks, tmp_path, monkeypatch):
    """`moonep train --resume` of a 1-step run to 2 steps, killed on rank 0 after the step-2 folder was renamed
    but before the pointer moved: the user gets one line naming the exit; the next resume starts from step 1
    (the unpointed step 2 is removed), recomputes step 1 bit for bit and publishes a whole step 2."""
    from moonep.console import main

    run_dir = str(tmp_path / "run")
    shutil.copytree(two_ranks[0], run_dir)
    argv = two_ranks[1][:-3] + ["2", "--run-dir", run_dir, "--resume"]
    monkeypatch.setenv("MOONEP_CHECKPOINT_KILL", "renamed:0")
    rc, err = _cli_err(main, argv)
    assert rc == 1 and err.count("\n") == 1, err
    assert f"rank 0 failed: exited with status {ck.KILL_STATUS} while running k3.train.run_rank" in err, err
    killed = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert ck.read_manifest(run_dir)[1]["step"] == 1  # the pointer never moved
    monkeypatch.delenv("MOONEP_CHECKPOINT_KILL")
    rc, err = _cli_err(main, argv)
    assert rc == 0, err
    again = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in again] == [0, 1] and again[1]["loss"] == killed[1]["loss"]
    folder, manifest = ck.read_manifest(run_dir)
    assert manifest["step"] == 2 and all(ck.read_shard(folder, manifest, r) for r in range(2))
