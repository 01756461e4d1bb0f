"""Checkpoints: one safetensors file per rank (its parameters, router biases and AdamW moments) plus JSON state.

Layout: ``<run>/checkpoints/step_NNNNNN/rank_R.safetensors`` and ``state.json``; ``<run>/checkpoints/latest.json``
names the newest COMPLETE checkpoint (written by rank 0 after every rank's file is in place; each file is
written to a temporary name and renamed, so a crash never leaves a half file under a final name).
Nothing is pickled.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from moonep_base import write_json


def _dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step_{step:06d}")


def save_checkpoint(comm, run_dir: str, step: int, tensors: dict[str, torch.Tensor], state: dict) -> str:
    """Collective: every rank writes its tensors; rank 0 writes ``state.json`` and then ``latest.json``."""
    path = _dir(run_dir, step)
    os.makedirs(path, exist_ok=True)
    final = os.path.join(path, f"rank_{comm.rank}.safetensors")
    tmp = f"{final}.tmp.{os.getpid()}"
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp)
    os.replace(tmp, final)
    comm.barrier()
    if comm.rank == 0:
        write_json(os.path.join(path, "state.json"), state)
        write_json(os.path.join(run_dir, "checkpoints", "latest.json"), {"step": step, "path": path})
    comm.barrier()
    return path


def load_checkpoint(run_dir: str, rank: int) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """(state, this rank's tensors) of the latest complete checkpoint, or None when there is none."""
    latest = os.path.join(run_dir, "checkpoints", "latest.json")
    if not os.path.exists(latest):
        return None
    with open(latest) as f:
        path = json.load(f)["path"]
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    file = os.path.join(path, f"rank_{rank}.safetensors")
    if not os.path.exists(file):
        raise ValueError(
            f"checkpoint {path}: no file for rank {rank} (saved with world size {state.get('world_size')})"
        )
    return state, load_file(file)


__all__ = ["save_checkpoint", "load_checkpoint"]
