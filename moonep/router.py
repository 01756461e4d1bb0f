"""``SigmoidTopKRouter``: moonep's default router (torch only, so that single-device model code can subclass it
without loading the EP machinery)."""

from __future__ import annotations

import torch
from torch import nn


class SigmoidTopKRouter(nn.Module):
    """Default router: sigmoid scores, top-k on (score + bias), weights = renormalised selected scores.

    The bias [E] steers selection only (load balancing, no gradient, never in the weights).
    x [s, H] -> (topk_idx [s, K] int64, topk_weights [s, K] float32).
    """

    bias_name = "bias"
    """the selection bias's buffer name (a checkpoint key: K3 keeps Hugging Face's ``e_score_correction_bias``)."""

    def __init__(self, H: int, E: int, K: int, *, route_scale: float = 1.0, device=None, init: bool = True) -> None:
        super().__init__()
        if not 1 <= K <= E:
            raise ValueError(f"K must be in [1, E={E}], got {K}")
        self.K, self.route_scale = K, route_scale
        weight = torch.randn(E, H, device=device) / H**0.5 if init else torch.empty(E, H, device=device)
        self.weight = nn.Parameter(weight)
        """[E, H] router projection (init=False: left for the model's own initialisation)."""
        self.register_buffer(self.bias_name, torch.zeros(E, device=device))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [s, H] -> sigmoid scores [s, E] fp32."""
        return torch.sigmoid(x.float() @ self.weight.float().t())

    def select(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """scores [s, E] -> (topk_idx [s, K] on score + bias, renormalised selected scores [s, K] * route_scale)."""
        topk_idx = torch.topk(scores.detach() + getattr(self, self.bias_name), self.K, dim=-1).indices
        w = scores.gather(1, topk_idx)
        return topk_idx, w / (w.sum(-1, keepdim=True) + 1e-20) * self.route_scale  # eps: scores that underflow

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route each token to its top-K experts.

        Args:
            x: [T, H] token activations (any float dtype; scored in fp32).

        Returns:
            ``(topk_idx, topk_weights)``: topk_idx [T, K] int64 expert ids in [0, E), chosen on score + bias;
            topk_weights [T, K] fp32, the selected sigmoid scores renormalised to sum 1 per token, times
            ``route_scale`` (differentiable w.r.t. x and the router weight; the bias gets no gradient).
        """
        return self.select(self.scores(x))


__all__ = ["SigmoidTopKRouter"]
