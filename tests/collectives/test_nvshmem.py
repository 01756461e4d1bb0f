"""NVSHMEM backend: importable everywhere, a clear error without a GPU, real checks on one.

The MPS checks run on the CPU: the detection reads ``CUDA_MPS_PIPE_DIRECTORY``, pointed here at a tmp dir that
holds a listening, a stale or no control socket, and asks a fake ``nvidia-cuda-mps-control``.
"""

import contextlib
import os
import socket

import pytest
import torch

from collectives import launch, nvshmem_backend, nvshmem_mps
from collectives.nvshmem_backend import (
    NVSHMEMCommunicator,
    mps_control_path,
    mps_daemon,
    mps_state,
    nvshmem_available,
    require_mps_if_shared,
    shared_gpu_error,
)
from tests.collectives import battery

AVAILABLE, REASON = nvshmem_available()


def test_construction_without_gpu_raises_clear_error(monkeypatch):
    """Without a GPU or nvshmem4py the constructor says why. Where both are present the lack is forced, so the
    test runs everywhere (``make gpu-check`` counts a skip as a failure)."""
    if AVAILABLE:
        monkeypatch.setattr(nvshmem_backend, "nvshmem_available", lambda: (False, "forced by the test"))
    with pytest.raises(RuntimeError, match="NVSHMEM backend unavailable"):
        NVSHMEMCommunicator(bootstrap=None)


def _env(directory, **more) -> dict:
    return {"CUDA_MPS_PIPE_DIRECTORY": str(directory), **more}


@contextlib.contextmanager
def _daemon(directory):
    """A listening SEQPACKET socket where nvidia-cuda-mps-control -d opens its control socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as daemon:
        daemon.bind(str(directory / "control"))
        daemon.listen(4)
        yield


def _control(servers="4242\n", percentage="100\n"):
    """A fake ``echo <command> | nvidia-cuda-mps-control``, recording the commands it was given."""
    asked = []

    def control(command, env):
        asked.append(command)
        return servers if command == "get_server_list" else percentage

    control.asked = asked
    return control


def test_mps_control_path_default_and_override(tmp_path):
    assert mps_control_path({}) == "/tmp/nvidia-mps/control"
    assert mps_control_path({"CUDA_MPS_PIPE_DIRECTORY": ""}) == "/tmp/nvidia-mps/control"
    assert mps_control_path(_env(tmp_path)) == str(tmp_path / "control")


def test_mps_inactive_without_control_socket(tmp_path):
    state = mps_state(_env(tmp_path), _control())
    assert not state.active and str(tmp_path / "control") in state.found
    (tmp_path / "control").write_text("")  # a regular file is not the daemon's socket
    assert not mps_daemon(_env(tmp_path))[0]


def test_mps_active_when_a_daemon_listens_and_serves(tmp_path):
    control = _control(percentage="50\n")
    with _daemon(tmp_path):
        state = mps_state(_env(tmp_path), control)
    assert state.active and state.thread_percentage == 50.0 and "4242" in state.found, state
    assert control.asked == ["get_server_list", "get_active_thread_percentage 4242"]  # NVSHMEM's questions


def test_client_percentage_wins_and_missing_control_tool_is_inactive(tmp_path):
    with _daemon(tmp_path):
        state = mps_state(_env(tmp_path, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="25"), _control(percentage="100"))
        assert state.active and state.thread_percentage == 25.0
        missing = mps_state(_env(tmp_path), lambda command, env: None)  # no nvidia-cuda-mps-control on PATH
        idle = mps_state(_env(tmp_path), _control(servers=""))  # a daemon that serves no client (yet)
    assert not missing.active and "not on PATH" in missing.found
    assert not idle.active and "no MPS server" in idle.found


@pytest.mark.spawns
def test_mps_control_pipes_the_command_as_nvshmem_does(tmp_path):
    tool = tmp_path / "nvidia-cuda-mps-control"
    tool.write_text('#!/bin/sh\nread cmd\n[ "$cmd" = get_server_list ] && echo 4242\n')
    tool.chmod(0o755)
    assert nvshmem_backend.mps_control("get_server_list", {"PATH": str(tmp_path)}) == "4242\n"
    assert nvshmem_backend.mps_control("get_server_list", {"PATH": str(tmp_path / "none")}) is None


def test_stale_socket_of_a_killed_daemon_reads_inactive(tmp_path):
    """Catches: a socket file left by a killed daemon taken for a running MPS (NVSHMEM would then exit)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as dead:
        dead.bind(str(tmp_path / "control"))  # bound, never listening, closed: the file stays
    state = mps_state(_env(tmp_path), _control())
    assert not state.active and "stale" in state.found


