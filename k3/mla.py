"""Gated MLA without positional encoding (k3_architecture.md 2.4).

Axes: ``B`` sequences, ``T`` tokens, ``d`` hidden, ``h`` heads, ``n`` = qk_nope, ``r`` = qk_rope (a shared,
UN-rotated key slice: K3 is NoPE), ``v`` value width.

    c_q = RMSNorm_1e-6(W_qa x);  q = W_qb c_q -> per head [q_nope | q_r]
    [c_kv | k_r] = W_kva x;      kv = W_kvb RMSNorm_1e-6(c_kv) -> per head [k_nope | v]
    o_h = softmax(q_h k_h^T / sqrt(n + r) + causal) v_h,   k_h = [k_nope_h | k_r]
    y = W_o [concat_h o_h * sigmoid(W_g x)]

Context parallelism: with a ``cp_comm`` of world size > 1 each rank holds the token slice
``[rank*T_l, (rank+1)*T_l)`` of every sequence; keys and values are all-gathered along T (the backward sums the
key/value grads over the group and keeps the local slice), the keys past the slice are dropped and the causal
mask is aligned to the slice's end (``causal_attention``). K3 needs no other mask: no sliding window, and a
training row is one window of the joined byte stream (no per-document mask), so one device runs SDPA's mask-free
causal path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.layers import RMSNorm

if TYPE_CHECKING:
    from collectives.base import Communicator

LORA_EPS = 1e-6  # the LoRA norms use the class default, not rms_norm_eps (release modeling code)


class _GatherTokens(torch.autograd.Function):
    """x [B, h, T_l, c] on each rank of ``comm`` -> [B, h, world*T_l, c] in rank order (differentiable)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm, ctx.T_l = comm, x.shape[2]
        inp = x.permute(2, 0, 1, 3).contiguous()  # [T_l, B, h, c]
        out = inp.new_empty(comm.world_size * inp.shape[0], *inp.shape[1:])
        comm.all_gather(out, inp)
        return out.permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, grad):
        g = grad.permute(2, 0, 1, 3).contiguous()  # [T, B, h, c]
        ctx.comm.all_reduce(g)  # every rank's queries read these keys: sum their grads, keep our slice
        a = ctx.comm.rank * ctx.T_l
        return g[a : a + ctx.T_l].permute(1, 2, 0, 3), None


def causal_mask(T_q: int, T_k: int, offset: int, device=None) -> torch.Tensor:
    """[T_q, T_k] bool, True where key position <= query position (queries start at ``offset``)."""
    return torch.arange(T_k, device=device)[None, :] <= (offset + torch.arange(T_q, device=device))[:, None]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA, the queries being the LAST ``T_q`` of the ``T_k`` key positions: q [B, h, T_q, c],
    k [B, h, T_k, c], v [B, h, T_k, c_v] -> [B, h, T_q, c_v]; query i sees keys ``0 .. T_k - T_q + i``.

    ``T_k == T_q`` (one device, or the first CP rank) is SDPA's own causal path: no mask exists, so the fused
    (flash / memory-efficient) kernels run and nothing of size T x T is kept for the backward. A CP slice further
    on (``T_k > T_q``) on a GPU is the bottom-right causal bias, which those kernels also take without a mask;
    on the CPU, where torch would build that mask itself (and warn), it is the exact [T_q, T_k] bool mask.
    The fused kernels want one head width for q, k and v (MLA has c = 192 > c_v = 128; otherwise SDPA falls back
    to its math path, which keeps fp32 [T, T] probabilities): the narrower side is padded with zero columns,
    which adds nothing to a dot product, and the output sliced back.
    """
    T_q, T_k, c, c_v = q.shape[2], k.shape[2], q.shape[-1], v.shape[-1]
    width = max(c, c_v)
    if c < width:
        q, k = F.pad(q, (0, width - c)), F.pad(k, (0, width - c))
    if c_v < width:
        v = F.pad(v, (0, width - c_v))
    if T_k == T_q:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    elif q.is_cuda:
        from torch.nn.attention.bias import causal_lower_right  # heavy: loads torch._dynamo (1.2-1.5 s a process)

        o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T_q, T_k), scale=scale)
    else:
        mask = causal_mask(T_q, T_k, T_k - T_q, q.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o[..., :c_v]


class GatedMLA(nn.Module):
    """Gated multi-head latent attention sublayer. x [B, T, d] (already RMSNorm'ed) -> [B, T, d]."""

    def __init__(self, cfg: K3Config, *, device=None) -> None:
        super().__init__()
        d, self.h = cfg.hidden_size, cfg.num_attention_heads
        self.n, self.r, self.v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim

        def lin(i: int, o: int) -> nn.Linear:
            return nn.Linear(i, o, bias=False, device=device)

        self.q_a_proj = lin(d, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_EPS, device=device)
        self.q_b_proj = lin(cfg.q_lora_rank, self.h * (self.n + self.r))
        self.kv_a_proj_with_mqa = lin(d, cfg.kv_lora_rank + self.r)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LORA_EPS, device=device)
        self.kv_b_proj = lin(cfg.kv_lora_rank, self.h * (self.n + self.v))
        self.g_proj = lin(d, self.h * self.v)
        self.o_proj = lin(self.h * self.v, d)
        self.kv_lora_rank = cfg.kv_lora_rank
        self.last_max_logit: torch.Tensor | None = None
        """[h] max pre-softmax logit per head of the last forward when ``track_logits`` (for QK-Clip)."""
        self.track_logits = False
        self.cp_comm = None  # set for context parallelism by k3.parallelize.apply_cp

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> q, k [B, h, T, n + r], v [B, h, T, v]."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, self.h, self.n + self.r)
        c_kv, k_r = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.r], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, T, self.h, self.n + self.v)
        k_nope, v = kv.split([self.n, self.v], dim=-1)
        k = torch.cat([k_nope, k_r[:, :, None, :].expand(B, T, self.h, self.r)], dim=-1)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        scale = (self.n + self.r) ** -0.5
        if self.cp_comm is not None and self.cp_comm.world_size > 1:
            k, v = _GatherTokens.apply(k, self.cp_comm), _GatherTokens.apply(v, self.cp_comm)
            end = (self.cp_comm.rank + 1) * T  # keys after our last query are never read: drop them here
            k, v = k[:, :, :end], v[:, :, :end]
        if self.track_logits:
            with torch.no_grad():
                logits = (q @ k.transpose(-1, -2)) * scale
                mask = causal_mask(T, k.shape[2], k.shape[2] - T, x.device)
                self.last_max_logit = logits.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))
        o = causal_attention(q, k, v, scale)  # [B, h, T, v]
        o = o.transpose(1, 2).reshape(B, T, self.h * self.v)
        return self.o_proj(o * torch.sigmoid(self.g_proj(x)))


__all__ = ["GatedMLA", "LORA_EPS", "causal_attention", "causal_mask"]
