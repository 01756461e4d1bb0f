"""Checkpoints that know their run and prove their bytes: per-rank safetensors shards, JSON manifests, sha256.

Layout of ``<run>/checkpoints/``::

    run.json              {"run_id", "config_hash", "identity"}: written when a fresh run starts
    latest.json           {"run_id", "step", "dir": "step_000012"}: the newest published step, RELATIVE to here
    step_000012/          one published step (never written into again)
        manifest.json     {"format", "run_id", "config_hash", "step", "world_size", "state", "shards": [...]}
        rank_R.safetensors
    .tmp-step_000012/     a step being written (removed at the next start if a crash left it)

Write sequence (``save_checkpoint``, collective): every rank writes its shard into the temporary folder
(``.part`` file, fsync, rename) and hashes it; one all-gather hands every shard's sha256 and size to every rank
(so no rank goes on before every shard is complete); rank 0 writes the manifest, renames the folder to its
final name (the one atomic publish), then moves ``latest.json``; a barrier ends the call. A crash at any point
leaves either the previous step as ``latest`` with a stray folder that ``clean_run_dir`` removes, or the new
step fully published: never a mix. ``MOONEP_CHECKPOINT_KILL=<point>:<rank>`` ends that rank with
``os._exit(KILL_STATUS)`` at ``point`` (one of ``KILL_POINTS``): the fault injection the tests use.

Loading (``read_checkpoint``) follows ``latest.json`` only inside its own folder, checks that the pointer, the
manifest and ``run.json`` name the same run and step, and checks the shard's size and sha256 before parsing it.
Every problem is a ``CheckpointError`` (a ``ValueError``) with one line naming the file and what is wrong.
Nothing is pickled; torch.distributed.checkpoint is not used (its ``.metadata`` file is a pickle).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from moonep_base import write_json

if TYPE_CHECKING:
    from collectives.base import Communicator

FORMAT = 1
"""Manifest format version (a manifest of another version is refused, not guessed at)."""
KILL_POINTS = ("shard_partial", "shard_written", "digests_agreed", "manifest_written", "renamed", "latest_written")
"""Where ``MOONEP_CHECKPOINT_KILL`` may end a rank, in write order (the last three happen on rank 0 only)."""
KILL_STATUS = 86
"""Exit status of an injected kill (any nonzero status would do; this one is easy to spot)."""
STEP_DIR = re.compile(r"step_\d{6,}")
_DIGEST = 40  # sha256 (32 bytes) + size (8 bytes, little-endian) per rank in the all-gather


class CheckpointError(ValueError):
    """A checkpoint or run folder that cannot be trusted; the message is one line naming the file and the fault."""


def root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def config_hash(identity: dict) -> str:
    """sha256 of the identity's canonical JSON (first 16 hex digits)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _read_json(path: str, what: str) -> dict | None:
    """The JSON object at ``path``, None when absent; CheckpointError when it is not a JSON object."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: {what} is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object")
    return obj


def read_run(run_dir: str) -> dict | None:
    """``run.json`` (the run's id and identity), None for a folder no run has claimed."""
    run = _read_json(os.path.join(root(run_dir), "run.json"), "the run record")
    if run is not None and not {"run_id", "config_hash", "identity"} <= set(run):
        raise CheckpointError(f"{os.path.join(root(run_dir), 'run.json')}: run record lacks run_id/identity")
    return run


def read_latest(run_dir: str) -> dict | None:
    """``latest.json``, checked to name a step folder inside this run's checkpoints (relative, no ``..``)."""
    path = os.path.join(root(run_dir), "latest.json")
    latest = _read_json(path, "the checkpoint pointer")
    if latest is None:
        return None
    name = latest.get("dir")
    if not isinstance(name, str) or not STEP_DIR.fullmatch(name):
        raise CheckpointError(
            f"{path}: names {name!r}, not a step folder inside {root(run_dir)} (a pointer from another run or "
            f"an older format; it is never followed outside its own run folder)"
        )
    if not isinstance(latest.get("step"), int) or "run_id" not in latest:
        raise CheckpointError(f"{path}: checkpoint pointer lacks its step or run id")
    return latest


def identity_problem(recorded: dict, current: dict) -> str | None:
    """One line naming every field of the run's identity that differs (None when they agree)."""
    diffs = [
        f"{k} {recorded.get(k)!r} in the checkpoint, {current.get(k)!r} now"
        for k in sorted(set(recorded) | set(current))
        if recorded.get(k) != current.get(k)
    ]
    return "; ".join(diffs) or None


def _nothing_to_resume(run_dir: str) -> str:
    """The one line for ``--resume`` of a folder that holds no checkpoint (or does not exist)."""
    if not os.path.isdir(run_dir):
        return f"--resume: run folder {run_dir} does not exist (nothing to resume)"
    pointer = os.path.join(root(run_dir), "latest.json")
    return f"--resume: run folder {run_dir} holds no checkpoint (no {pointer}); drop --resume to start afresh there"


def check_run_dir(run_dir: str, identity: dict, resume: bool) -> dict | None:
    """Pure check before anything starts (every rank reaches the same verdict from the same files).

    Returns ``run.json`` when there is a checkpoint to resume, None for a fresh start. CheckpointError: a
    ``resume`` of a folder without a checkpoint, a checkpointed folder reused without ``resume``, or a resume
    whose identity (world size, preset, optimizer, seed, balance, CP, schedule, ...) differs from the
    checkpointed run's, naming each difference.
    """
    latest, run = read_latest(run_dir), read_run(run_dir)
    if latest is None and resume:  # asked to continue: a mistyped --run-dir must not silently train from scratch
        raise CheckpointError(_nothing_to_resume(run_dir))
    if latest is None:
        return None
    if run is None:
        raise CheckpointError(f"{root(run_dir)}: latest.json exists but run.json does not (not a run folder)")
    if latest["run_id"] != run["run_id"]:
        raise CheckpointError(
            f"{root(run_dir)}: latest.json belongs to run {latest['run_id']}, run.json to {run['run_id']}"
        )
    if not resume:
        raise CheckpointError(
            f"run folder {run_dir} already holds run {run['run_id']} (checkpoint at step {latest['step']}): "
            f"pass --resume to continue it, or choose another --run-dir"
        )
    problem = identity_problem(run["identity"], identity)
    if problem:
        raise CheckpointError(f"resume {run_dir}: this run differs from the checkpointed one: {problem}")
    return run


def clean_run_dir(run_dir: str) -> list[str]:
    """Remove what a crash can leave (rank 0, at start, before any rank writes): temporary step folders, stray
    temporary files, and published step folders newer than ``latest.json`` (their pointer never moved)."""
    base = root(run_dir)
    if not os.path.isdir(base):
        return []
    latest = read_latest(run_dir)
    newest = -1 if latest is None else latest["step"]
    removed = []
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        stale = name.startswith(".tmp-") or ".tmp." in name
        stale = stale or (STEP_DIR.fullmatch(name) is not None and int(name[5:]) > newest)
        if stale:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            removed.append(path)
    return removed


def claim_run(run_dir: str, identity: dict, run_id: str | None = None) -> dict:
    """Rank 0 of a fresh run: its id (the run lock's; a new one when None) and the identity into ``run.json``
    (replacing an unused claim)."""
    run = {"run_id": run_id or uuid.uuid4().hex, "config_hash": config_hash(identity), "identity": identity}
    write_json(os.path.join(root(run_dir), "run.json"), run)
    return run


# ------------------------------------------------------------------------------------------------- writing
def _kill_here(point: str, rank: int) -> bool:
    """Fault injection: True when ``MOONEP_CHECKPOINT_KILL`` names this point and rank."""
    spec = os.environ.get("MOONEP_CHECKPOINT_KILL", "")
    return spec == f"{point}:{rank}"


def _maybe_kill(point: str, rank: int) -> None:
    if _kill_here(point, rank):
        os._exit(KILL_STATUS)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_shard(folder: str, rank: int, tensors: dict[str, torch.Tensor]) -> bytes:
    """This rank's shard into ``folder`` (``.part``, fsync, rename); returns sha256 (32 bytes) + size (8 bytes)."""
    data = save_bytes({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    final = os.path.join(folder, f"rank_{rank}.safetensors")
    part = f"{final}.part"
    with open(part, "wb") as f:
        if _kill_here("shard_partial", rank):  # a kill in the middle of the write: half a file under .part
            f.write(data[: len(data) // 2])
            f.flush()
            os._exit(KILL_STATUS)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, final)
    return hashlib.sha256(data).digest() + len(data).to_bytes(8, "little")


def save_checkpoint(
    comm: Communicator, run_dir: str, step: int, tensors: dict[str, torch.Tensor], state: dict, run: dict
) -> str:
    """Collective: publish step ``step`` (every rank's ``tensors``, rank 0's ``state``) for ``run`` (``run.json``).

    Returns the published folder. The sequence and its crash guarantees are in the module docstring.
    """
    base, name = root(run_dir), f"step_{step:06d}"
    tmp, final = os.path.join(base, f".tmp-{name}"), os.path.join(base, name)
    os.makedirs(tmp, exist_ok=True)
    mine = torch.frombuffer(bytearray(_write_shard(tmp, comm.rank, tensors)), dtype=torch.uint8)
    _maybe_kill("shard_written", comm.rank)
    digests = torch.zeros(comm.world_size, _DIGEST, dtype=torch.uint8)
    comm.all_gather(digests, mine.view(1, _DIGEST))  # every shard is complete once this returns
    _maybe_kill("digests_agreed", comm.rank)
    if comm.rank == 0:
        shards = [
            {
                "file": f"rank_{r}.safetensors",
                "sha256": bytes(digests[r, :32].tolist()).hex(),
                "bytes": int.from_bytes(bytes(digests[r, 32:].tolist()), "little"),
            }
            for r in range(comm.world_size)
        ]
        manifest = {"format": FORMAT, "run_id": run["run_id"], "config_hash": run["config_hash"], "step": step}
        manifest.update(world_size=comm.world_size, state=state, shards=shards)
        write_json(os.path.join(tmp, "manifest.json"), manifest)
        _maybe_kill("manifest_written", 0)
        if os.path.exists(final):  # published earlier but never pointed to (clean_run_dir removes these too)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(base)
        _maybe_kill("renamed", 0)
        write_json(os.path.join(base, "latest.json"), {"run_id": run["run_id"], "step": step, "dir": name})
        _maybe_kill("latest_written", 0)
    comm.barrier()
    return final


# ------------------------------------------------------------------------------------------------- reading
def read_manifest(run_dir: str) -> tuple[str, dict] | None:
    """(folder, manifest) of the step ``latest.json`` names, checked against ``run.json``; None when none."""
    latest, run = read_latest(run_dir), read_run(run_dir)
    if latest is None:
        return None
    folder = os.path.join(root(run_dir), latest["dir"])
    mpath = os.path.join(folder, "manifest.json")
    manifest = _read_json(mpath, "the manifest")
    if manifest is None:
        raise CheckpointError(f"{mpath}: missing (latest.json points to an incomplete step)")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: format {manifest.get('format')!r}, this reader knows {FORMAT}")
    ids = {"run.json": None if run is None else run["run_id"], "latest.json": latest["run_id"]}
    ids["manifest"] = manifest.get("run_id")
    if len(set(ids.values())) != 1:
        raise CheckpointError(f"{mpath}: the files name different runs: {ids}")
    if manifest.get("step") != latest["step"] or run["config_hash"] != manifest.get("config_hash"):
        raise CheckpointError(f"{mpath}: step or config hash differs from latest.json / run.json")
    state, shards = manifest.get("state"), manifest.get("shards")
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{mpath}: state lacks an integer step")
    if not isinstance(shards, list) or not all(isinstance(e, dict) for e in shards):
        raise CheckpointError(f"{mpath}: shards is not a list of objects")
    return folder, manifest


def read_shard(folder: str, manifest: dict, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors, after checking the shard's size and sha256 against the manifest."""
    shards = manifest.get("shards")
    if not isinstance(shards, list) or len(shards) != manifest.get("world_size") or rank >= len(shards):
        raise CheckpointError(
            f"{folder}: manifest lists {len(shards or [])} shard(s) for world size "
            f"{manifest.get('world_size')}; rank {rank} has none"
        )
    entry = shards[rank]
    if entry.get("file") != f"rank_{rank}.safetensors":
        raise CheckpointError(f"{folder}: manifest names {entry.get('file')!r} for rank {rank}")
    path = os.path.join(folder, entry["file"])
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: shard missing")
    with open(path, "rb") as f:
        data = f.read()
    if len(data) != entry.get("bytes"):
        raise CheckpointError(
            f"{path}: {len(data)} bytes, the manifest says {entry.get('bytes')} (truncated or replaced)"
        )
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise CheckpointError(f"{path}: sha256 differs from the manifest (the file changed after it was written)")
    try:
        return load_bytes(data)
    except Exception as exc:  # safetensors raises its own error types on a bad header
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(exc).__name__})") from None


def check_tensors(path: str, tensors: dict[str, torch.Tensor], expected: dict[str, tuple]) -> None:
    """Strict: exactly the ``expected`` names (name -> (shape, dtype)), each with its shape and dtype."""
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"{path}: {len(missing)} tensor(s) missing {missing[:3]}, {len(extra)} unexpected {extra[:3]} "
            f"(a checkpoint of another model, optimizer or rank)"
        )
    for name, (shape, dtype) in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise CheckpointError(f"{path}: {name} is {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}")


def agree(comm: Communicator, problem: str | None, width: int = 480) -> None:
    """Collective: raise the same CheckpointError on every rank when any rank has a problem (the lowest rank's,
    named), so a fault in one rank's shard never leaves its peers training or waiting."""
    mine = torch.zeros(1, width, dtype=torch.uint8)
    if problem:
        raw = problem.encode()[: width - 1] or b"?"
        mine[0, : len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    everyone = torch.zeros(comm.world_size, width, dtype=torch.uint8)
    comm.all_gather(everyone, mine)
    for r in range(comm.world_size):
        text = bytes(everyone[r].tolist()).rstrip(b"\0").decode(errors="replace")
        if text:
            raise CheckpointError(text if r == comm.rank else f"rank {r}: {text}")


__all__ = [
    "CheckpointError",
    "KILL_POINTS",
    "agree",
    "check_run_dir",
    "check_tensors",
    "claim_run",
    "clean_run_dir",
    "config_hash",
    "read_manifest",
    "read_run",
    "read_shard",
    "save_checkpoint",
]