def test_named_pipe_of_old_drivers_counts_as_a_daemon(tmp_path):
    os.mkfifo(tmp_path / "control")
    assert mps_daemon(_env(tmp_path))[0]


def test_shared_gpu_without_mps_names_gpu_pe_count_and_fix():
    rows = [(7, 0, 0, 100_000, 0), (7, 0, 0, 100_000, 0), (9, 0, 1, 100_000, 0)]  # ranks 0, 1 share cuda:0
    message = shared_gpu_error(rows, 0, "cuda:0 (NVIDIA H200, host n1)", "no MPS control socket at /x/control")
    assert "2 PEs (ranks 0, 1)" in message and "cuda:0 (NVIDIA H200, host n1)" in message
    assert "nvidia-cuda-mps-control -d" in message and "signal_wait" in message and "/x/control" in message
    other = shared_gpu_error(rows, 2, "cuda:1", "")  # rank 2 is fine but must not enter NVSHMEM init alone
    assert "rank(s) 0, 1" in other and "nvidia-cuda-mps-control -d" in other


def test_shared_gpu_with_mps_needs_percentages_up_to_100():
    """Catches: MPS running with the default 100% per PE, which NVSHMEM still serves in its limited mode."""
    rows = [(7, 1, 0, 100_000, 0), (7, 1, 0, 100_000, 0)]
    message = shared_gpu_error(rows, 1, "cuda:0", "")
    assert "200% in all" in message and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in message
    assert shared_gpu_error([(7, 1, 0, 50_000, 0), (7, 1, 0, 50_000, 0)], 0, "cuda:0", "") is None
    assert shared_gpu_error([(7, 1, 0, 100_000, 1), (7, 1, 0, 100_000, 1)], 0, "cuda:0", "") is None  # ignored


def test_no_error_with_one_pe_per_gpu():
    assert shared_gpu_error([(7, 0, 0, 100_000, 0), (8, 0, 1, 100_000, 0)], 1, "cuda:1", "") is None


class _EchoBootstrap:
    """Two ranks on one GPU: ``_all_gather`` hands this rank's row back as both ranks' rows."""

    rank, world_size, timeout = 0, 2, 1.0

    def _all_gather(self, out, inp, timeout):
        out.copy_(inp.repeat(self.world_size, 1))
        return out


def test_require_mps_if_shared_raises_before_init(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    monkeypatch.setattr(nvshmem_mps, "_gpu_key", lambda device: 1234)  # where the check looks it up
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    with pytest.raises(RuntimeError, match=r"2 PEs \(ranks 0, 1\) share GPU cuda:0 \(NVIDIA H200"):
        require_mps_if_shared(_EchoBootstrap(), 0)
    monkeypatch.setattr(nvshmem_mps, "mps_control", _control())
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    with _daemon(tmp_path):
        require_mps_if_shared(_EchoBootstrap(), 0)  # MPS running, 2 x 50%: no error


def gpu_all_to_all(comm):
    """All-to-all with uneven splits between GPUs (several PEs may share one GPU)."""
    w, r = comm.world_size, comm.rank
    ins = [battery.split(r, j, w, 0) for j in range(w)]
    outs = [battery.split(i, r, w, 0) for i in range(w)]
    inp = torch.cat([battery._rows_for(r, j, ins[j], 3, torch.bfloat16) for j in range(w)]).cuda()
    out = torch.zeros(sum(outs), 3, dtype=torch.bfloat16, device="cuda")
    comm.all_to_all_single(out, inp, outs, ins)
    want = torch.cat([battery._rows_for(i, r, outs[i], 3, torch.bfloat16) for i in range(w)])
    gathered = torch.empty(2 * w, 5, dtype=torch.float32, device="cuda")
    comm.all_gather(gathered, battery._rows_for(r, r, 2, 5, torch.float32).cuda())
    ok_gather = torch.equal(gathered.cpu(), torch.cat([battery._rows_for(i, i, 2, 5, torch.float32) for i in range(w)]))
    comm.barrier()
    result = torch.equal(out.cpu(), want) and ok_gather
    comm.close()
    return result


@pytest.mark.gpu
@pytest.mark.skipif(not AVAILABLE, reason=REASON or "NVSHMEM unavailable")
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.spawns
def test_nvshmem_all_to_all_on_gpu(world_size):
    assert launch(gpu_all_to_all, world_size, backend="nvshmem", timeout=60, job_timeout=300)
