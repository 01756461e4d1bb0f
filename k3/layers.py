"""Small building blocks: RMSNorm, SiTU-GLU (report Eq. 12) and the dense SiTU-GLU MLP.

Axes: ``T`` tokens (any leading shape), ``d`` hidden, ``F`` MLP width.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., d] / sqrt(mean(x^2) + eps) * weight [d], computed in fp32 and cast back (as the release)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a gain initialised to one. x [..., d] -> [..., d]."""

    def __init__(self, dim: int, eps: float, *, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU-GLU: [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(v/b2)], bounded by b1*b2 (100 in K3); fp32 inside.

    gate, up [..., F] -> [..., F]. Near 0 it equals SwiGLU to first order (tanh(z/b) b ~ z).
    """
    g, v = gate.float(), up.float()
    out = (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (linear_beta * torch.tanh(v / linear_beta))
    return out.to(gate.dtype)


class SiTUMLP(nn.Module):
    """Dense SiTU-GLU MLP (dense layer and shared experts): down(situ(gate(x), up(x))). x [T, d] -> [T, d]."""

    def __init__(self, hidden: int, width: int, beta: float, linear_beta: float, *, device=None) -> None:
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.gate_proj = nn.Linear(hidden, width, bias=False, device=device)
        self.up_proj = nn.Linear(hidden, width, bias=False, device=device)
        self.down_proj = nn.Linear(width, hidden, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))


__all__ = ["RMSNorm", "rms_norm", "situ_glu", "SiTUMLP"]
