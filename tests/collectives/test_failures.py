"""A rank that raises or dies must fail the whole job quickly, naming that rank: never a hang."""

import os
import signal
import time

import pytest
import torch

from collectives import CollectiveError, LaunchError, launch
from collectives.launch_reports import failure
from collectives.warm_start import PRELOAD_ENV
from moonep_base import build_parser, run
from tests.collectives.conftest import needs_mpi


def raise_on_rank_1(comm):
    if comm.rank == 1:
        raise KeyError("boom from rank one")
    t = torch.ones(3)
    comm.all_reduce(t)  # rank 0 waits here for a peer that is gone
    return "unreachable"


def killed_rank_1(comm):
    comm.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(3)
    comm.all_reduce(t)
    comm.barrier()
    return "unreachable"


def survivor_names_failed_peer(comm):
    """Rank 1 reports a failure but stays alive (as under torchrun); rank 0's timeout must name it."""
    if comm.rank == 1:
        comm.report_failure("ValueError: bad batch on rank one")
        time.sleep(4)
        return None
    try:
        comm.all_reduce(torch.ones(2), timeout=1.5)
    except CollectiveError as exc:
        return str(exc), list(exc.failed_ranks)
    return "no error"


@pytest.mark.parametrize("backend", ["torch", "mpi"])
@pytest.mark.spawns
def test_rank_that_raises_is_named(backend):
    if backend == "mpi":
        needs_mpi()
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(raise_on_rank_1, 3, backend=backend, timeout=20, job_timeout=60)
    assert info.value.rank == 1
    assert "boom from rank one" in info.value.details and "KeyError" in info.value.details
    assert time.monotonic() - t0 < 20, "the job should end at the failure, not at the collective timeout"


@pytest.mark.parametrize("backend", ["torch", "mpi"])
@pytest.mark.spawns
def test_killed_rank_is_named(backend):
    if backend == "mpi":
        needs_mpi()
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(killed_rank_1, 2, backend=backend, timeout=20, job_timeout=60)
    assert info.value.rank == 1, str(info.value)
    if backend == "torch":
        assert "SIGKILL" in info.value.details
    assert time.monotonic() - t0 < 20


def _launch_command(commands, bench) -> None:
    """A command line whose handler launches a job: rank 1 raises (``raise``) or is killed (``kill``)."""
    p = commands.add_parser("job")
    p.add_argument("how", choices=["raise", "kill"])
    fn = {"raise": raise_on_rank_1, "kill": killed_rank_1}
    p.set_defaults(func=lambda args: launch(fn[args.how], 2, timeout=20, job_timeout=60) and 0)


