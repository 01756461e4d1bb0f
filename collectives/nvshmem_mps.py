"""The check NVSHMEM's bootstrap runs before ``nvshmem.init``: PEs that share a GPU need CUDA MPS set up for it.

Several PEs on one GPU need CUDA MPS: without it NVSHMEM falls back to a limited mode in which ``signal_wait`` is
unsupported, and the process exits at the first one (no Python error, no cleanup). NVSHMEM's init also picks the
limited mode when the PEs on a GPU have MPS active thread percentages adding up to more than 100 (each is
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, else the MPS server's, 100 by default) unless
``NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` is set. So before ``nvshmem.init`` the ranks gather which GPU
each uses (host and GPU UUID) and what MPS looks like where it runs; when PEs share a GPU in a way NVSHMEM only
serves in the limited mode, every rank raises a ``RuntimeError`` naming the GPU, the PE count and the fix
(``nvidia-cuda-mps-control -d``, or the percentage), rather than some ranks exiting and the others hanging.

MPS detection (``mps_state``) asks what the CUDA driver and NVSHMEM ask. First the CUDA driver's test: at CUDA
initialisation a client connects to the MPS control daemon through ``$CUDA_MPS_PIPE_DIRECTORY/control`` (default
``/tmp/nvidia-mps``; a UNIX-domain socket on current drivers, a named pipe on old ones) and runs without MPS when
that fails; a socket is probed with a connect, so a stale one left by a killed daemon reads as inactive. Then
NVSHMEM's own test: ``echo get_server_list | nvidia-cuda-mps-control`` must list a server (a server exists once a
client has attached), and ``get_active_thread_percentage <pid>`` gives the server's percentage. The daemon must
have been running when this process initialised CUDA (clients attach then): start it before the job.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import socket
import stat
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from collectives.base import Communicator

MPS_DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"  # the MPS daemon's and clients' default CUDA_MPS_PIPE_DIRECTORY
_TRUE = ("1", "y", "yes", "t", "true", "on")


@dataclass(frozen=True)
class MpsState:
    """What NVSHMEM will find about CUDA MPS in this process (``mps_state``)."""

    active: bool  # an MPS server serves this user: NVSHMEM's own test
    found: str  # what was found, for error messages
    thread_percentage: float = 100.0  # this PE's MPS active thread percentage (MPS default: 100)


def mps_control_path(env: Mapping[str, str]) -> str:
    """Where CUDA clients look for the MPS control daemon: ``$CUDA_MPS_PIPE_DIRECTORY/control``."""
    return os.path.join(env.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE_DIR, "control")


def _accepts_connections(path: str) -> bool | None:
    """True when something listens on the UNIX socket ``path``, False when nothing does (a stale socket) or we may
    not connect (neither may CUDA then), None when it cannot be probed (e.g. a path too long for AF_UNIX)."""
    for kind in (socket.SOCK_SEQPACKET, socket.SOCK_STREAM):  # current daemons listen on SEQPACKET
        with socket.socket(socket.AF_UNIX, kind) as sock:
            sock.settimeout(1.0)
            try:
                sock.connect(path)
                return True  # closed at once without a command, as an MPS client that exits early would
            except (ConnectionRefusedError, FileNotFoundError, PermissionError):
                return False
            except OSError as exc:
                if exc.errno != errno.EPROTOTYPE:  # EPROTOTYPE: wrong socket type, try the other one
                    return None
    return None


def mps_daemon(env: Mapping[str, str]) -> tuple[bool, str]:
    """(up, what was found): whether an MPS control daemon answers where CUDA clients look for it."""
    path = mps_control_path(env)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False, f"no MPS control socket at {path}"
    except OSError as exc:
        return False, f"cannot read {path} ({exc})"
    if stat.S_ISFIFO(mode):  # old drivers: a named pipe; probing it would mean writing to the daemon's input
        return True, f"MPS control pipe at {path}"
    if not stat.S_ISSOCK(mode):
        return False, f"{path} is neither a socket nor a named pipe"
    listening = _accepts_connections(path)
    if listening is False:
        return False, f"stale MPS control socket at {path} (no daemon accepts connections on it)"
    return True, f"MPS control daemon at {path}" + ("" if listening else " (present; could not be probed)")


def mps_control(command: str, env: Mapping[str, str]) -> str | None:
    """Output of ``echo <command> | nvidia-cuda-mps-control`` (how NVSHMEM asks), None when that fails."""
    exe = shutil.which("nvidia-cuda-mps-control", path=env.get("PATH"))
    if exe is None:
        return None
    try:
        done = subprocess.run([exe], input=command + "\n", capture_output=True, text=True, timeout=10, env=dict(env))
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def mps_state(
    env: Mapping[str, str] | None = None, control: Callable[[str, Mapping[str, str]], str | None] | None = None
) -> MpsState:
    """CUDA MPS as NVSHMEM's init will see it (module docstring); ``env`` defaults to ``os.environ``, ``control``
    to ``mps_control``. Pure but for the filesystem and ``control``: tests pass a tmp ``CUDA_MPS_PIPE_DIRECTORY``
    and a fake control."""
    env = os.environ if env is None else env
    control = mps_control if control is None else control
    up, found = mps_daemon(env)
    if not up:
        return MpsState(False, found)
    servers = control("get_server_list", env)
    if servers is None:
        return MpsState(
            False,
            f"{found}, but `nvidia-cuda-mps-control` is not on PATH or failed, and NVSHMEM "
            f"asks it for the MPS server list",
        )
    pids = servers.split()
    if not pids:
        return MpsState(
            False,
            f"{found}, but it runs no MPS server: this process is no MPS client (was the "
            f"daemon started after CUDA was, or with another CUDA_MPS_PIPE_DIRECTORY?)",
        )
    percentage = env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")  # a client's own limit wins, as in NVSHMEM
    if not percentage:
        answer = control(f"get_active_thread_percentage {pids[-1]}", env)
        percentage = answer.strip() if answer and answer.strip() else "100"
    try:
        value = float(percentage)
    except ValueError:
        value = 100.0
    return MpsState(True, f"{found}, MPS server {pids[-1]}", value)


def _group_problem(rows: Sequence[Sequence[int]], members: list[int]) -> str | None:
    """Why NVSHMEM would serve the PEs ``members`` (all on one GPU) only in its limited mode: "mps" (a member has
    no MPS), "percentage" (their thread percentages add up to more than 100, not ignored by all), else None."""
    if len(members) < 2:
        return None
    if not all(int(rows[m][1]) for m in members):
        return "mps"
    over = sum(int(rows[m][3]) for m in members) > 100_000
    return "percentage" if over and not all(int(rows[m][4]) for m in members) else None


def shared_gpu_error(rows: Sequence[Sequence[int]], rank: int, gpu: str, found: str) -> str | None:
    """The error for ``rank`` when PEs share a GPU in a way NVSHMEM serves only in its limited mode, else None.

    ``rows[r] = (gpu key, MPS active 0/1, CUDA device, active thread percentage x 1000, ignore-percentage 0/1)``
    for every rank r; ``gpu`` names this rank's GPU, ``found`` what ``mps_state`` found here. A GPU shared by
    several PEs needs MPS on all of them, and their thread percentages must add up to at most 100 unless each
    sets NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (NVSHMEM's init applies the same rule). Ranks whose
    GPU is fine name the others, so the whole job stops with one story instead of ranks exiting in NVSHMEM.
    """
    keys = [int(r[0]) for r in rows]
    groups = {k: [r for r, kk in enumerate(keys) if kk == k] for k in keys}
    problems = {k: _group_problem(rows, members) for k, members in groups.items()}
    bad = [r for r, k in enumerate(keys) if problems[k]]
    if not bad:
        return None
    mates, problem = groups[keys[rank]], problems[keys[rank]]
    head = f"{len(mates)} PEs (ranks {', '.join(map(str, mates))}) share GPU {gpu}"
    limited = (
        "NVSHMEM would run in its limited mode, in which signal_wait is unsupported and the process exits "
        "at the first one"
    )
    if problem == "mps" and not int(rows[rank][1]):
        return (
            f"NVSHMEM needs CUDA MPS: {head}, but MPS is not running ({found}); {limited}. Start the MPS "
            f"control daemon on this host before the job: `nvidia-cuda-mps-control -d` (with the job's "
            f"CUDA_MPS_PIPE_DIRECTORY, if set; stop it with `echo quit | nvidia-cuda-mps-control`), or give "
            f"each PE its own GPU."
        )
    if problem == "percentage":
        total = sum(int(rows[m][3]) for m in mates) / 1000
        return (
            f"NVSHMEM needs the MPS active thread percentages of PEs sharing a GPU to add up to at most 100: "
            f"{head} with {total:g}% in all (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, MPS default 100 each); "
            f"{limited}. Set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={100 // len(mates)} for every rank before "
            f"CUDA starts, or NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1 (NVSHMEM warns its "
            f"synchronizing calls may then deadlock)."
        )
    return (
        f"NVSHMEM not started: rank(s) {', '.join(map(str, bad))} share a GPU with other PEs without CUDA MPS "
        f"set up for NVSHMEM (see their error; start MPS with `nvidia-cuda-mps-control -d`)"
    )


def _gpu_key(device: int) -> int:
    """A 63-bit id of (this host, the physical GPU behind CUDA ``device``), equal across ranks that share it.
    The UUID, not the index: CUDA_VISIBLE_DEVICES may differ between ranks on one host."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    gpu = str(uuid) if uuid is not None else f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}/{device}"
    digest = hashlib.blake2b(f"{socket.gethostname()}|{gpu}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def require_mps_if_shared(bootstrap: Communicator, device: int) -> None:
    """Raise (on every rank together) when PEs share a GPU without MPS set up for NVSHMEM; collective. Call it
    once this process has its CUDA context: an MPS server appears in the daemon's list when a client attaches."""
    state = mps_state()
    ignore = os.environ.get("NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "").strip().lower() in _TRUE
    mine = torch.tensor(
        [[_gpu_key(device), int(state.active), device, round(state.thread_percentage * 1000), int(ignore)]],
        dtype=torch.int64,
    )
    rows = torch.empty(bootstrap.world_size, mine.shape[1], dtype=torch.int64)
    bootstrap._all_gather(rows, mine, bootstrap.timeout)  # host tensors: gloo under torch, or MPI
    gpu = f"cuda:{device} ({torch.cuda.get_device_name(device)}, host {socket.gethostname()})"
    message = shared_gpu_error(rows.tolist(), bootstrap.rank, gpu, state.found)
    if message:
        raise RuntimeError(message)
