"""Stand-ins for the fused kernels Megatron / TE / FLA / mamba_ssm run, keeping exactly what each keeps for its
backward (``act_terms``' module docstring), and the counter that measures it (``simulator.calibrate_activations``
builds layers from them).

``SavedCounter`` runs a forward under ``torch.autograd.graph.saved_tensors_hooks``: every storage autograd keeps is
counted once (``untyped_storage().data_ptr()``, whole ``nbytes()``), parameters and views of them not at all, and
charged to a term: the label a stand-in put on the tensor (``label``), else the innermost ``term`` block running.
Forward only: the Functions' backwards are not needed to count what they keep.

This module imports torch: only tests and a CLI load it; the planner never does.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

_ACTIVE: list[SavedCounter] = []


class SavedCounter:
    """Context manager: ``bytes[term]`` every storage saved for backward during the block, each once."""

    def __init__(self, params) -> None:
        self.bytes: dict[str, int] = {}
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._seen: set[int] = set()
        self._labels: dict[int, str] = {}
        self._stack: list[str] = ["other"]
        self._keep: list[torch.Tensor] = []  # saved tensors stay alive: no address is reused while counting

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._params or ptr in self._seen or storage.nbytes() == 0:
            return t
        self._seen.add(ptr)
        self._keep.append(t)
        name = self._labels.get(ptr, self._stack[-1])
        self.bytes[name] = self.bytes.get(name, 0) + storage.nbytes()
        return t

    def __enter__(self) -> SavedCounter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.pop()
        self._hooks.__exit__(*exc)


def label(t: torch.Tensor, name: str) -> torch.Tensor:
    """Charge ``t``'s storage to term ``name`` when it is saved (whoever saves it)."""
    if _ACTIVE:
        _ACTIVE[-1]._labels.setdefault(t.untyped_storage().data_ptr(), name)
    return t


@contextlib.contextmanager
def term(name: str):
    """Storages first saved inside the block (and not labelled) are charged to ``name``."""
    if not _ACTIVE:
        yield
        return
    _ACTIVE[-1]._stack.append(name)
    try:
        yield
    finally:
        _ACTIVE[-1]._stack.pop()


class RMSNorm(torch.autograd.Function):
    """Fused RMSNorm: keeps its input and an fp32 rstd per row."""

    @staticmethod
    def forward(ctx, x, w):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        ctx.save_for_backward(x, w, rstd)
        return (xf * rstd).to(x.dtype) * w


class FlashAttn(torch.autograd.Function):
    """Flash attention (causal): keeps q, k, v [n, heads, d], its output o and the fp32 lse [heads, n]."""

    @staticmethod
    def forward(ctx, q, k, v):
        n, nh = q.shape[0], q.shape[1]
        rep = nh // k.shape[1]
        qh, kh, vh = q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float()
        kh, vh = kh.repeat_interleave(rep, 0), vh.repeat_interleave(rep, 0)
        s = qh @ kh.transpose(1, 2) / q.shape[-1] ** 0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1)  # [heads, n] fp32
        o = (torch.exp(s - lse.unsqueeze(-1)) @ vh).transpose(0, 1).contiguous().to(q.dtype)
        label(o, "attn_out")
        label(lse, "lse")
        ctx.save_for_backward(q, k, v, o, lse)
        return o


class Rope(torch.autograd.Function):
    """Fused RoPE (+ split): writes each output as its own contiguous tensor, keeps nothing (cos/sin are fixed)."""

    @staticmethod
    def forward(ctx, *parts):
        return tuple(p.contiguous().clone() for p in parts)


class SwiGLU(torch.autograd.Function):
    """SwiGLU over ``[n, 2F]`` (gate half first), optionally times a per-row probability (``weighted_bias_swiglu``):
    keeps its input and the probability."""

    @staticmethod
    def forward(ctx, x, probs=None):
        g, u = x.float().chunk(2, -1)
        y = F.silu(g) * u
        if probs is not None:
            y = y * probs.unsqueeze(-1)
        ctx.save_for_backward(x, probs)
        return y.to(x.dtype)


