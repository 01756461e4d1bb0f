"""Block Attention Residuals (k3_architecture.md 2.1-2.2): a depth softmax replaces the residual stream.

Each sublayer reads ``mix(sources)``: sources are the completed block sums ``B_1..B_N`` and the running partial
sum ``P`` of the current block (raw, un-normalised ``[B, T, d]``). One pseudo-query ``w [d]`` (zero-initialised,
so the first steps average the sources uniformly) and an RMSNorm gain ``gamma [d]`` per sublayer:

    s_n = <w, RMSNorm_gamma(V_n)>,   alpha = softmax_n(s),   out = sum_n alpha_n V_n       (fp32 inside)

Memory: autograd on these formulas keeps fp32 [N+1, B, T, d] stacks of the sources (two per mix, more than the
rest of the layer keeps). ``attn_res_mix`` has its own backward instead: it keeps the sources themselves (the
block sums are shared by every later mix, so only the partial sum is new) and three fp32 numbers per token and
source (``r_n``, ``s_n``, ``alpha_n``), and rebuilds the rest from them. With ``u = gamma * w``, ``k_n = r_n V_n``,
``r_n = (mean(V_n^2) + eps)^-1/2`` and the incoming gradient ``g``:

    ds_n = alpha_n (<g, V_n> - sum_m alpha_m <g, V_m>)
    dV_n = alpha_n g + r_n ds_n (u - k_n s_n / d),     du = sum_{tokens, n} ds_n k_n
"""

from __future__ import annotations

import torch
from torch import nn


class _AttnResMix(torch.autograd.Function):
    """``attn_res_mix`` with the backward written out (the module docstring): saves the sources by reference."""

    @staticmethod
    def forward(ctx, query, gain, eps, *sources):
        u = gain.float() * query.float()
        r, s = [], []
        for src in sources:  # one source at a time: no [N+1, ..., d] fp32 stack, not even a transient one
            v = src.float()
            r.append(torch.rsqrt(v.pow(2).mean(-1) + eps))
            s.append(((v * r[-1].unsqueeze(-1)) * u).sum(-1))
        r, alpha = torch.stack(r), torch.softmax(torch.stack(s), dim=0)  # [N+1, ...]
        out = alpha[0].unsqueeze(-1) * sources[0].float()
        for n in range(1, len(sources)):
            out = out + alpha[n].unsqueeze(-1) * sources[n].float()
        ctx.save_for_backward(query, gain, r, torch.stack(s), alpha, *sources)
        return out.to(sources[-1].dtype)

    @staticmethod
    def backward(ctx, grad):
        query, gain, r, s, alpha, *sources = ctx.saved_tensors
        g, u = grad.float(), gain.float() * query.float()
        d = g.shape[-1]
        dalpha = torch.stack([(g * v.float()).sum(-1) for v in sources])
        ds = alpha * (dalpha - (alpha * dalpha).sum(0, keepdim=True))  # softmax backward over the depth axis
        du = torch.zeros_like(u)
        grads = []
        for n, src in enumerate(sources):
            k = src.float() * r[n].unsqueeze(-1)
            du += (ds[n].unsqueeze(-1) * k).reshape(-1, d).sum(0)
            if ctx.needs_input_grad[3 + n]:
                dv = alpha[n].unsqueeze(-1) * g + (r[n] * ds[n]).unsqueeze(-1) * (u - k * (s[n] / d).unsqueeze(-1))
                grads.append(dv.to(src.dtype))
            else:
                grads.append(None)
        return (du * gain.float()).to(query.dtype), (du * query.float()).to(gain.dtype), None, *grads


def attn_res_mix(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """Depth attention over ``sources`` (N+1 tensors [..., d]) with query [d] and gain [d]. Returns [..., d]."""
    return _AttnResMix.apply(query, gain, eps, *sources)


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
