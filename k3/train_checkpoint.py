"""What a ``k3.train.Trainer`` saves and restores: its checkpoint (``Checkpointing``, the trainer's base class).

A rank's checkpoint holds its model state dict (``model.<name>``) and its full optimizer state
(``optim.<param>.<key>``); a restore checks every tensor by name, shape and dtype against what this trainer
expects (nothing loads loosely) and agrees on the verdict across ranks (``k3.checkpoint``: the files, their
checksums, the manifest and the pointer).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from k3.checkpoint import CheckpointError, agree, check_tensors, read_manifest, read_shard, save_checkpoint

if TYPE_CHECKING:
    from collectives.base import Communicator
    from k3.model import K3Model
    from k3.muon import PerHeadMuon
    from k3.train_config import TrainConfig


class Checkpointing:
    """The checkpoint half of a trainer: it reads ``comm``, ``tc``, ``model``, ``opt``, ``names`` (parameter id ->
    name), ``run`` (``run.json``) and ``opt_steps``, which the trainer sets."""

    comm: Communicator
    tc: TrainConfig
    model: K3Model
    opt: PerHeadMuon
    names: dict[int, str]
    run: dict | None
    opt_steps: int

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint of this rank holds.

        Returns:
            ``model.<name>`` (the state dict) and ``optim.<param>.<key>`` (the optimizer state) -> tensor.
        """
        out = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        out.update({f"optim.{k}": v for k, v in self.opt.state_tensors(self.names).items()})
        return out

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every tensor a checkpoint of this rank must hold: the model's state dict and,
        for every parameter, its full optimizer state (Muon: momentum; AdamW: step, exp_avg, exp_avg_sq). Every
        parameter gets a gradient each step (``DataParallel.sync_grads`` fills missing ones), so a saved state is
        complete.

        Returns:
            ``state_tensors``' names -> (shape, dtype).
        """
        out = {f"model.{k}": (tuple(v.shape), v.dtype) for k, v in self.model.state_dict().items()}
        for group in self.opt.param_groups:
            keys = ("momentum",) if group["kind"] == "muon" else ("step", "exp_avg", "exp_avg_sq")
            for p in group["params"]:
                for k in keys:
                    shape, dtype = ((), torch.float64) if k == "step" else (tuple(p.shape), torch.float32)
                    out[f"optim.{self.names[id(p)]}.{k}"] = (shape, dtype)
        return out

    def save(self, step: int) -> None:
        """Collective: write this rank's checkpoint of ``step`` (``k3.checkpoint.save_checkpoint``).

        Args:
            step: the number of steps done (the step a resume starts at).
        """
        state = {"step": step, "optimizer_steps": self.opt_steps}
        save_checkpoint(self.comm, self.tc.run_dir, step, self.state_tensors(), state, self.run)

    def restore(self) -> int:
        """Collective: load the latest checkpoint, every tensor checked by name, shape and dtype (nothing loads
        loosely); a fault on any rank raises the same CheckpointError on all.

        Returns:
            the first step to run (0 when the run folder holds no checkpoint).
        """
        problem, found = None, None
        try:
            found = read_manifest(self.tc.run_dir)
            if found is not None and not isinstance(found[1]["state"].get("optimizer_steps"), int):
                raise CheckpointError(f"{found[0]}: the manifest's state lacks optimizer_steps")
            if found is not None:
                tensors = read_shard(*found, self.comm.rank)
                shard = os.path.join(found[0], f"rank_{self.comm.rank}.safetensors")
                check_tensors(shard, tensors, self.expected_tensors())
                self.model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
                optim = {k[6:]: v for k, v in tensors.items() if k.startswith("optim.")}
                self.opt.load_state_tensors(optim, self.names)
        except CheckpointError as exc:
            problem = str(exc)
        agree(self.comm, problem)
        if found is None:
            return 0
        state = found[1]["state"]
        self.opt_steps = state["optimizer_steps"]
        return state["step"]


__all__ = ["Checkpointing"]