@pytest.mark.spawns
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_command_whose_rank_fails_prints_the_rank_report_not_the_launcher(capsys, how):
    """Catches: a rank OOM-killed under a command line (``moonep bench ...``) ending in the launcher's own
    traceback, with no word on why a process gets SIGKILL. The rank's report is what is printed, exit 1."""
    parser = build_parser([_launch_command], prog="t")
    assert run(parser, ["job", how]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: rank 1 failed:\n") and "launch(" not in err, err
    if how == "raise":  # the rank's own traceback is the useful part: it stays
        assert "KeyError: 'boom from rank one'" in err and "raise_on_rank_1" in err, err
    else:
        assert "killed by signal SIGKILL (usually the kernel's out-of-memory killer" in err, err


@pytest.mark.spawns
def test_survivor_timeout_names_failed_rank():
    message, failed = launch(survivor_names_failed_peer, 2, timeout=20, job_timeout=60)
    assert failed == [1]
    assert "rank 1 failed: ValueError: bad batch on rank one" in message


def test_launch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        launch(raise_on_rank_1, 0)
    with pytest.raises(ValueError, match="backend"):
        launch(raise_on_rank_1, 2, backend="carrier-pigeon")
    for timeout in (0, float("nan"), float("inf"), 1e300, True):  # inf and 1e300 were gloo tracebacks on each rank
        with pytest.raises(ValueError, match=r"timeout must be a number of seconds in \(0, 31536000\]"):
            launch(raise_on_rank_1, 2, timeout=timeout)


def stalled_rank_1(comm):
    if comm.rank == 1:
        time.sleep(8)  # alive but never joins the collective
        return None
    comm.all_reduce(torch.ones(1), timeout=1.0)
    return "unreachable"


@pytest.mark.parametrize("backend", ["torch", "mpi"])
@pytest.mark.spawns
@pytest.mark.solo  # 7.5 s tells the 1 s timeout from the 8 s stall, start-up included: a busy host blurs it
def test_stalled_peer_times_out_with_named_op(backend):
    """A collective whose peer never arrives ends at its timeout (torch: CollectiveError; MPI: the watchdog
    aborts the job), with a message naming the op: never a hang."""
    if backend == "mpi":
        needs_mpi()
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(stalled_rank_1, 2, backend=backend, timeout=30, job_timeout=60)
    assert time.monotonic() - t0 < 7.5, "must end at the 1 s timeout, not when the stalled rank wakes up"
    details = info.value.details
    assert "all_gather" in details or "all_reduce" in details  # the header exchange or the reduction itself
    assert ("within its 1s timeout" in details) or ("no answer within its 1s timeout" in details), details


@pytest.mark.spawns
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
@pytest.mark.parametrize("start", ["spawn", "warm"])
def test_a_killed_launcher_leaves_no_ranks_behind(tmp_path, start, how):
    """Killing the launching process (SIGTERM, or SIGKILL that it cannot handle) takes its ranks down with it,
    spawned or warm from a forkserver (``collectives.warm_start``: the forkserver exits with the launcher)."""
    import subprocess
    import sys

    script = tmp_path / "hang.py"
    pids = tmp_path / "pids"
    pids.mkdir()
    script.write_text(
        "import os, sys, time\n"
        "from collectives import launch\n"
        "def hang(comm, folder):\n"
        "    open(os.path.join(folder, str(os.getpid())), 'w').close()\n"
        "    time.sleep(120)\n"
        "if __name__ == '__main__':\n"
        "    launch(hang, 2, folder=sys.argv[1])\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != PRELOAD_ENV}
    env.update(PYTHONPATH=root, **({PRELOAD_ENV: "torch,collectives"} if start == "warm" else {}))
    proc = subprocess.Popen([sys.executable, str(script), str(pids)], env=env)
    deadline = time.monotonic() + 60
    while len(os.listdir(pids)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    ranks = [int(p) for p in os.listdir(pids)]
    assert len(ranks) == 2, "the ranks never started"
    proc.send_signal(how)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 5.0  # parent-death signal or the warm rank's launcher watch: at once, or a 0.5 s poll
    while (alive := [pid for pid in ranks if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"ranks {alive} outlived their launcher"


def _running(pid: int) -> bool:
    """Alive and not a zombie (a rank whose launcher died by SIGKILL is reaped by init, or by nobody in a
    container whose first process does not reap: dead either way)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.spawns
def test_script_without_main_guard_gets_a_hint(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "noguard.py"
    script.write_text(
        "from collectives import launch\n"
        "def work(comm):\n"
        "    return comm.rank\n"
        "print(launch(work, 2, job_timeout=60))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, str(script)],
        env={**{k: v for k, v in os.environ.items() if k != PRELOAD_ENV}, "PYTHONPATH": root},  # spawn's hint
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "__main__" in proc.stderr and "guard" in proc.stderr, proc.stderr[-2000:]


def test_fn_raising_outranks_a_rank_that_failed_joining(tmp_path):
    """The race behind a flaky CI run: rank 1 raised in fn and exited while rank 0 was still in gloo's
    connectFullMesh, so rank 0 failed too ("Connection closed by peer"); both wrote an ``.err``. The launcher must
    name rank 1, whose fn raised, not the lower rank that only failed to join."""
    (tmp_path / "rank0.err").write_text("RuntimeError: Gloo connectFullMesh failed ... Connection closed by peer")
    (tmp_path / "rank1.started").write_text("")
    (tmp_path / "rank1.err").write_text("KeyError: 'boom from rank one'")
    (tmp_path / "rank2.started").write_text("")
    (tmp_path / "rank2.peer").write_text("CollectiveError: rank 1 failed")
    error = failure(str(tmp_path), 0, 1)
    assert error.rank == 1 and "boom from rank one" in error.details
    (tmp_path / "rank1.started").unlink()  # nobody reached fn: the lowest rank's own exception, as before
    (tmp_path / "rank2.started").unlink()
    assert failure(str(tmp_path), 0, 1).rank == 0
