"""The dense routed-expert step, every expert local: a loop over experts (the twin of the EP step).

``LatentMoE`` runs it when no EP Buffer is attached (one rank holds all E experts, e.g. on the meta device or in
a single-process check); the tests compare the expert-parallel layer against it.
"""

from __future__ import annotations

import torch

from k3.layers import situ_glu


def moe_routed_naive(z, topk_idx, topk_w, w1, w3, w2, acts) -> torch.Tensor:
    """Per-expert loop holding ALL experts: z [s, L], topk [s, K], w1/w3 [E, F, L], w2 [E, L, F] -> [s, L]."""
    out = torch.zeros_like(z)
    for e in range(w1.shape[0]):
        tok, slot = torch.nonzero(topk_idx == e, as_tuple=True)
        if tok.numel():
            h = situ_glu(z[tok] @ w1[e].t(), z[tok] @ w3[e].t(), *acts) @ w2[e].t()
            out = out.index_add(0, tok, h * topk_w[tok, slot][:, None].to(h.dtype))
    return out


__all__ = ["moe_routed_naive"]
