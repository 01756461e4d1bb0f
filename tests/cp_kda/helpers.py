"""Shared input makers and the comparison metric of the cp_kda tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def make_inputs(B, T, H, K, V, dtype=torch.float64, seed=0, lower_bound=None, with_state=True, N=None):
    """Random KDA inputs in FLA layout, L2-normalised q/k, g <= 0; returned as grad-requiring leaves.

    Returns ``[q, k, v, g, beta, h0]`` (h0 ``[N,H,K,V]`` or None).
    """
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=dtype)

    q = F.normalize(rnd(B, T, H, K), dim=-1)
    k = F.normalize(rnd(B, T, H, K), dim=-1)
    v = rnd(B, T, H, V)
    g = F.logsigmoid(rnd(B, T, H, K)) if lower_bound is None else lower_bound * torch.sigmoid(3 * rnd(B, T, H, K))
    beta = torch.sigmoid(rnd(B, T, H))
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    h0 = torch.randn(N or B, H, K, V, generator=gen, dtype=sdt) if with_state else None
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    return leaves + [h0.requires_grad_() if h0 is not None else None]


def rel_rms(ref: torch.Tensor, test: torch.Tensor) -> float:
    """RMS(ref - test) / RMS(ref), FLA's ``assert_close`` metric (in float64)."""
    ref, test = ref.double(), test.double()
    denom = ref.pow(2).mean().sqrt().item()
    return (ref - test).pow(2).mean().sqrt().item() / max(denom, 1e-300)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def loss_grads(outputs, cotangents, inputs):
    """Gradients of Σ <output, cotangent> w.r.t. the given inputs (None entries skipped)."""
    loss = sum((o * c).sum() for o, c in zip(outputs, cotangents) if o is not None)
    present = [x for x in inputs if x is not None]
    return torch.autograd.grad(loss, present)