class Permute(torch.autograd.Function):
    """Fused permutation of tokens [n, d] and probabilities [n, K] into expert order [n K, ...]: keeps an int32
    row map (the un-permutation reuses it)."""

    @staticmethod
    def forward(ctx, x, probs, order):
        row_map = order.to(torch.int32)
        ctx.save_for_backward(row_map)
        return x[order // probs.shape[1]], probs.reshape(-1)[order], row_map


class Unpermute(torch.autograd.Function):
    """Sum of each token's routed copies back in token order; with ``probs`` (applied at the combine) keeps the
    expert output and the probabilities."""

    @staticmethod
    def forward(ctx, y, row_map, k, probs=None):
        ctx.save_for_backward(row_map, *(() if probs is None else (y, probs)))
        w = y.float() if probs is None else y.float() * probs.unsqueeze(-1)
        out = torch.zeros(y.shape[0] // k, y.shape[1], dtype=torch.float32)
        out.index_add_(0, row_map.long() // k, w)
        return out.to(y.dtype)


class ShortConv(torch.autograd.Function):
    """FLA's fused causal short convolution with SiLU: keeps its input (the taps are a parameter)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return causal_conv(x, w)


def causal_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution of ``x`` [n, C] with taps ``w`` [C, taps], then SiLU."""
    n, taps = x.shape[0], w.shape[1]
    pad = torch.cat([x.new_zeros(taps - 1, x.shape[1]), x]).float()
    return F.silu(sum(pad[i : i + n] * w[:, i].float() for i in range(taps))).to(x.dtype)


class ChunkKDA(torch.autograd.Function):
    """FLA ``chunk_kda`` with the l2norm, gate and beta sigmoid in-kernel, q, k, v, g [n, h, d], beta [n, h]:
    keeps the normalised q, k and their fp32 rstd, v, the raw gate, beta and its fp32 sigmoid, and the bf16
    ``Aqk``, ``Akk`` [n, h, chunk]."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, chunk):
        q_rstd, k_rstd = (torch.rsqrt(t.float().pow(2).sum(-1) + 1e-6) for t in (q, k))
        qn, kn = (q.float() * q_rstd[..., None]).to(q.dtype), (k.float() * k_rstd[..., None]).to(k.dtype)
        b = torch.sigmoid(beta.float())
        aqk, akk = (q.new_zeros(q.shape[0], q.shape[1], chunk) for _ in range(2))
        for t in (qn, kn, q_rstd, k_rstd, v):
            label(t, "kda_qkv")
        label(aqk, "kda_intra"), label(akk, "kda_intra"), label(b, "kda_beta")
        ctx.save_for_backward(qn, q_rstd, kn, k_rstd, v, g, beta, b, aqk, akk)
        return (v.float() * b[..., None]).to(v.dtype)


class RMSNormGated(torch.autograd.Function):
    """FLA's ``FusedRMSNormGated`` per head (sigmoid gate): keeps its input, the gate and an fp32 rstd per head."""

    @staticmethod
    def forward(ctx, o, gate, w):
        rstd = torch.rsqrt(o.float().pow(2).mean(-1) + 1e-6)
        label(rstd, "kda_out")
        ctx.save_for_backward(o, gate, w, rstd)
        return (o.float() * rstd[..., None] * w.float() * torch.sigmoid(gate.float())).to(o.dtype)


class MambaSplitConv1dScan(torch.autograd.Function):
    """mamba_ssm's ``mamba_split_conv1d_scan_combined`` as Megatron's ``MambaMixer._ssm_training`` calls it (no norm
    weight, no out-projection inside): from the in-projection's output ``zxbcdt`` [n, 2 Di + 2 G N + nh], the causal
    convolution over x, B and C, the SSD scan and the SiLU(z) gate. Keeps ``zxbcdt`` and the scan's ungated output
    ``out_x`` [n, Di]; its backward recomputes the convolution. (The stand-in's scan is the convolved x.)"""

    @staticmethod
    def forward(ctx, zxbcdt, conv_w, di):
        z, xbc = zxbcdt[:, :di].float(), zxbcdt[:, di : di + conv_w.shape[0]]
        out_x = causal_conv(xbc, conv_w)[:, :di].contiguous()
        label(out_x, "mamba_scan_out")
        ctx.save_for_backward(zxbcdt, conv_w, out_x)
        return (out_x.float() * F.silu(z)).to(zxbcdt.dtype)


class GroupRMSNorm(torch.autograd.Function):
    """mamba_ssm's ``RMSNormGated`` without a gate, normalising each of ``groups`` slices of the row apart (Megatron's
    Mamba ``norm``): keeps its input and an fp32 rstd per group."""

    @staticmethod
    def forward(ctx, x, w, groups):
        xg = x.float().view(x.shape[0], groups, -1)
        rstd = torch.rsqrt(xg.pow(2).mean(-1) + 1e-5)
        ctx.save_for_backward(x, w, rstd)
        return ((xg * rstd[..., None]).view_as(x) * w.float()).to(x.dtype)


__all__ = [
    "ChunkKDA",
    "FlashAttn",
    "GroupRMSNorm",
    "MambaSplitConv1dScan",
    "Permute",
    "RMSNorm",
    "RMSNormGated",
    "Rope",
    "SavedCounter",
    "ShortConv",
    "SwiGLU",
    "Unpermute",
    "label",
    "term",
]
