"""Block Attention Residuals (k3_architecture.md 2.1-2.2): a depth softmax replaces the residual stream.

Each sublayer reads ``mix(sources)``: sources are the completed block sums ``B_1..B_N`` and the running partial
sum ``P`` of the current block (raw, un-normalised ``[B, T, d]``). One pseudo-query ``w [d]`` (zero-initialised,
so the first steps average the sources uniformly) and an RMSNorm gain ``gamma [d]`` per sublayer:

    s_n = <w, RMSNorm_gamma(V_n)>,   alpha = softmax_n(s),   out = sum_n alpha_n V_n       (fp32 inside)
"""

from __future__ import annotations

import torch
from torch import nn


def attn_res_mix(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """Depth attention over ``sources`` (N+1 tensors [..., d]) with query [d] and gain [d]. Returns [..., d]."""
    v = torch.stack([s.float() for s in sources], dim=0)  # [N+1, ..., d]
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    scores = (k * (gain.float() * query.float())).sum(-1)  # [N+1, ...]
    alpha = torch.softmax(scores, dim=0)
    return (alpha.unsqueeze(-1) * v).sum(0).to(sources[-1].dtype)


class AttnResQuery(nn.Module):
    """One sublayer's pseudo-query (``*_res_proj``, a Linear(d -> 1) weight, zero-init) and gain (``*_res_norm``)."""

    def __init__(self, dim: int, eps: float, *, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.proj = nn.Parameter(torch.zeros(dim, device=device))
        """[d] pseudo-query w; zero so the initial mix is the plain mean of the sources."""
        self.norm = nn.Parameter(torch.ones(dim, device=device))
        """[d] RMSNorm gain gamma of the keys."""

    def forward(self, blocks: list[torch.Tensor], partial: torch.Tensor) -> torch.Tensor:
        """blocks: completed block sums, each [B, T, d]; partial [B, T, d] -> [B, T, d]."""
        return attn_res_mix([*blocks, partial], self.proj, self.norm, self.eps)


__all__ = ["attn_res_mix", "AttnResQuery"]
