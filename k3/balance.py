"""Router-bias load balancing and the max-violation metric, over the global batch.

Axes: ``m`` tokens on this rank, ``E`` experts, ``K`` top-k, ``Lm`` MoE layers, ``nb`` histogram bins.

Quantile Balancing (k3_architecture.md 2.7), per MoE layer and step, from that step's router scores:
    alpha_i = (K+1)-th largest of (s_i + b);  r_ij = alpha_i - s_ij;  b_hat_j = quantile_{K/E}(r_:j)
    b <- b_hat - mean(b_hat)                                   (used from the NEXT step; frozen in eval)
The quantile is read from per-expert histograms of r over [min b - 1, max b + 1] (valid since s in (0, 1)) with
``nb`` bins, summed over the data+expert ranks with ONE all-reduce (together with the load counts), then linearly
interpolated at cumulative rank ceil(m_global K / E) (error <= one bin). ``"sign"`` is DeepSeek-V3's update
b_j += rate * sign(mean load - load_j).
"""
from __future__ import annotations

import math

import torch

NUM_BINS = 1000  # the report's histogram resolution


def max_violation(counts: torch.Tensor) -> torch.Tensor:
    """counts [Lm, E] global tokens per expert -> [Lm] max_j load_j / mean load - 1 (0 = perfectly balanced)."""
    c = counts.double()
    return c.max(-1).values / c.mean(-1).clamp_min(1e-12) - 1


def qb_histogram(scores: torch.Tensor, bias: torch.Tensor, K: int, nb: int = NUM_BINS) -> torch.Tensor:
    """scores [m, E] fp32, bias [E] -> int64 counts [E, nb] of r_ij = alpha_i - s_ij over [lo, hi]."""
    E = scores.shape[1]
    alpha = torch.topk(scores + bias, K + 1, dim=-1).values[:, -1:]             # [m, 1] the token's cutoff
    r = (alpha - scores).double()
    lo, hi = float(bias.min()) - 1.0, float(bias.max()) + 1.0
    idx = ((r - lo) / (hi - lo) * nb).floor().long().clamp_(0, nb - 1)
    flat = idx + torch.arange(E, device=idx.device)[None, :] * nb
    return torch.bincount(flat.flatten(), minlength=E * nb).view(E, nb)


def qb_bias(hist: torch.Tensor, bias: torch.Tensor, K: int) -> torch.Tensor:
    """Global histogram [E, nb] and the bias it was built with [E] -> the next, mean-centred bias [E]."""
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


def qb_exact(scores: torch.Tensor, bias: torch.Tensor, K: int) -> torch.Tensor:
    """Exact single-process twin: sorted-quantile version of the same update (for tests). -> [E]."""
    alpha = torch.topk(scores + bias, K + 1, dim=-1).values[:, -1:]
    r = (alpha - scores).double()
    m, E = r.shape
    target = math.ceil(m * K / E)
    b_hat = r.sort(0).values[target - 1]
    return (b_hat - b_hat.mean()).to(bias.dtype)


@torch.no_grad()
def update_router_biases(moes, comm, method: str = "qb", rate: float = 1e-3) -> list[float]:
    """Update every MoE layer's ``e_score_correction_bias`` from its last scores; one all-reduce in total.

    Returns the per-layer max violation of the step just taken (global loads). ``method``: "qb", "sign" or
    "none" (metric only).
    """
    routers = [moe.gate for moe in moes]
    E, K = routers[0].weight.shape[0], routers[0].K
    parts = [torch.stack([r.last_counts.long() for r in routers]).flatten()]
    if method == "qb":
        parts += [qb_histogram(r.last_scores, r.e_score_correction_bias, K).flatten() for r in routers]
    packed = torch.cat(parts)
    if comm is not None and comm.world_size > 1:
        comm.all_reduce(packed)
    counts = packed[:len(routers) * E].view(len(routers), E)
    if method == "qb":
        hists = packed[len(routers) * E:].view(len(routers), E, NUM_BINS)
        for r, h in zip(routers, hists):
            r.e_score_correction_bias.copy_(qb_bias(h, r.e_score_correction_bias, K))
    elif method == "sign":
        for r, c in zip(routers, counts):
            r.e_score_correction_bias.add_(rate * torch.sign(c.double().mean() - c.double()).float())
    elif method != "none":
        raise ValueError(f"balance: expected 'qb', 'sign' or 'none', got {method!r}")
    return max_violation(counts).tolist()


__all__ = ["max_violation", "qb_histogram", "qb_bias", "qb_exact", "update_router_biases", "NUM_BINS"]
