"""Short causal depthwise convolution (kernel W = 4, SiLU) with a carried state, as applied to q, k and v.

    y[t, d] = act( bias[d] + Σ_{i=0..W-1} weight[d, i] * x[t - (W-1) + i, d] )

Positions before the start of a sequence read its carried state ``[N, D, W-1]`` (the W-1 inputs that preceded
it, oldest first), or zeros. With ``cu_seqlens`` the state resets at every sequence start. ``short_conv`` is
vectorised over W shifted copies; ``short_conv_naive`` (cp_kda/naive.py) is the token loop it is tested
against. Backward is
autograd for both (the op is cheap and its graph small).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cp_kda.checks import check_cu_seqlens


def _check(x, weight, bias, initial_state, cu_seqlens, activation):
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError("x: expected a tensor [B,T,D]")
    B, T, D = x.shape
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"weight: expected [D={D}, W], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (D,):
        raise ValueError(f"bias: expected [{D}], got {tuple(bias.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation: expected None or 'silu', got {activation!r}")
    for name, t in (("weight", weight), ("bias", bias), ("initial_state", initial_state)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: device {t.device} does not match x's {x.device}")
    bounds = check_cu_seqlens(cu_seqlens, T, B)
    n_seq = B if bounds is None else len(bounds) - 1
    W = weight.shape[1]
    if initial_state is not None and tuple(initial_state.shape) != (n_seq, D, W - 1):
        raise ValueError(f"initial_state: expected [N,D,W-1] = {(n_seq, D, W - 1)}, got {tuple(initial_state.shape)}")
    return bounds


def _finish(y, bias, activation):
    if bias is not None:
        y = y + bias
    return F.silu(y) if activation in ("silu", "swish") else y


def _final_states(x, bounds, W, initial_state):
    """Last W-1 inputs of each sequence ``[N, D, W-1]`` (reaching into the carried state for short ones)."""
    spans = [(0, x.shape[1])] if bounds is None else list(zip(bounds[:-1], bounds[1:]))
    rows = []
    for i, (s, e) in enumerate(spans):
        xs = x[:, s:e] if bounds is None else x[0, s:e].unsqueeze(0)  # [b, L, D]
        prev = (
            (initial_state[i : i + 1] if bounds is not None else initial_state)
            if initial_state is not None
            else xs.new_zeros(xs.shape[0], xs.shape[2], W - 1)
        )
        rows.append(torch.cat([prev, xs.transpose(1, 2)], dim=2)[..., -(W - 1) :])
    return torch.cat(rows, dim=0)


def short_conv(x, weight, bias=None, activation="silu", initial_state=None, output_final_state=False, cu_seqlens=None):
    """Causal depthwise conv. x ``[B,T,D]``, weight ``[D,W]``, bias ``[D]``, initial_state ``[N,D,W-1]``.

    Returns ``(y [B,T,D], final_state [N,D,W-1] or None)``.
    """
    bounds = _check(x, weight, bias, initial_state, cu_seqlens, activation)
    B, T, D = x.shape
    W = weight.shape[1]
    pos = torch.arange(T, device=x.device)
    if bounds is None:
        start = torch.zeros(T, dtype=torch.long, device=x.device)
        seq = torch.zeros(T, dtype=torch.long, device=x.device)
    else:
        cu = torch.tensor(bounds, device=x.device)
        seq = torch.searchsorted(cu, pos, right=True) - 1  # sequence of each token
        start = cu[seq]
    y = torch.zeros_like(x)
    for i in range(W):
        lag = W - 1 - i  # weight[:, i] reads x[t - lag]
        src = pos - lag
        inside = (src >= start).to(x.dtype)[None, :, None]  # same sequence?
        term = x[:, src.clamp(min=0)] * inside
        if initial_state is not None and lag > 0:
            back = start - src  # 1..lag steps before the start
            use = back >= 1
            slot = (W - 1 - back).clamp(min=0, max=W - 2)
            carried = initial_state[seq if bounds is not None else slice(None)]
            if bounds is None:
                picked = carried[:, :, slot].transpose(1, 2)  # [B,T,D]
            else:
                picked = carried[torch.arange(T, device=x.device), :, slot].unsqueeze(0)
            term = term + picked * use.to(x.dtype)[None, :, None]
        y = y + term * weight[:, i]
    y = _finish(y, bias, activation)
    return y, (_final_states(x, bounds, W, initial_state) if output_final_state else None)
