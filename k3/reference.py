"""Naive twins of k3's fast paths, for tests: host-side Python and per-item loops, written to be read.

``qb_histogram_host`` and ``qb_bias_loop`` are Quantile Balancing (``k3.balance``) as it was before it moved
onto the device: the range read back as Python floats, ``bincount``, and one expert at a time. The device
versions must equal them bit for bit on CPU (tests/k3/test_balance_device.py).
"""
from __future__ import annotations

import math

import torch


def qb_histogram_host(scores: torch.Tensor, bias: torch.Tensor, K: int, nb: int) -> torch.Tensor:
    """scores [m, E], bias [E] -> int64 counts [E, nb] of r_ij = alpha_i - s_ij over [min b - 1, max b + 1]."""
    E = scores.shape[1]
    alpha = torch.topk(scores + bias, K + 1, dim=-1).values[:, -1:]             # [m, 1] the token's cutoff
    r = (alpha - scores).double()
    lo, hi = float(bias.min()) - 1.0, float(bias.max()) + 1.0
    idx = ((r - lo) / (hi - lo) * nb).floor().long().clamp_(0, nb - 1)
    flat = idx + torch.arange(E, device=idx.device)[None, :] * nb
    return torch.bincount(flat.flatten(), minlength=E * nb).view(E, nb)


def qb_bias_loop(hist: torch.Tensor, bias: torch.Tensor, K: int) -> torch.Tensor:
    """Histogram [E, nb] and the bias it was built with [E] -> the next, mean-centred bias [E]; expert by expert.

    The quantile of expert j is linearly interpolated inside the first bin whose cumulative count reaches the
    rank ceil(m K / E) (m = the tokens counted in row 0); an empty bin counts as 1, a rank past the end uses
    the last bin.
    """
    E, nb = hist.shape
    lo, hi = float(bias.min()) - 1.0, float(bias.max()) + 1.0
    width = (hi - lo) / nb
    m = int(hist[0].sum())
    target = math.ceil(m * K / E)
    cum = hist.cumsum(-1)
    b_hat = torch.empty(E, dtype=torch.float64, device=hist.device)
    for j in range(E):
        b = int(torch.searchsorted(cum[j], torch.tensor(target, device=cum.device)))  # first bin reaching the rank
        b = min(b, nb - 1)
        before = int(cum[j, b - 1]) if b > 0 else 0
        inside = max(int(hist[j, b]), 1)
        b_hat[j] = lo + width * (b + (target - before) / inside)
    return (b_hat - b_hat.mean()).to(bias.dtype)


__all__ = ["qb_histogram_host", "qb_bias_loop"]
