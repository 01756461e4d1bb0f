"""Stable LatentMoE (k3_architecture.md 2.5) on ``moonep.dispatch`` / ``moonep.combine``.

Axes: ``s`` tokens on this rank, ``d`` hidden, ``L`` latent (``routed_expert_hidden_size``), ``F`` expert width,
``E`` experts, ``K`` top-k, ``epn = E / R`` experts per EP rank, ``n`` received rows.

    s = sigmoid(W_r x);  T = TopK(s + b) (b: selection-only bias, no gradient);  p_j = s_j / sum_T s * scale
    z = W_down x;  u = sum_{j in T} p_j E_j(z),  E_j(z) = W2_j SiTU-GLU(W1_j z, W3_j z)
    y = W_up RMSNorm(u) + Shared(x)          (shared experts: one SiTU-GLU MLP of width n_shared * F, full width)

Why not ``moonep.MoE``: its experts are SwiGLU over the full hidden width and its output has no latent norm and
up-projection, so K3's block is built here from moonep's differentiable dispatch/combine (in the latent, so
dispatch moves L-wide rows) and moonep's one expert step, ``moonep.grouped_experts`` with the nn.Linear weight
layout and SiTU-GLU (with K3's betas) as its gated activation: own experts read in place, replicas in moonep's
pools shared by all layers (pushed with ``Buffer.prefetch_weight``, grads home with ``reduce_grad``).
Without a Buffer (``buffer is None``: meta device, or no EP group attached) all E experts are local and a
plain loop computes the same function.
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import nn

from k3.config import K3Config
from k3.layers import RMSNorm, SiTUMLP, rms_norm, situ_glu
from k3.naive import moe_routed_naive
from moonep.parallel import mark_expert
from moonep.router import SigmoidTopKRouter

_LAYER_IDS = itertools.count()


class K3Router(SigmoidTopKRouter):
    """moonep's sigmoid router (``gate.weight [E, d]``, the selection-only bias under its release name
    ``e_score_correction_bias [E]``) plus the statistics K3's load balancing reads.

    x [s, d] -> (topk_idx [s, K] int64, topk_weights [s, K] fp32). Keeps the last step's detached scores
    [s, E] and per-expert counts [E] for load balancing and the max-violation metric.
    """

    bias_name = "e_score_correction_bias"

    def __init__(self, d: int, E: int, K: int, scale: float, *, device=None) -> None:
        super().__init__(d, E, K, route_scale=scale, device=device, init=False)
        self.last_scores: torch.Tensor | None = None
        self.last_counts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.scores(x)  # [s, E], fp32
        topk_idx, topk_weights = self.select(scores)
        self.last_scores = scores.detach()
        # a scatter, not bincount: bincount sizes its output from the data (a host sync on a GPU)
        self.last_counts = torch.zeros(scores.shape[1], dtype=torch.int64, device=x.device).scatter_add_(
            0, topk_idx.flatten(), torch.ones_like(topk_idx.flatten())
        )
        return topk_idx, topk_weights


class LatentMoE(nn.Module):
    """Stable LatentMoE FFN sublayer. x [B, T, d] (already RMSNorm'ed) -> [B, T, d].

    ``ep_size``/``ep_rank``: this rank holds experts ``[ep_rank*epn, (ep_rank+1)*epn)``; ``attach(buffer)``
    connects the EP group (a ``moonep.Buffer`` over the latent width, shared by all MoE layers).
    """

    def __init__(self, cfg: K3Config, *, ep_size: int = 1, ep_rank: int = 0, device=None) -> None:
        super().__init__()
        d, E, K = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_token
        L, F = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
        if E % ep_size:
            raise ValueError(f"num_experts: {E} is not divisible by the EP size {ep_size}")
        self.E, self.K, self.L, self.epn, self.ep_rank = E, K, L, E // ep_size, ep_rank
        self.acts = (cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        self._key = ("k3.LatentMoE", next(_LAYER_IDS))  # owner key for moonep's shared replica pools
        self.gate = K3Router(d, E, K, cfg.routed_scaling_factor, device=device)
        self.routed_expert_down_proj = nn.Linear(d, L, bias=False, device=device)
        self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps, device=device)
        self.routed_expert_up_proj = nn.Linear(L, d, bias=False, device=device)
        self.w1 = nn.Parameter(torch.empty(self.epn, F, L, device=device))
        """[epn, F, L] local experts' gate projections (HF ``experts.N.w1.weight``)."""
        self.w3 = nn.Parameter(torch.empty(self.epn, F, L, device=device))
        """[epn, F, L] local experts' up projections (``experts.N.w3.weight``)."""
        self.w2 = nn.Parameter(torch.empty(self.epn, L, F, device=device))
        """[epn, L, F] local experts' down projections (``experts.N.w2.weight``)."""
        for p in (self.w1, self.w3, self.w2):
            p.expert_shard = (ep_rank * self.epn, E)  # init draws the full [E, ...] tensor and keeps this slice
        mark_expert(self.w1, self.w3, self.w2)  # moonep's contract: one EP rank's experts, kept out of DP sync
        width = cfg.num_shared_experts * F
        self.shared_experts = SiTUMLP(d, width, *self.acts, device=device) if width else None
        self.buffer = None

    def attach(self, buffer) -> None:
        """Use ``buffer`` (a ``moonep.Buffer`` with H = L) for dispatch/combine."""
        self.buffer = buffer

    def routed(self, z: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """u [s, L] = sum over each token's K experts of p_j E_j(z)."""
        if self.buffer is None:
            return moe_routed_naive(z, topk_idx, topk_w, self.w1, self.w3, self.w2, self.acts)
        from moonep.ep_step import routed_experts  # heavy: EP loads only with a Buffer; the model is single-device

        act = functools.partial(situ_glu, beta=self.acts[0], linear_beta=self.acts[1])
        weights = (self.w1, self.w3, self.w2)
        u, _ = routed_experts(
            self.buffer, z, topk_idx=topk_idx, topk_weights=topk_w, weights=weights, layout="linear",
            activation=act, key=self._key, recompute=True,
        )  # fmt: skip
        return u

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        topk_idx, topk_w = self.gate(x2)
        u = self.routed(self.routed_expert_down_proj(x2), topk_idx, topk_w)
        y = self.routed_expert_up_proj(rms_norm(u, self.routed_expert_norm.weight, self.routed_expert_norm.eps))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x2)
        return y.reshape(shape)


__all__ = ["LatentMoE", "K3Router"]
