"""``moonep.MoE``: a drop-in expert-parallel MoE layer (router, balanced dispatch, grouped experts, combine).

Axes: ``s`` tokens on this rank, ``H`` hidden, ``F`` expert FFN size, ``E`` experts, ``K`` top-k, ``R`` ranks,
``epn = E / R``. Rank r holds experts ``[r*epn, (r+1)*epn)`` as ``w13 [epn, H, 2F]`` and ``w2 [epn, F, H]``;
the router and the optional shared expert are replicated (their grads are per-rank partial sums: reduce them
with data-parallel grads as usual).
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch
import torch.nn.functional as Fn
from torch import nn

from .autograd import combine, dispatch
from .buffer import Buffer
from .experts import GroupedExperts
from .geometry import EPGeometry

_LAYER_IDS = itertools.count()


class SigmoidTopKRouter(nn.Module):
    """Default router: sigmoid scores, top-k on (score + bias), weights = renormalised selected scores.

    The bias [E] steers selection only (load balancing, no gradient, never in the weights).
    x [s, H] -> (topk_idx [s, K] int64, topk_weights [s, K] float32).
    """

    def __init__(self, H: int, E: int, K: int, *, route_scale: float = 1.0) -> None:
        super().__init__()
        if not 1 <= K <= E:
            raise ValueError(f"K must be in [1, E={E}], got {K}")
        self.K, self.route_scale = K, route_scale
        self.weight = nn.Parameter(torch.randn(E, H) / H**0.5)
        """[E, H] router projection."""
        self.register_buffer("bias", torch.zeros(E))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(x.float() @ self.weight.float().t())
        topk_idx = torch.topk(scores.detach() + self.bias, self.K, dim=-1).indices
        w = scores.gather(1, topk_idx)
        return topk_idx, w / w.sum(-1, keepdim=True) * self.route_scale


class SharedExpert(nn.Module):
    """Dense SwiGLU applied to every token (replicated on every rank). x [s, H] -> [s, H]."""

    def __init__(self, H: int, F: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.randn(H, 2 * F) / H**0.5)
        self.w2 = nn.Parameter(torch.randn(F, H) / F**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w13
        F = self.w2.shape[0]
        return (Fn.silu(h[:, :F]) * h[:, F:]) @ self.w2


class MoE(nn.Module):
    """Expert-parallel MoE layer: ``y = moe(x)`` for x [..., H] (at most S tokens per call on this rank).

    comm: the EP group's Communicator. H, F, E, K, S (keyword-only): hidden size, expert FFN size, experts,
    top-k, token capacity per rank. buffer: a shared ``Buffer`` (one per group is enough; built if None) whose
    ``EPGeometry`` must be the layer's (token_padding=None takes the buffer's, else 1).
    router: callable x [s, H] -> (topk_idx [s, K], topk_weights [s, K]); default ``SigmoidTopKRouter``.
    shared_F: FFN size of an optional shared expert (0 = none).
    """

    def __init__(
        self,
        comm,
        *,
        H: int,
        F: int,
        E: int,
        K: int,
        S: int,
        router: Callable | None = None,
        shared_F: int = 0,
        token_padding: int | None = None,
        buffer: Buffer | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        pad = token_padding or (buffer.token_padding if buffer is not None else 1)
        geometry = EPGeometry(S=S, H=H, K=K, E=E, token_padding=pad)
        # combine's arguments come from this layer's own expert step: checking them would cost a host read
        self.buffer = buffer or Buffer(comm, **vars(geometry), dtype=dtype, check_reuse=False)
        self._owns_buffer = buffer is None
        b = self.buffer
        if b.geometry != geometry:
            raise ValueError(f"the buffer's {b.geometry} differs from the layer's {geometry}")
        self.H, self.F, self.E, self.K, self.epn = H, F, E, K, b.epn
        self.router = router if router is not None else SigmoidTopKRouter(H, E, K)
        self.w13 = nn.Parameter(torch.randn(b.epn, H, 2 * F, dtype=dtype) / H**0.5)
        """[epn, H, 2F] this rank's experts: gate and up projections side by side."""
        self.w2 = nn.Parameter(torch.randn(b.epn, F, H, dtype=dtype) / F**0.5)
        """[epn, F, H] this rank's experts: down projection."""
        self.shared = SharedExpert(H, shared_F) if shared_F else None
        self._key = ("moe", next(_LAYER_IDS))  # owner key for the shared weight pools
        self.last_plan = None

    def _buffer_on(self, device: torch.device) -> Buffer:
        """The Buffer on the input's device: an owned Buffer follows the data (rebuilt once after a move)."""
        b = self.buffer
        if b.device != device and self._owns_buffer:
            self.buffer = b = Buffer(
                b.comm, **vars(b.geometry), dtype=b.dtype, device=device, check_reuse=b.check_reuse
            )
        return b

    def forward(self, x: torch.Tensor, *, total_num_tokens: int | None = None) -> torch.Tensor:
        shape = x.shape
        self._buffer_on(x.device)
        x2 = x.reshape(-1, self.H)
        topk_idx, topk_weights = self.router(x2)
        recv, recv_w, _, plan = dispatch(
            self.buffer, x2, topk_weights.float(), topk_idx, total_num_tokens=total_num_tokens
        )
        self.last_plan = plan
        z = GroupedExperts.apply(self.buffer, plan, self._key, recv, recv_w, self.w13, self.w2)
        y = combine(self.buffer, plan, z)
        if self.shared is not None:
            y = y + self.shared(x2)
        return y.reshape(shape)
