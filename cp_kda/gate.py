"""KDA forget gates: raw gate ``f`` -> per-channel log decay ``g <= 0``.

Two forms, both in fp32:

- softplus (Kimi Linear):     g = -exp(A_log[h]) * softplus(f + dt_bias)
- lower bound (K3, lb = -5):  g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))     (so g in (lb, 0))

The lower-bound form replaces the activation, it is not a clamp of the softplus form. ``kda_gate`` has a
hand-written backward that recomputes from (f, A_log, dt_bias) instead of saving intermediates; ``kda_gate_naive``
(cp_kda/naive.py) is its plain-autograd twin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(f, A_log, dt_bias, lower_bound):
    if not isinstance(f, torch.Tensor) or f.dim() < 2:
        raise ValueError("f: expected a tensor [..., H, K]")
    H, K = f.shape[-2:]
    if A_log is not None and tuple(A_log.shape) != (H,):
        raise ValueError(f"A_log: expected shape ({H},) [H], got {tuple(A_log.shape)}")
    if dt_bias is not None and tuple(dt_bias.shape) not in ((H * K,), (H, K)):
        raise ValueError(f"dt_bias: expected shape ({H * K},) [H*K], got {tuple(dt_bias.shape)}")
    if A_log is None and lower_bound is None:
        raise ValueError("A_log: required for the softplus gate (lower_bound=None)")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"lower_bound: must be negative, got {lower_bound}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t is not None and t.device != f.device:
            raise ValueError(f"{name}: device {t.device} does not match f's {f.device}")


def _parts(f, A_log, dt_bias):
    """x = f + dt_bias ``[..., H, K]`` and a = exp(A_log) broadcastable ``[H, 1]`` (1 when A_log is None)."""
    H, K = f.shape[-2:]
    x = f.float() if f.dtype != torch.float64 else f
    if dt_bias is not None:
        x = x + dt_bias.reshape(H, K).to(x.dtype)
    a = torch.ones(H, 1, dtype=x.dtype, device=x.device) if A_log is None else A_log.to(x.dtype).exp()[:, None]
    return x, a


class _GateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, A_log, dt_bias, lower_bound):
        ctx.save_for_backward(f, A_log, dt_bias)
        ctx.lower_bound = lower_bound
        x, a = _parts(f, A_log, dt_bias)
        return -a * F.softplus(x) if lower_bound is None else lower_bound * torch.sigmoid(a * x)

    @staticmethod
    def backward(ctx, dg):
        f, A_log, dt_bias = ctx.saved_tensors
        lb = ctx.lower_bound
        x, a = _parts(f, A_log, dt_bias)
        if lb is None:
            # d softplus = sigmoid; F.softplus is linear above its threshold (20), so its slope is 1 there
            dx = -dg * a * torch.where(x > 20, torch.ones_like(x), torch.sigmoid(x))
            dA = -dg * a * F.softplus(x)  # d exp(A_log) / dA_log = exp(A_log)
        else:
            s = torch.sigmoid(a * x)
            ds = dg * lb * s * (1 - s)
            dx, dA = ds * a, ds * a * x
        H, K = f.shape[-2:]
        lead = tuple(range(dx.dim() - 2))
        dA_log = None if A_log is None else dA.sum(dim=lead).sum(-1).to(A_log.dtype)
        ddt = None if dt_bias is None else dx.sum(dim=lead).reshape(dt_bias.shape).to(dt_bias.dtype)
        return dx.to(f.dtype), dA_log, ddt, None


def kda_gate(f, A_log, dt_bias=None, lower_bound=None):
    """KDA log decay from the raw gate; softplus form, or K3's lower-bound form when ``lower_bound`` is set.

    Args:
        f: ``[..., H, K]`` raw gate (the low-rank projection output), any float dtype.
        A_log: ``[H]`` fp32 per-head log rate (None allowed only with ``lower_bound``: rate 1).
        dt_bias: ``[H*K]`` fp32 bias, or None.
        lower_bound: None for softplus, or a negative number (K3 uses -5).

    Returns:
        g ``[..., H, K]`` fp32 (fp64 for fp64 ``f``), all entries <= 0.
    """
    _check(f, A_log, dt_bias, lower_bound)
    return _GateFunction.apply(f, A_log, dt_bias, lower_bound)
