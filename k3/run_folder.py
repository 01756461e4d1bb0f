"""What a run does with its folder before it trains: check it (``prepare_run``) and lock it (one run at a time).

``prepare_run`` reads the folder (pure: every rank reaches the same verdict) against the run's identity
(``IDENTITY_FIELDS`` and the world size), which a resume must match.

The lock: rank 0 holds an exclusive ``fcntl.flock`` on ``<run>/.lock`` for the life of a run, taken before the
run is claimed or resumed (``lock_run``); the file's JSON body names the holder (``run_id``, ``pid``, ``host``,
``started``). A second run into the folder is refused on every rank, naming the first run. The kernel drops a
flock when its process dies, so a lock file that nobody holds is stale and is taken over, except when its body
names another host (a flock over a shared filesystem may not reach this machine, so whether that run still runs
cannot be told here, and the error says so: remove the file once that run is known to be gone) or a live process
on this host (a filesystem where flock does nothing). A clean end empties the body, which leaves nothing stale.
The body is rewritten in place: a rename would swap the inode the flock is on.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import socket
import time
import uuid
from typing import TYPE_CHECKING

from k3.checkpoint import CheckpointError, agree, check_run_dir, read_latest, read_run
from k3.train_config import TrainConfig

if TYPE_CHECKING:
    from collectives.base import Communicator

IDENTITY_FIELDS = (
    "preset", "optimizer", "seed", "balance", "cp", "schedule_steps", "lr", "warmup", "weight_decay",
    "grad_clip", "qk_clip_tau", "seq_len", "global_batch", "data", "max_data_bytes",
)  # fmt: skip
"""TrainConfig fields that decide the numbers: a resume must match the checkpointed run on each (and world size)."""


def prepare_run(tc: TrainConfig, world_size: int) -> tuple[TrainConfig, dict | None]:
    """Check the run folder against ``tc`` (pure file reads: every rank reaches the same verdict) and fix the
    schedule length: the checkpointed run's when resuming, else ``steps``. Returns (tc, run.json to resume or
    None). CheckpointError (one line): a checkpointed folder without ``resume``, or identity differences."""
    recorded = read_run(tc.run_dir) if tc.resume else None
    if tc.schedule_steps is None:
        known = (recorded or {}).get("identity", {}).get("schedule_steps") if read_latest(tc.run_dir) else None
        tc = dataclasses.replace(tc, schedule_steps=known or tc.steps)
    run = check_run_dir(tc.run_dir, identity(tc, world_size), tc.resume)
    return tc, run


def metrics_file(run_dir: str, start: int) -> str:
    """metrics.jsonl with every line of steps >= start dropped (a resumed run rewrites them)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    keep = []
    if os.path.exists(path):
        with open(path) as f:
            keep = [line for line in f if line.strip() and json.loads(line)["step"] < start]
    with open(path, "w") as f:
        f.writelines(keep)
    return path


def identity(tc: TrainConfig, world_size: int) -> dict:
    """What a checkpoint must agree on to be resumed by ``tc`` (``IDENTITY_FIELDS`` and the world size)."""
    return {"world_size": world_size, **{k: getattr(tc, k) for k in IDENTITY_FIELDS}}


LOCK_FILE = ".lock"
"""The lock file's name inside the run folder."""


class RunLock:
    """The run folder's lock as this process holds it (``file`` None: not held, as on every rank but 0)."""

    def __init__(self, file=None, run_id: str | None = None) -> None:
        self.file = file
        """The open lock file (closing it drops the flock; the garbage collector closes a forgotten one)."""
        self.run_id = run_id
        """The run id recorded in the lock (a fresh run claims its folder under this id)."""

    def release(self) -> None:
        """A clean end: empty the body, then drop the flock by closing the file. Idempotent."""
        file, self.file = self.file, None
        if file is not None:
            try:
                file.truncate(0)
                file.flush()
            finally:
                file.close()


def read_holder(file) -> dict:
    """The lock file's body; {} when empty or unreadable (a clean end, or a holder still writing it)."""
    try:
        body = json.loads(os.pread(file.fileno(), 1 << 16, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def describe(holder: dict) -> str:
    """``run <id> (pid P on host H, started T)`` for error messages."""
    if not holder:
        return "another run (its lock record is not written yet)"
    where = f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"
    return f"run {holder.get('run_id')} ({where})"


def _alive(pid) -> bool:
    """Whether ``pid`` is another live process on this host (this process's own record, as in a copied folder,
    is not another run)."""
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def acquire_run_lock(run_dir: str, run_id: str | None = None) -> RunLock:
    """Take ``<run_dir>/.lock`` (exclusive, never waiting) and record this process in it (``run_id``: a new one
    when None). CheckpointError naming the holder's run id, pid and host when another run holds it, or when a
    lock nobody holds was left by a run on another host or names a live process here; a dead run's lock on this
    host is taken over."""
    path = os.path.join(run_dir, LOCK_FILE)
    try:
        os.makedirs(run_dir, exist_ok=True)
        file = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+b", buffering=0)  # opening keeps the body
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open the run lock ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(
                f"{path}: the run folder is in use by {describe(read_holder(file))}: wait for it to end or choose "
                f"another --run-dir"
            ) from None
        old, host = read_holder(file), socket.gethostname()
        if old and old.get("host") != host:
            raise CheckpointError(
                f"{path}: left unreleased by {describe(old)}, another machine than this one ({host}): whether that "
                f"run still runs cannot be told from here; if it does not, remove {path}"
            )
        if old and _alive(old.get("pid")):
            raise CheckpointError(
                f"{path}: not locked, yet it names {describe(old)}, a live process on this host (a filesystem "
                f"without flock, or its pid reused): if that is no run, remove {path}"
            )
        run_id = run_id or uuid.uuid4().hex
        body = {"run_id": run_id, "pid": os.getpid(), "host": host, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        file.truncate(0)
        os.pwrite(file.fileno(), json.dumps(body).encode(), 0)
        os.fsync(file.fileno())
    except BaseException:
        file.close()
        raise
    return RunLock(file, run_id)


def lock_run(comm: Communicator, run_dir: str, run_id: str | None) -> RunLock:
    """Collective: rank 0 takes the run folder's lock; when it cannot, every rank raises rank 0's error."""
    lock, problem = RunLock(), None
    if comm.rank == 0:
        try:
            lock = acquire_run_lock(run_dir, run_id)
        except (CheckpointError, OSError) as exc:  # OSError: writing the record failed (a full disk)
            problem = str(exc)
    agree(comm, problem)
    return lock


def check_run_lock(run_dir: str) -> None:
    """Before any rank starts: ``acquire_run_lock``'s verdict on an existing lock file, which is left released
    (a stale one taken over and emptied). Creates nothing where there is no lock file."""
    if os.path.exists(os.path.join(run_dir, LOCK_FILE)):
        acquire_run_lock(run_dir).release()


__all__ = [
    "IDENTITY_FIELDS",
    "LOCK_FILE",
    "RunLock",
    "acquire_run_lock",
    "check_run_lock",
    "identity",
    "lock_run",
    "prepare_run",
    "read_holder",
]
