"""Stable LatentMoE (k3_architecture.md 2.5) on ``moonep.dispatch`` / ``moonep.combine``.

Axes: ``s`` tokens on this rank, ``d`` hidden, ``L`` latent (``routed_expert_hidden_size``), ``F`` expert width,
``E`` experts, ``K`` top-k, ``epn = E / R`` experts per EP rank, ``n`` received rows.

    s = sigmoid(W_r x);  T = TopK(s + b) (b: selection-only bias, no gradient);  p_j = s_j / sum_T s * scale
    z = W_down x;  u = sum_{j in T} p_j E_j(z),  E_j(z) = W2_j SiTU-GLU(W1_j z, W3_j z)
    y = W_up RMSNorm(u) + Shared(x)          (shared experts: one SiTU-GLU MLP of width n_shared * F, full width)

Why not ``moonep.MoE``: its experts are SwiGLU over the full hidden width and its output has no latent norm and
up-projection, so K3's block is built here from moonep's differentiable dispatch/combine (in the latent, so
dispatch moves L-wide rows) plus a grouped SiTU-GLU GEMM over the ``[2*epn]`` weight view (own experts, then
the plan's replica slots, filled with ``Buffer.prefetch_weight``; their grads go home with ``reduce_grad``).
Without a Buffer (``buffer is None``: meta device, or no EP group attached) all E experts are local and a
plain loop computes the same function.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import K3Config
from .layers import RMSNorm, SiTUMLP, rms_norm, situ_glu
from .naive import moe_routed_naive


class K3Router(nn.Module):
    """Sigmoid router with a selection-only bias (``gate.weight [E, d]``, ``e_score_correction_bias [E]``).

    x [s, d] -> (topk_idx [s, K] int64, topk_weights [s, K] fp32). Keeps the last step's detached scores
    [s, E] and per-expert counts [E] for load balancing and the max-violation metric.
    """

    def __init__(self, d: int, E: int, K: int, scale: float, *, device=None) -> None:
        super().__init__()
        self.K, self.scale = K, scale
        self.weight = nn.Parameter(torch.empty(E, d, device=device))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, device=device))
        self.last_scores: torch.Tensor | None = None
        self.last_counts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(x.float() @ self.weight.float().t())  # [s, E], fp32
        topk_idx = torch.topk(scores.detach() + self.e_score_correction_bias, self.K, dim=-1).indices
        w = scores.gather(1, topk_idx)
        self.last_scores = scores.detach()
        # a scatter, not bincount: bincount sizes its output from the data (a host sync on a GPU)
        self.last_counts = torch.zeros(scores.shape[1], dtype=torch.int64, device=x.device).scatter_add_(
            0, topk_idx.flatten(), torch.ones_like(topk_idx.flatten())
        )
        return topk_idx, w / (w.sum(-1, keepdim=True) + 1e-20) * self.scale


def situ_experts(x, cu_ends, w1, w3, w2, beta, linear_beta):
    """Grouped SiTU-GLU over segments: x [n, L], cu_ends [G] (segment ends), w1/w3 [G, F, L], w2 [G, L, F].

    Rows outside the segments give 0. A loop over segments (CPU); one grouped GEMM on GPU would do.
    """
    y = torch.zeros_like(x)
    start = 0
    for g, end in enumerate(cu_ends):
        if end > start:
            xs = x[start:end]
            rows = torch.arange(start, end, device=x.device)
            y = y.index_copy(0, rows, situ_glu(xs @ w1[g].t(), xs @ w3[g].t(), beta, linear_beta) @ w2[g].t())
        start = end
    return y


class GroupedSiTUExperts(torch.autograd.Function):
    """z [n, L] = situ_experts(recv rows) * recv_weights on the [2*epn] view; grads go to the local experts.

    The backward recomputes the grouped GEMM under autograd (small at these sizes) and then runs the
    collective ``reduce_grad``, so every rank hits the collectives in the same order (combine^-1, this, dispatch^-1).
    """

    @staticmethod
    def forward(ctx, buffer, plan, acts, x, w, w1, w3, w2):
        epn = buffer.epn
        slots = [torch.zeros_like(t) for t in (w1, w3, w2)]
        buffer.prefetch_weight(plan, [w1.detach(), w3.detach(), w2.detach()], slots)
        full = [torch.cat([t.detach(), s]) for t, s in zip((w1, w3, w2), slots)]  # [2*epn, ...]
        ends = list(plan.cu_host)  # host copy from the dispatch's one read: no sync here
        with torch.no_grad():
            z = situ_experts(x, ends, *full, *acts) * w[:, None].to(x.dtype)
        ctx.buffer, ctx.plan, ctx.acts, ctx.ends, ctx.epn = buffer, plan, acts, ends, epn
        ctx.save_for_backward(x, w, *full)
        return z

    @staticmethod
    def backward(ctx, dz):
        x, w, f1, f3, f2 = ctx.saved_tensors
        leaves = [t.detach().requires_grad_() for t in (x, w, f1, f3, f2)]
        with torch.enable_grad():
            z = situ_experts(leaves[0], ctx.ends, *leaves[2:], *ctx.acts) * leaves[1][:, None].to(x.dtype)
            grads = torch.autograd.grad(z, leaves, dz, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
        dx, dw, g1, g3, g2 = grads
        epn = ctx.epn
        ctx.buffer.reduce_grad(ctx.plan, [g1[:epn], g3[:epn], g2[:epn]], [g1[epn:], g3[epn:], g2[epn:]])
        return None, None, None, dx, dw, g1[:epn].contiguous(), g3[:epn].contiguous(), g2[:epn].contiguous()


class LatentMoE(nn.Module):
    """Stable LatentMoE FFN sublayer. x [B, T, d] (already RMSNorm'ed) -> [B, T, d].

    ``ep_size``/``ep_rank``: this rank holds experts ``[ep_rank*epn, (ep_rank+1)*epn)``; ``attach(buffer)``
    connects the EP group (a ``moonep.Buffer`` over the latent width, shared by all MoE layers).
    """

    def __init__(self, cfg: K3Config, *, ep_size: int = 1, ep_rank: int = 0, device=None) -> None:
        super().__init__()
        d, E, K = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_token
        L, F = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
        if E % ep_size:
            raise ValueError(f"num_experts: {E} is not divisible by the EP size {ep_size}")
        self.E, self.K, self.L, self.epn, self.ep_rank = E, K, L, E // ep_size, ep_rank
        self.acts = (cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        self.gate = K3Router(d, E, K, cfg.routed_scaling_factor, device=device)
        self.routed_expert_down_proj = nn.Linear(d, L, bias=False, device=device)
        self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps, device=device)
        self.routed_expert_up_proj = nn.Linear(L, d, bias=False, device=device)
        self.w1 = nn.Parameter(torch.empty(self.epn, F, L, device=device))
        """[epn, F, L] local experts' gate projections (HF ``experts.N.w1.weight``)."""
        self.w3 = nn.Parameter(torch.empty(self.epn, F, L, device=device))
        """[epn, F, L] local experts' up projections (``experts.N.w3.weight``)."""
        self.w2 = nn.Parameter(torch.empty(self.epn, L, F, device=device))
        """[epn, L, F] local experts' down projections (``experts.N.w2.weight``)."""
        for p in (self.w1, self.w3, self.w2):
            p.expert_shard = (ep_rank * self.epn, E)  # init draws the full [E, ...] tensor and keeps this slice
        width = cfg.num_shared_experts * F
        self.shared_experts = SiTUMLP(d, width, *self.acts, device=device) if width else None
        self.buffer = None

    def attach(self, buffer) -> None:
        """Use ``buffer`` (a ``moonep.Buffer`` with H = L) for dispatch/combine."""
        self.buffer = buffer

    def routed(self, z: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """u [s, L] = sum over each token's K experts of p_j E_j(z)."""
        if self.buffer is None:
            return moe_routed_naive(z, topk_idx, topk_w, self.w1, self.w3, self.w2, self.acts)
        import moonep  # heavy: EP (moonep) loads only when a Buffer is attached; the model is single-device

        recv, recv_w, _, plan = moonep.dispatch(self.buffer, z, topk_w, topk_idx)
        out = GroupedSiTUExperts.apply(self.buffer, plan, self.acts, recv, recv_w, self.w1, self.w3, self.w2)
        return moonep.combine(self.buffer, plan, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        topk_idx, topk_w = self.gate(x2)
        u = self.routed(self.routed_expert_down_proj(x2), topk_idx, topk_w)
        y = self.routed_expert_up_proj(rms_norm(u, self.routed_expert_norm.weight, self.routed_expert_norm.eps))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x2)
        return y.reshape(shape)


__all__ = ["LatentMoE", "K3Router", "GroupedSiTUExperts", "situ_experts"]
