"""KDA (Kimi Delta Attention) layer on ``cp_kda`` ops (k3_architecture.md 2.3).

Axes: ``B`` sequences, ``T`` tokens, ``d`` hidden, ``h`` KDA heads, ``K`` = ``V`` head width, ``D = h*K``.

    q, k, v = SiLU(ShortConv_W(W_{q,k,v} x));  q, k L2-normalised per head (q scaled by K^-1/2 in the kernel)
    g = lb * sigmoid(exp(A_log) (W_fb W_fa x + dt_bias))  in (lb, 0),   beta = sigmoid(W_b x)
    S_t = (I - beta k k^T) Diag(exp g) S_{t-1} + beta k v^T,   o_t = S_t^T q_t
    y = W_o [ RMSNorm_head(o) * gamma_o * sigmoid(W_g x) ]

Context parallelism enters only here: with a ``cp_comm`` of world size > 1 the layer calls
``context_parallel_short_conv`` / ``context_parallel_kda`` on its slice of every sequence instead of the
single-device ``short_conv`` / ``kda_chunk``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from k3.config import K3Config
from k3.layers import rms_norm


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [..., K] / max(||x||, eps) per head (the kernel's convention, done outside cp_kda)."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


class KDALayer(nn.Module):
    """KDA attention sublayer. x [B, T, d] (already RMSNorm'ed) -> [B, T, d]."""

    def __init__(self, cfg: K3Config, *, device=None) -> None:
        super().__init__()
        lin = cfg.linear_attn_config
        d, self.h, self.K = cfg.hidden_size, lin.num_heads, lin.head_dim
        D, W = self.h * self.K, lin.short_conv_kernel_size
        self.lower_bound, self.eps = lin.gate_lower_bound, cfg.rms_norm_eps
        self.cp_comm = None  # set for context parallelism by k3.parallelize.apply_cp

        def lin_(i: int, o: int) -> nn.Linear:
            return nn.Linear(i, o, bias=False, device=device)

        self.q_proj, self.k_proj, self.v_proj = lin_(d, D), lin_(d, D), lin_(d, D)
        self.q_conv1d = nn.Parameter(torch.empty(D, W, device=device))
        """[D, W] depthwise causal conv taps of q (oldest tap first)."""
        self.k_conv1d = nn.Parameter(torch.empty(D, W, device=device))
        self.v_conv1d = nn.Parameter(torch.empty(D, W, device=device))
        self.f_a_proj, self.f_b_proj = lin_(d, self.K), lin_(self.K, D)
        self.b_proj = lin_(d, self.h)
        self.A_log = nn.Parameter(torch.empty(self.h, device=device))
        """[h] log of the per-head decay rate (init log U(1, 16), as the modeling code)."""
        self.dt_bias = nn.Parameter(torch.empty(D, device=device))
        """[D] per-channel bias of the decay logits."""
        self.g_proj, self.o_proj = lin_(d, D), lin_(D, d)
        self.o_norm = nn.Parameter(torch.ones(self.K, device=device))
        """[K] per-head output RMSNorm gain, shared by the heads."""

    def reset_special(self, gen: torch.Generator) -> None:
        """Init of the non-Linear parameters (conv taps like a default Conv1d, A_log, dt_bias)."""
        W = self.q_conv1d.shape[1]
        for p in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            p.data.uniform_(-1 / math.sqrt(W), 1 / math.sqrt(W), generator=gen)
        self.A_log.data.copy_(torch.empty(self.h).uniform_(1, 16, generator=gen).log())
        # dt_bias: inverse softplus of dt ~ logU(1e-3, 0.1), the Mamba/FLA convention (K3's init is unknown).
        dt = torch.exp(torch.empty(self.dt_bias.shape).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
        self.dt_bias.data.copy_(dt + torch.log(-torch.expm1(-dt)))

    def _conv(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        from cp_kda import context_parallel_short_conv, short_conv  # heavy: cp_kda kernels, loaded on first use

        if self.cp_comm is not None and self.cp_comm.world_size > 1:
            return context_parallel_short_conv(x, weight, self.cp_comm, activation="silu")
        return short_conv(x, weight, activation="silu")[0]

    def _kda(self, q, k, v, g, beta) -> torch.Tensor:
        from cp_kda import context_parallel_kda, kda_chunk  # heavy: cp_kda kernels, loaded on first use

        if self.cp_comm is not None and self.cp_comm.world_size > 1:
            return context_parallel_kda(q, k, v, g, beta, self.cp_comm, strategy="scan")[0]
        return kda_chunk(q, k, v, g, beta)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from cp_kda import kda_gate  # heavy: cp_kda kernels, loaded on first use

        B, T, _ = x.shape
        heads = (B, T, self.h, self.K)
        q = l2_normalize(self._conv(self.q_proj(x), self.q_conv1d).view(heads))
        k = l2_normalize(self._conv(self.k_proj(x), self.k_conv1d).view(heads))
        v = self._conv(self.v_proj(x), self.v_conv1d).view(heads)
        f = self.f_b_proj(self.f_a_proj(x)).view(heads)
        g = kda_gate(f, self.A_log, self.dt_bias, lower_bound=self.lower_bound).to(x.dtype)
        beta = torch.sigmoid(self.b_proj(x))  # [B, T, h]
        o = self._kda(q, k, v, g, beta)  # [B, T, h, V]
        o = rms_norm(o, self.o_norm, self.eps).reshape(B, T, -1)
        return self.o_proj(o * torch.sigmoid(self.g_proj(x)))


__all__ = ["KDALayer", "l2_normalize"]
