"""Device placement of the training job (``--device``): a clear error without CUDA on CPU machines; on a GPU,
the same losses as on CPU and an exact resume (these skip without CUDA, and run first thing when a GPU is lent)."""
from __future__ import annotations

import pytest
import torch

from collectives.launch import local_rank
from k3.train import TrainConfig, train

SMALL_DATA = 1 << 20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cfg(tmp_path, name: str, **kw) -> TrainConfig:
    base = dict(world_size=1, steps=3, val_every=2, ckpt_every=0, progress=False, max_data_bytes=SMALL_DATA,
                run_dir=str(tmp_path / name))
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


@needs_cuda
def test_cuda_training_matches_cpu(tmp_path):
    """Model, MoonEP buffer and pools, KDA, optimizer and balancing on the GPU give the CPU's losses (fp32;
    TF32 off so only kernel summation order differs)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cpu = train(_cfg(tmp_path, "cpu"))
    gpu = train(_cfg(tmp_path, "gpu", device="cuda"))
    assert len(gpu["losses"]) == 3
    for a, b in zip(cpu["losses"], gpu["losses"]):
        assert abs(a - b) <= 1e-4 * abs(a), (cpu["losses"], gpu["losses"])
    assert abs(cpu["val_loss"] - gpu["val_loss"]) <= 1e-4 * abs(cpu["val_loss"])


@needs_cuda
def test_cuda_resume_equals_uninterrupted(tmp_path):
    """Checkpoints hold host copies; a resumed GPU run puts the optimizer state back on the GPU."""
    straight = train(_cfg(tmp_path, "straight", device="cuda", steps=4))
    train(_cfg(tmp_path, "resumed", device="cuda", steps=2))
    resumed = train(_cfg(tmp_path, "resumed", device="cuda", steps=4, resume=True))
    assert resumed["start"] == 2 and resumed["losses"] == straight["losses"][2:]
