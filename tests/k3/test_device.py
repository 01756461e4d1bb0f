"""Device placement of the training job (``--device``): a clear error without CUDA on CPU machines; on GPUs,
the same losses as on CPU (1 rank; 2 ranks with replicas, prefetch and grad reduce over NCCL when 2 GPUs are
visible), an exact resume, and a clear error for more ranks than GPUs. These skip without CUDA; ``make
gpu-check`` runs them."""

from __future__ import annotations

import pytest
import torch

from collectives.launch import local_rank
from k3.train import TrainConfig, train

SMALL_DATA = 1 << 20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cfg(tmp_path, name: str, **kw) -> TrainConfig:
    base = {
        "world_size": 1,
        "steps": 3,
        "val_every": 2,
        "ckpt_every": 0,
        "progress": False,
        "max_data_bytes": SMALL_DATA,
        "run_dir": str(tmp_path / name),
    }
    return TrainConfig(**{**base, **kw})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="device: cuda asked for, but torch sees no CUDA device"):
        _cfg(tmp_path, "x", device="cuda")
    with pytest.raises(ValueError, match="device: expected cpu or cuda"):
        _cfg(tmp_path, "x", device="tpu")


def test_local_rank_comes_from_the_launcher(monkeypatch):
    for key in ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert local_rank(5) == 5  # our launcher: one host
    monkeypatch.setenv("MPI_LOCALRANKID", "2")
    assert local_rank(5) == 2
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's wins
    assert local_rank(5) == 1


@pytest.mark.gpu
@needs_cuda
def test_cuda_training_matches_cpu(tmp_path):
    """Model, MoonEP buffer, KDA, optimizer and balancing on the GPU give the CPU's losses (fp32: torch keeps
    TF32 matmuls off by default and the short conv is elementwise, so only summation order differs; a routing
    near-tie flipping is the one way this could fail without a bug)."""
    cpu = train(_cfg(tmp_path, "cpu"))
    gpu = train(_cfg(tmp_path, "gpu", device="cuda"))
    assert len(gpu["losses"]) == 3
    for a, b in zip(cpu["losses"], gpu["losses"]):
        assert abs(a - b) <= 1e-4 * abs(a), (cpu["losses"], gpu["losses"])
    assert abs(cpu["val_loss"] - gpu["val_loss"]) <= 1e-4 * abs(cpu["val_loss"])


@pytest.mark.gpu
@needs_cuda
def test_cuda_resume_equals_uninterrupted(tmp_path):
    """Checkpoints hold host copies; a resumed GPU run puts the optimizer state back on the GPU."""
    straight = train(_cfg(tmp_path, "straight", device="cuda", steps=4))
    train(_cfg(tmp_path, "resumed", device="cuda", steps=2))
    resumed = train(_cfg(tmp_path, "resumed", device="cuda", steps=4, resume=True))
    assert resumed["start"] == 2 and resumed["losses"] == straight["losses"][2:]


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL: one GPU per rank)")
def test_two_gpu_ranks_match_cpu(tmp_path):
    """At 2 ranks the planner makes replicas: weight prefetch, grad reduce and the all-to-alls run over NCCL."""
    cpu = train(_cfg(tmp_path, "cpu2", world_size=2))
    gpu = train(_cfg(tmp_path, "gpu2", world_size=2, device="cuda"))
    for a, b in zip(cpu["losses"], gpu["losses"]):
        assert abs(a - b) <= 1e-4 * abs(a), (cpu["losses"], gpu["losses"])


@pytest.mark.gpu
@pytest.mark.single_gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() > 1, reason="needs exactly one CUDA device"
)
def test_more_ranks_than_gpus_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="2 ranks on this host but 1 visible GPU"):
        train(_cfg(tmp_path, "shared", world_size=2, device="cuda"))
