"""Router-bias load balancing and the max-violation metric, over the global batch.

Axes: ``m`` tokens on this rank, ``E`` experts, ``K`` top-k, ``Lm`` MoE layers, ``nb`` histogram bins.

Quantile Balancing (k3_architecture.md 2.7), per MoE layer and step, from that step's router scores:
    alpha_i = (K+1)-th largest of (s_i + b);  r_ij = alpha_i - s_ij;  b_hat_j = quantile_{K/E}(r_:j)
    b <- b_hat - mean(b_hat)                                   (used from the NEXT step; frozen in eval)
The quantile is read from per-expert histograms of r over [min b - 1, max b + 1] (valid since s in (0, 1)) with
``nb`` bins, summed over the data+expert ranks with ONE all-reduce (together with the load counts), then linearly
interpolated at cumulative rank ceil(m_global K / E) (error <= one bin). ``"sign"`` is DeepSeek-V3's update
b_j += rate * sign(mean load - load_j).

Device-resident: the whole update is tensor ops on the scores' device, with no host read of tensor data and
no data-dependent shape (no ``bincount``, whose CUDA kernel reads the max back), so a step's balancing never
waits for the GPU. The per-expert loop it replaced is ``k3.reference.qb_bias_loop``, which the tests hold it
equal to, bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collectives.base import Communicator

NUM_BINS = 1000  # the report's histogram resolution


def max_violation(counts: torch.Tensor) -> torch.Tensor:
    """counts [Lm, E] global tokens per expert -> [Lm] max_j load_j / mean load - 1 (0 = perfectly balanced)."""
    c = counts.double()
    return c.max(-1).values / c.mean(-1).clamp_min(1e-12) - 1


def qb_range(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bias [E] -> (lo, hi), 0-dim fp64 on bias's device: the histogram range [min b - 1, max b + 1]."""
    lo, hi = torch.aminmax(bias.detach().double())  # exact: every float dtype widens to fp64 without rounding
    return lo - 1.0, hi + 1.0


def _scalar(like: torch.Tensor, value: float) -> torch.Tensor:
    """A 0-dim fp64 tensor on like's device, made by a fill (no host->device copy).

    Dividing by it instead of by a Python number keeps the division correctly rounded on CUDA, which turns a
    host-scalar divisor into a multiply by its reciprocal (off by an ulp; the host-side twin rounds exactly).
    """
    return torch.full((), value, dtype=torch.float64, device=like.device)


def qb_histogram(scores: torch.Tensor, bias: torch.Tensor, K: int, nb: int = NUM_BINS) -> torch.Tensor:
    """scores [m, E] fp32, bias [E] -> int64 counts [E, nb] of r_ij = alpha_i - s_ij over [lo, hi]."""
    E = scores.shape[1]
    alpha = torch.topk(scores + bias, K + 1, dim=-1).values[:, -1:]  # [m, 1] the token's cutoff
    r = (alpha - scores).double()
    lo, hi = qb_range(bias)
    idx = ((r - lo) / (hi - lo) * nb).floor().long().clamp_(0, nb - 1)  # [m, E] bin of each r_ij
    flat = (idx + torch.arange(E, device=idx.device)[None, :] * nb).flatten()
    # A fixed-size scatter, not bincount: its output size never depends on the data (integer adds: deterministic).
    hist = torch.zeros(E * nb, dtype=torch.int64, device=scores.device)
    return hist.scatter_add_(0, flat, torch.ones_like(flat)).view(E, nb)


def qb_bias(hist: torch.Tensor, bias: torch.Tensor, K: int) -> torch.Tensor:
    """Global int64 histogram [E, nb] and the bias it was built with [E] -> the next, mean-centred bias [E].

    Every expert at once: one searchsorted of the rank over the cumulative histogram [E, nb], gathers for the
    counts before and inside the bin it lands in, then the same fp64 operations, in the same order, as the
    per-expert loop ``k3.reference.qb_bias_loop`` (so the result equals it bit for bit).
    """
    E, nb = hist.shape
    lo, hi = qb_range(bias)
    width = (hi - lo) / _scalar(hist, nb)
    m = hist[0].sum()  # every row counts all m tokens (one r per token)
    # ceil(m K / E) in integers: equals math.ceil(m * K / E) of fp64 while m K < 2**52.
    target = torch.div(m * K + (E - 1), E, rounding_mode="floor")
    cum = hist.cumsum(-1)  # [E, nb]
    ranks = target.to(cum.dtype).expand(E, 1).contiguous()  # [E, 1]
    b = torch.searchsorted(cum, ranks).clamp_(max=nb - 1)  # [E, 1] first bin reaching the rank; past the end: last
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp_(min=0)), 0)  # [E, 1] counts below bin b
    inside = hist.gather(1, b).clamp_(min=1)  # [E, 1] an empty bin counts 1
    # Separate ops, not a fused multiply-add, so each rounds as the loop's Python floats do.
    frac = (target - before).double() / inside.double()
    b_hat = (lo + width * (b.double() + frac)).view(E)
    return (b_hat - b_hat.mean()).to(bias.dtype)


@torch.no_grad()
def update_router_biases(moes, comm: Communicator | None, method: str = "qb", rate: float = 1e-3) -> torch.Tensor:
    """Update every MoE layer's ``e_score_correction_bias`` from its last scores; one all-reduce in total.

    Returns [Lm] fp64, on the routers' device: the per-layer max violation of the step just taken (global
    loads). No host read here, so the caller chooses when to pay it (``.tolist()`` where it is logged).
    ``method``: "qb", "sign" or "none" (metric only).
    """
    routers = [moe.gate for moe in moes]
    E, K = routers[0].weight.shape[0], routers[0].K
    parts = [torch.stack([r.last_counts.long() for r in routers]).flatten()]
    if method == "qb":
        parts += [qb_histogram(r.last_scores, r.e_score_correction_bias, K).flatten() for r in routers]
    packed = torch.cat(parts)
    if comm is not None and comm.world_size > 1:
        comm.all_reduce(packed)
    counts = packed[: len(routers) * E].view(len(routers), E)
    for r, c in zip(routers, counts):
        r.last_global_counts = c  # [E] this step's routed slots over the whole group (rows_per_rank reads them)
    if method == "qb":
        hists = packed[len(routers) * E :].view(len(routers), E, NUM_BINS)
        for r, h in zip(routers, hists):
            r.e_score_correction_bias.copy_(qb_bias(h, r.e_score_correction_bias, K))
    elif method == "sign":
        for r, c in zip(routers, counts):
            r.e_score_correction_bias.add_(rate * torch.sign(c.double().mean() - c.double()).float())
    elif method != "none":
        raise ValueError(f"balance: expected 'qb', 'sign' or 'none', got {method!r}")
    return max_violation(counts)


def rows_per_rank(counts: torch.Tensor, R: int) -> torch.Tensor:
    """[L, 2] routed rows on the busiest of R EP ranks per MoE layer, from global counts [L, E]: MoonEP's exact
    plan (ceil(total / R)) and the classic dispatcher (each rank computes its own experts: the hottest home
    group). On the device: no host read."""
    L, E = counts.shape
    ours = (counts.sum(1) + R - 1) // R
    classic = counts.view(L, R, E // R).sum(2).max(1).values
    return torch.stack((ours, classic), dim=1)


__all__ = ["rows_per_rank", "max_violation", "qb_range", "qb_histogram", "qb_bias", "update_router_biases", "NUM_BINS"]
