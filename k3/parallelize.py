"""Parallelism applied to K3 from outside, in the manner of torchtitan's ``parallelize.py``.

The model code (``k3.model`` and its layers) is single-device; this module is the only place that wires it to
ranks, as a short list of steps that ``parallelize_k3`` calls in order:

    dims = ParallelDims.build(comm, cp)      # world = dp x cp; consecutive ranks share a sequence (the CP group)
    model = build_model(cfg, seed=..., ep_size=R, ep_rank=rank)   # LatentMoE builds (and marks) its E/R experts
    dp = parallelize_k3(model, dims, tokens=rows * T_l, device=device)
      apply_ep(model, world, ...)   a moonep.Buffer on every MoE layer (EP spans the world: E/R experts per rank)
      apply_cp(model, cp_comm)      the CP sub-group on every attention layer (KDA via cp_kda, MLA gathers k/v)
      apply_dp(model, world)        the DataParallel sync: replicated grads summed over the world, experts left
                                    alone (moonep's contract, ``moonep.parallel``), and the cross-rank grad clip

``shard_batch`` cuts this rank's rows and token slice out of the global batch. Axes: ``G`` rows of the global
batch, ``rows = G / dp`` this rank's, ``T_l = seq_len / cp`` its tokens of each row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moonep.buffer import Buffer
from moonep.parallel import is_expert

if TYPE_CHECKING:
    from collectives.base import Communicator
    from k3.model import K3Model


@dataclass
class ParallelDims:
    """Where this rank sits in the world: ``dp`` data-parallel groups of ``cp`` consecutive ranks each (a CP
    group splits every sequence); EP spans the whole world."""

    world: Communicator
    """Every rank: EP, the DP gradient sum, QK-Clip and balancing run over it."""
    cp: int
    """Context-parallel size (ranks per sequence)."""
    cp_comm: Communicator | None
    """This rank's CP sub-group (its ``cp`` consecutive ranks); None when ``cp == 1``."""

    @classmethod
    def build(cls, world: Communicator, cp: int) -> ParallelDims:
        """Collective when ``cp > 1`` (every rank splits the world into its CP group).

        Args:
            world: the world communicator (every rank).
            cp: ranks per sequence; must divide ``world.world_size``.

        Returns:
            this rank's dims, with its CP sub-group when ``cp > 1``.
        """
        if world.world_size % cp:
            raise ValueError(f"cp: {cp} does not divide world size {world.world_size}")
        cp_comm = world.split(world.rank // cp) if cp > 1 else None
        return cls(world=world, cp=cp, cp_comm=cp_comm)

    @property
    def dp(self) -> int:
        """Data-parallel size: how many groups split the global batch's rows."""
        return self.world.world_size // self.cp

    @property
    def dp_rank(self) -> int:
        return self.world.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.world.rank % self.cp

    def comms(self) -> tuple[Communicator, ...]:
        """The world, then the CP sub-group if any (each keeps its own injected link delays)."""
        return (self.world,) if self.cp_comm is None else (self.world, self.cp_comm)

    def close(self) -> None:
        """Close what ``build`` created (the CP sub-group); the world communicator is the launcher's."""
        if self.cp_comm is not None:
            self.cp_comm.close()
            self.cp_comm = None


def shard_batch(
    full: torch.Tensor, dims: ParallelDims, rows: int, T_l: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a global batch: its data-parallel rows and its context-parallel token slice.

    Args:
        full: [G, seq_len + 1] int64 token ids of the global batch (inputs and the next-token targets).
        dims: this rank's place (``dp_rank`` picks the rows, ``cp_rank`` the token slice).
        rows: rows per data-parallel group (``G / dp``).
        T_l: tokens per rank of each row (``seq_len / cp``).
        device: where the slices go.

    Returns:
        (inputs, targets), each [rows, T_l] int64; targets are the inputs shifted by one token.
    """
    mine = full[dims.dp_rank * rows : (dims.dp_rank + 1) * rows].to(device)
    a = dims.cp_rank * T_l
    return mine[:, a : a + T_l], mine[:, a + 1 : a + 1 + T_l]


def apply_ep(
    model: K3Model,
    comm: Communicator,
    *,
    tokens: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Buffer:
    """Expert parallelism over ``comm``: one ``moonep.Buffer`` (over the latent width L) shared by every MoE layer.

    The model must have been built for this EP group (``build_model(..., ep_size=R, ep_rank=rank)``: each
    ``LatentMoE`` holds its E/R experts [epn, ...] and marks them with ``moonep.parallel.mark_expert``, so
    ``apply_dp`` keeps them out of the gradient sum); a model built for another group is refused here.

    Args:
        model: the K3 model, built for EP size ``comm.world_size`` and rank ``comm.rank``.
        comm: the EP group (the world in training).
        tokens: rows one rank routes per forward (``rows * T_l``); the Buffer's capacity S.
        dtype: the activations' dtype.
        device: where the Buffer's tables live (None: moonep's default for ``comm``).

    Returns:
        the Buffer, attached to every MoE layer of the model.
    """
    cfg, moes = model.cfg, model.moe_layers()
    for moe in moes:
        if moe.epn * comm.world_size != cfg.num_experts or not all(is_expert(p) for p in (moe.w1, moe.w3, moe.w2)):
            raise ValueError(
                f"apply_ep: the model holds {moe.epn} marked experts per rank, EP over {comm.world_size} ranks "
                f"needs {cfg.num_experts // comm.world_size}: build it with ep_size={comm.world_size}"
            )
    buffer = Buffer(
        comm,
        S=tokens,
        H=cfg.routed_expert_hidden_size,
        K=cfg.num_experts_per_token,
        E=cfg.num_experts,
        dtype=dtype,
        device=device,
    )
    for moe in moes:
        moe.attach(buffer)
    return buffer


def apply_cp(model: K3Model, cp_comm: Communicator | None) -> None:
    """Context parallelism: every attention layer (KDA and MLA) gets the CP group; each rank then holds a
    [B, T_l] slice of every sequence (KDA runs ``cp_kda``'s context-parallel kernels, MLA gathers keys/values).

    Args:
        model: the K3 model.
        cp_comm: the CP sub-group, or None (no context parallelism: every layer sees whole sequences).
    """
    for layer in model.layers:
        layer.self_attn.cp_comm = cp_comm


class DataParallel:
    """Data parallelism of one rank over ``comm``: the replicated parameters' gradients summed (one all-reduce),
    expert gradients left as they are (already complete after the EP backward: moonep's contract), and the
    gradient norm clipped over every rank's experts and the replicated parameters.

    Args:
        model: the K3 model (its experts marked by ``LatentMoE``: ``moonep.parallel.mark_expert``).
        comm: the data-parallel group (the world).
    """

    def __init__(self, model: K3Model, comm: Communicator) -> None:
        self.comm = comm
        self.params = dict(model.named_parameters())
        self.experts = {n: p for n, p in self.params.items() if is_expert(p)}  # marked by LatentMoE (mark_expert)
        """This rank's own expert parameters, by name."""
        self.replicated = {n: p for n, p in self.params.items() if n not in self.experts}
        """Every other parameter (the same on every rank), by name."""
        self.device = next(iter(self.params.values())).device

    def sync_grads(self, loss_sum: torch.Tensor) -> float:
        """One all-reduce of the replicated grads and the loss; a parameter without a gradient gets zeros (so
        every parameter has one after a step).

        Args:
            loss_sum: [] this rank's summed token loss.

        Returns:
            the loss summed over every rank.
        """
        flat = [loss_sum.detach().reshape(1)]
        for p in self.replicated.values():
            flat.append(torch.zeros(p.numel(), device=p.device) if p.grad is None else p.grad.reshape(-1))
        packed = torch.cat(flat)
        if self.comm.world_size > 1:
            self.comm.all_reduce(packed)
        offset = 1
        for p in self.replicated.values():
            n = p.numel()
            p.grad = packed[offset : offset + n].view_as(p).clone()
            offset += n
        return float(packed[0])

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip every gradient by the global norm: each rank's expert grads (one all-reduce of the squares, fp64)
        plus the replicated grads (already summed, the same on every rank). Call after ``sync_grads``.

        Args:
            max_norm: the clip threshold; 0 = measure only.

        Returns:
            the global gradient norm before clipping.
        """
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for p in self.experts.values():
            if p.grad is not None:
                sq += p.grad.double().pow(2).sum()
        if self.comm.world_size > 1:
            self.comm.all_reduce(sq)
        sq += sum(p.grad.double().pow(2).sum() for p in self.replicated.values())
        norm = float(sq.sqrt())
        if max_norm and norm > max_norm:
            for p in self.params.values():
                if p.grad is not None:
                    p.grad.mul_(max_norm / norm)
        return norm


def apply_dp(model: K3Model, comm: Communicator) -> DataParallel:
    """Data parallelism over ``comm``: the gradient sync and clip of the model's parameters.

    Args:
        model: the K3 model, after ``apply_ep`` (its experts marked).
        comm: the data-parallel group (the world: EP and DP span the same ranks, CP groups sum their partial
            grads in the same all-reduce).

    Returns:
        the rank's ``DataParallel``; call ``sync_grads`` then ``clip_grad_norm_`` after each backward.
    """
    return DataParallel(model, comm)


def parallelize_k3(
    model: K3Model, dims: ParallelDims, *, tokens: int, device: torch.device | str | None = None
) -> DataParallel:
    """Apply EP, CP and DP to ``model`` in that order (what training runs).

    Args:
        model: the K3 model, built for EP over ``dims.world`` and already on ``device``.
        dims: this rank's place (``ParallelDims.build``).
        tokens: rows this rank routes per forward (``rows * T_l``).
        device: the rank's device (the EP Buffer's tables live there).

    Returns:
        the rank's ``DataParallel`` (gradient sync and clip).
    """
    apply_ep(model, dims.world, tokens=tokens, device=device)
    apply_cp(model, dims.cp_comm)
    return apply_dp(model, dims.world)


__all__ = ["DataParallel", "ParallelDims", "apply_cp", "apply_dp", "apply_ep", "parallelize_k3", "shard_batch"]
