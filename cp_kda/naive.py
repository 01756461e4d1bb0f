"""Token-by-token KDA recurrence: the reference every faster path is tested against.

Per head, with state ``S [K,V]``, for each token t:

    S <- exp(g_t)[:, None] * S                      # decay first
    S <- S + beta_t * k_t (v_t - S^T k_t)^T          # then the delta correction (reads the decayed state)
    o_t = scale * S^T q_t                            # output reads the state after the token's own write

Backward is plain autograd through the loop (slow, exact). Computation runs in the state dtype (fp32, or fp64
for fp64 inputs); outputs come back in ``v.dtype``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cp_kda.checks import check_kda_inputs, resolve_scale, state_dtype
from cp_kda.conv import _check as _check_conv
from cp_kda.conv import _final_states, _finish
from cp_kda.gate import _check as _check_gate
from cp_kda.gate import _parts
from cp_kda.intra import _segsum


def _recurrent_dense(q, k, v, g, beta, scale, h0):
    """One dense batch. q, k, g ``[B,T,H,K]``, v ``[B,T,H,V]``, beta ``[B,T,H]``, h0 ``[B,H,K,V]``.

    Returns o ``[B,T,H,V]`` and the final state ``[B,H,K,V]`` (compute dtype).
    """
    S = h0
    outs = []
    for t in range(q.shape[1]):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]  # [B,H,K], [B,H,K], [B,H,V]
        S = torch.exp(g[:, t]).unsqueeze(-1) * S  # decay: [B,H,K,1] * [B,H,K,V]
        pred = torch.einsum("bhk,bhkv->bhv", k_t, S)  # what the state predicts for k_t
        delta = beta[:, t].unsqueeze(-1) * (v_t - pred)  # [B,H,V]
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, delta)
        outs.append(torch.einsum("bhk,bhkv->bhv", q_t * scale, S))
    return torch.stack(outs, dim=1), S


def kda_recurrent(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, validate=False
):
    """Reference KDA by the token recurrence.

    Args:
        q, k: ``[B,T,H,K]`` (callers L2-normalise them; no normalisation happens here).
        v: ``[B,T,H,V]``.
        g: ``[B,T,H,K]`` per-token log decay (<= 0, not cumulative).
        beta: ``[B,T,H]`` write strength.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N,H,K,V]`` fp32 (fp64 for fp64 inputs); N = B, or the number of packed sequences.
        output_final_state: return the final states ``[N,H,K,V]`` instead of None.
        cu_seqlens: ``[N+1]`` boundaries of packed sequences (B must be 1); the state resets at each start.
        validate: also check ``g <= 0`` (host sync).

    Returns:
        ``(o [B,T,H,V] in v.dtype, final_state [N,H,K,V] or None)``.
    """
    bounds = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, validate)
    B, T, H, K = q.shape
    V = v.shape[-1]
    cdt = state_dtype(q.dtype)
    out_dtype = v.dtype
    scale = resolve_scale(scale, K)
    q, k, v, g, beta = (x.to(cdt) for x in (q, k, v, g, beta))
    spans = [(0, T)] if bounds is None else list(zip(bounds[:-1], bounds[1:]))
    n_seq = B if bounds is None else len(spans)
    if initial_state is None:
        initial_state = q.new_zeros(n_seq, H, K, V)
    if bounds is None:
        o, S = _recurrent_dense(q, k, v, g, beta, scale, initial_state.to(cdt))
        finals = S
    else:
        outs, states = [], []
        for i, (s, e) in enumerate(spans):
            o_i, S_i = _recurrent_dense(
                q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale, initial_state[i : i + 1].to(cdt)
            )
            outs.append(o_i)
            states.append(S_i)
        o, finals = torch.cat(outs, dim=1), torch.cat(states, dim=0)
    return o.to(out_dtype), (finals if output_final_state else None)


def kda_gate_naive(f, A_log, dt_bias=None, lower_bound=None):
    """Plain-autograd gate. f ``[..., H, K]``, A_log ``[H]``, dt_bias ``[H*K]`` -> g ``[..., H, K]`` fp32."""
    _check_gate(f, A_log, dt_bias, lower_bound)
    x, a = _parts(f, A_log, dt_bias)
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def short_conv_naive(
    x, weight, bias=None, activation="silu", initial_state=None, output_final_state=False, cu_seqlens=None
):
    """Token-loop twin of :func:`short_conv` (same contract)."""
    bounds = _check_conv(x, weight, bias, initial_state, cu_seqlens, activation)
    B, T, D = x.shape
    W = weight.shape[1]
    spans = [(0, T)] if bounds is None else list(zip(bounds[:-1], bounds[1:]))
    outs = []
    for n, (s, e) in enumerate(spans):
        b_rows = slice(None) if bounds is None else slice(n, n + 1)
        window = x.new_zeros(x.shape[0], D, W - 1) if initial_state is None else initial_state[b_rows]
        for t in range(s, e):
            window = torch.cat([window, x[:, t].unsqueeze(-1)], dim=-1)  # [B,D,W], oldest first
            outs.append((window * weight).sum(-1))
            window = window[..., 1:]
    y = _finish(torch.stack(outs, dim=1), bias, activation)
    return y, (_final_states(x, bounds, W, initial_state) if output_final_state else None)


def decay_matrices_naive(q, k, g):
    """Twin of :func:`decay_matrices` from the full pairwise decays ``[..., C, C, K]`` (memory C²K per chunk).

    q, k, g ``[..., C, K]`` -> ``(Aqk, L, eG, Kt, gamma)`` as there."""
    E = _segsum(g).exp()  # [..., i, j, K]; 0 above
    Aqk = torch.einsum("...id,...ijd,...jd->...ij", q, E, k)
    L = torch.einsum("...id,...ijd,...jd->...ij", k, E, k).tril(-1)
    G = g.cumsum(-2)
    return Aqk, L, G.exp(), k * E[..., -1, :, :], G[..., -1, :].exp()
