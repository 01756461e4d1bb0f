"""Chunkwise KDA (WY/UT form): parallel inside chunks, a short sequential loop over chunk states.

Per chunk of C tokens (per batch row and head), with G = cumsum(g) inside the chunk, Γ = exp(G):

    Aqk[i,j] = scale * Σ_d q_id k_jd exp(G_id - G_jd)            j <= i
    L[i,j]   = beta_i * Σ_d k_id k_jd exp(G_id - G_jd)            j <  i
    [W | U]  = (I + L)^{-1} [beta ⊙ Γ ⊙ K | beta ⊙ V]             (unit lower-triangular solve)
    K̃ = K ⊙ exp(G_last - G),  γ = exp(G_last),  QG = scale * Q ⊙ Γ

and, given the state S at the chunk start,

    V' = U - W S,   O = QG S + Aqk V',   S_next = γ ⊙ S + K̃ᵀ V'.

Every exponent is a decay G_i - G_j with j <= i (so <= 0), and is built as a sum of same-signed g's, never as
a difference of two large cumulative sums: diagonal sub-blocks of 16 tokens sum the g's between j and i,
off-diagonal sub-blocks factor the decay through a reference token between j and i, so both factors are <= 1.
Nothing overflows for any gate (an underflowing factor means the true value underflows too) and fp32 keeps
its relative accuracy deep into a chunk.

Backward (``chunk_bwd``) recomputes the intra-chunk quantities and the chunk-start states (nothing per token is
stored by the forward), runs the state-gradient loop by hand in reverse, then pulls the per-chunk gradients back
to q, k, v, g, beta through autograd of the (parallel, chunk-local) intra-chunk graph.
"""
from __future__ import annotations

import torch

from .checks import check_kda_inputs, resolve_scale, state_dtype
from .layout import Layout

SUB_BLOCK = 16  # diagonal sub-block size: exact pairwise decays inside, factored decays between
GROUP_TOKENS = 1024  # tokens per group of chunks whose intra-chunk temporaries exist at once


def _segsum(x):
    """``out[..., i, j, :] = Σ_{j<m<=i} x[..., m, :]`` for j <= i, -inf above: ``[..., n, K] -> [..., n, n, K]``.

    A masked cumulative sum of same-signed terms, so no cancellation (``G_i - G_j`` of two large cumsums would
    lose the small differences that matter most)."""
    n = x.shape[-2]
    idx = torch.arange(n, device=x.device)
    after_j = (idx[:, None] > idx[None, :])[..., None]                           # [m, j, 1]: m > j
    out = torch.where(after_j, x.unsqueeze(-2), torch.zeros((), dtype=x.dtype, device=x.device)).cumsum(-3)
    keep = (idx[:, None] >= idx[None, :])[..., None]
    return torch.where(keep, out, torch.full((), float("-inf"), dtype=x.dtype, device=x.device))


def _reverse_exclusive_cumsum(x):
    """``out[..., j, :] = Σ_{m>j} x[..., m, :]`` along dim -2."""
    rc = x.flip(-2).cumsum(-2).flip(-2)
    return torch.cat([rc[..., 1:, :], torch.zeros_like(rc[..., :1, :])], dim=-2)


def _decay_matrices(q, k, g):
    """``Aqk[i,j] = Σ_d q_id k_jd exp(G_id - G_jd)`` (j <= i) and ``Lkk`` the same with k_i (j < i), 0 above.

    q, k, g ``[..., C, K]`` -> two ``[..., C, C]``. Diagonal sub-blocks sum the g's between j and i directly
    (the difference of two large cumulative sums would lose, in fp32, the small decays that matter most).
    Off-diagonal pairs (block(i) > block(j) = b) factor the decay through the end of block b, which lies between
    j and i: ``exp(G_i - G_j) = left[i, b] * right[j]``, both <= 1, each built from sums of same-signed g.
    """
    C, K = g.shape[-2:]
    sub = SUB_BLOCK if C % SUB_BLOCK == 0 else C
    ns = C // sub
    lead = g.shape[:-2]
    gs, qs, ks = (x.reshape(*lead, ns, sub, K) for x in (g, q, k))
    ii = torch.arange(sub, device=g.device)
    within = gs.cumsum(-2)                                                     # decay from block start to i
    diag = _diag_factored(qs, ks, within) if _factoring_is_safe(within) else _diag_exact(qs, ks, gs)
    keep = torch.stack([ii[:, None] >= ii[None, :], ii[:, None] > ii[None, :]], dim=-2)  # [i, 2, j]
    diag = diag * keep.to(g.dtype)
    between = _segsum(within[..., -1, :])                                     # whole blocks a' in (b, a]
    blk = torch.arange(C, device=g.device) // sub
    gap = between[..., (blk - 1).clamp(min=0), :, :]                           # [..., C, ns, K]
    left = (within.reshape(*lead, C, 1, K) + gap).clamp(max=0).exp()
    right = _reverse_exclusive_cumsum(gs).exp()                                # decay from j to its block end
    qkL = torch.stack([q, k], dim=-2).unsqueeze(-2) * left.unsqueeze(-3)       # [..., C, 2, ns, K]
    off = torch.einsum("...ixbd,...bjd->...ixbj", qkL, ks * right)             # [..., C, 2, ns, sub]
    below = (blk[:, None] > torch.arange(ns, device=g.device)[None, :]).to(g.dtype)  # [C, ns]
    off = off * below[:, None, :, None]
    eye = torch.eye(ns, dtype=g.dtype, device=g.device)
    full = off.reshape(*lead, ns, sub, 2, ns, sub) + diag.unsqueeze(-2) * eye[:, None, None, :, None]
    return full[..., 0, :, :].reshape(*lead, C, C), full[..., 1, :, :].reshape(*lead, C, C)


FACTOR_LIMIT = 20.0  # |log-decay| inside a sub-block up to which the factored diagonal keeps full precision


def _middle(within):
    """The cumulative decay at each sub-block's middle token, ``[..., ns, 1, K]`` (a reference point that
    halves the largest exponent either factor sees)."""
    m = (within.shape[-2] - 1) // 2
    return within[..., m:m + 1, :]


def _factoring_is_safe(within) -> bool:
    """Whether every sub-block's decays stay within ``FACTOR_LIMIT`` of its middle token.

    Then ``exp(G_i - G_j) = exp(G_i - G_mid) * exp(G_mid - G_j)`` has factors in [e^-20, e^20]: no overflow, and
    each exponent is small enough that fp32 keeps ~1e-6 relative accuracy. Typical gates (|g| well below 1)
    always qualify; extreme ones (K3's bound -5 held for 16 tokens, or -1000) take the exact path.
    """
    mid = _middle(within)
    return bool(((within - mid).abs() <= FACTOR_LIMIT).all())


def _diag_factored(qs, ks, within):
    """Diagonal sub-blocks as one matmul per sub-block: ``[..., ns, i, 2, j]`` (q-row and k-row products).

    Fast path; :func:`_diag_exact` is its twin and is used whenever :func:`_factoring_is_safe` says no."""
    mid = _middle(within)
    up, down = (within - mid).exp(), (mid - within).exp()
    sub, K = qs.shape[-2:]
    left = (torch.stack([qs, ks], dim=-2) * up.unsqueeze(-2)).reshape(*qs.shape[:-2], sub * 2, K)
    return (left @ (ks * down).transpose(-1, -2)).reshape(*qs.shape[:-2], sub, 2, sub)


def _diag_exact(qs, ks, gs):
    """Diagonal sub-blocks from exact pairwise decays ``Σ_{j<m<=i} g_m`` (no factoring): ``[..., ns, i, 2, j]``."""
    sub, K = gs.shape[-2:]
    ii = torch.arange(sub, device=gs.device)
    select = (ii[None, :, None] < ii[None, None, :]) & (ii[None, None, :] <= ii[:, None, None])  # [i, j, m]
    # decay[i, j] = Σ_{j<m<=i} g_m as one small matmul with a 0/1 selector: a sum of same-signed terms, exact to
    # relative rounding; 0 (so E = 1) above the diagonal, which the caller's mask discards.
    decay = select.to(gs.dtype).reshape(sub * sub, sub) @ gs                   # [..., ns, i*j, K]
    E = decay.reshape(*gs.shape[:-2], sub, sub, K).exp()                       # [..., ns, i, j, K]
    return torch.stack([qs, ks], dim=-2) @ (E * ks.unsqueeze(-3)).transpose(-1, -2)


def intra_chunk(q, k, v, g, beta, scale):
    """Chunk-local quantities. q, k, g ``[..., C, K]``, v ``[..., C, V]``, beta ``[..., C]``.

    Returns W ``[...,C,K]``, U ``[...,C,V]``, QG ``[...,C,K]``, Aqk ``[...,C,C]``, Kt ``[...,C,K]``,
    gamma ``[...,K]``.
    """
    K = q.shape[-1]
    Aqk, L = _decay_matrices(q, k, g)
    Aqk = Aqk * scale
    L = L * beta.unsqueeze(-1)
    G = g.cumsum(-2)
    eG = G.exp()
    rhs = torch.cat([beta.unsqueeze(-1) * eG * k, beta.unsqueeze(-1) * v], dim=-1)
    # unitriangular=True: the solver treats the diagonal as 1, i.e. it solves (I + L) X = rhs.
    X = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    W, U = X[..., :K], X[..., K:]
    Kt = k * _reverse_exclusive_cumsum(g).exp()                                # decay from token to chunk end
    return W, U, q * eG * scale, Aqk, Kt, G[..., -1, :].exp()


def state_pass(W, U, Kt, gamma, h0):
    """Sequential loop over chunks. W, Kt ``[N,H,NC,C,K]``, U ``[N,H,NC,C,V]``, gamma ``[N,H,NC,K]``,
    h0 ``[N,H,K,V]``. Returns chunk-start states h ``[N,H,NC,K,V]``, pseudo-values V' ``[N,H,NC,C,V]`` and the
    final state ``[N,H,K,V]``."""
    NC = W.shape[2]
    h = W.new_empty(*h0.shape[:2], NC, *h0.shape[2:])
    Vp = torch.empty_like(U)
    S = h0
    for c in range(NC):
        h[:, :, c] = S
        vp = U[:, :, c] - W[:, :, c] @ S
        Vp[:, :, c] = vp
        S = gamma[:, :, c].unsqueeze(-1) * S + Kt[:, :, c].transpose(-1, -2) @ vp
    return h, Vp, S


def _prepare(q, k, v, g, beta, h0, bounds, chunk_size):
    """Cast to the compute dtype and move to the chunked layout; returns ``(layout, [qc,kc,vc,gc,bc], h0)``."""
    cdt = state_dtype(q.dtype)
    lay = Layout(q.shape[0], q.shape[1], bounds, chunk_size, q.device)
    chunks = [lay.to_chunks(x.detach().to(cdt)) for x in (q, k, v, g, beta)]
    if h0 is None:
        h0 = q.new_zeros(lay.n_seq, q.shape[2], q.shape[3], v.shape[3], dtype=cdt)
    return lay, chunks, h0.detach().to(cdt)


def _groups(lay: Layout):
    """Slices of the chunk axis holding about GROUP_TOKENS tokens each: the intra-chunk temporaries
    (``[..., C, sub, K]``-sized) only ever exist for one group, so memory stays flat in T."""
    step = max(1, GROUP_TOKENS // lay.C)
    return [slice(a, min(a + step, lay.n_chunks)) for a in range(0, lay.n_chunks, step)]


def _intra_grouped(lay, chunks, scale):
    """:func:`intra_chunk` over all chunks, one group at a time, written into preallocated outputs."""
    outs = None
    for sl in _groups(lay):
        part = intra_chunk(*(c[:, :, sl] for c in chunks), scale)
        if outs is None:
            outs = [p.new_empty(*p.shape[:2], lay.n_chunks, *p.shape[3:]) for p in part]
        for full, p in zip(outs, part):
            full[:, :, sl] = p
    return outs


def chunk_fwd(q, k, v, g, beta, scale, h0, bounds, chunk_size):
    """Forward without autograd. Public layout in, ``(o [B,T,H,V] compute dtype, ht [N,H,K,V])`` out."""
    with torch.no_grad():
        lay, chunks, h0 = _prepare(q, k, v, g, beta, h0, bounds, chunk_size)
        W, U, QG, Aqk, Kt, gamma = _intra_grouped(lay, chunks, scale)
        h, Vp, ht = state_pass(W, U, Kt, gamma, h0)
        o = QG @ h + Aqk @ Vp
        return lay.from_chunks(o), ht


def _reverse_state_pass(W, Kt, gamma, AtdO, QtdO, dht):
    """Reverse loop: gradients of the loss w.r.t. each chunk's end state and pseudo-values.

    Returns dS_next ``[N,H,NC,K,V]`` (grad of the state after chunk c), dVp ``[N,H,NC,C,V]`` and dh0."""
    NC = W.shape[2]
    dSn = W.new_empty(*dht.shape[:2], NC, *dht.shape[2:])
    dVp = torch.empty_like(AtdO)
    dS = dht
    for c in range(NC - 1, -1, -1):
        dSn[:, :, c] = dS
        dvp = AtdO[:, :, c] + Kt[:, :, c] @ dS
        dVp[:, :, c] = dvp
        dS = QtdO[:, :, c] + gamma[:, :, c].unsqueeze(-1) * dS - W[:, :, c].transpose(-1, -2) @ dvp
    return dSn, dVp, dS


def chunk_bwd(q, k, v, g, beta, scale, h0, bounds, chunk_size, do, dht):
    """Backward by recomputation. ``do [B,T,H,V]``, ``dht [N,H,K,V]`` or None.

    Returns ``(dq, dk, dv, dg, dbeta, dh0)`` in the input dtypes (dh0 in the state dtype).
    """
    with torch.no_grad():
        lay, chunks, h0 = _prepare(q, k, v, g, beta, h0, bounds, chunk_size)
        W, U, QG, Aqk, Kt, gamma = _intra_grouped(lay, chunks, scale)
        h, Vp, _ = state_pass(W, U, Kt, gamma, h0)
        doc = lay.to_chunks(do.to(h.dtype))
        dht = torch.zeros_like(h0) if dht is None else dht.to(h.dtype)
        AtdO = Aqk.transpose(-1, -2) @ doc
        QtdO = QG.transpose(-1, -2) @ doc
        dSn, dVp, dh0 = _reverse_state_pass(W, Kt, gamma, AtdO, QtdO, dht)
        grads_out = (-(dVp @ h.transpose(-1, -2)),            # dW:  V' = U - W S
                     dVp,                                     # dU
                     doc @ h.transpose(-1, -2),               # dQG: O = QG S + ...
                     doc @ Vp.transpose(-1, -2),              # dAqk: O = ... + Aqk V'
                     Vp @ dSn.transpose(-1, -2),              # dKt: S_next = ... + Kt^T V'
                     (h * dSn).sum(-1))                       # dgamma: S_next = gamma * S + ...
    grads = [torch.zeros_like(c) for c in chunks]
    for sl in _groups(lay):  # recompute each group's intra-chunk graph and pull its gradients back
        leaves = [c[:, :, sl].requires_grad_(True) for c in chunks]
        with torch.enable_grad():
            outs = intra_chunk(*leaves, scale)
        got = torch.autograd.grad(outs, leaves, [go[:, :, sl] for go in grads_out], allow_unused=True)
        for full, part in zip(grads, got):
            if part is not None:
                full[:, :, sl] = part
    # to_chunks only pads and permutes, so its adjoint is from_chunks (dropping the padding)
    out = [lay.from_chunks(d).to(x.dtype) for d, x in zip(grads, (q, k, v, g, beta))]
    return (*out, dh0)


class _KDAChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, bounds, chunk_size):
        o, ht = chunk_fwd(q, k, v, g, beta, scale, h0, bounds, chunk_size)
        ctx.save_for_backward(q, k, v, g, beta, h0)
        ctx.args = (scale, bounds, chunk_size)
        return o.to(v.dtype), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        scale, bounds, chunk_size = ctx.args
        dq, dk, dv, dg, dbeta, dh0 = chunk_bwd(q, k, v, g, beta, scale, h0, bounds, chunk_size, do, dht)
        return dq, dk, dv, dg, dbeta, (dh0 if h0 is not None else None), None, None, None


def kda_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              chunk_size=64, backend="torch", validate=False):
    """Chunkwise KDA with its own backward; same contract as :func:`cp_kda.kda_recurrent`.

    Args:
        q, k, g: ``[B,T,H,K]``; v: ``[B,T,H,V]``; beta: ``[B,T,H]``; initial_state ``[N,H,K,V]``.
        chunk_size: C, tokens per chunk (T need not be a multiple of it).
        backend: ``"torch"`` (this module) or ``"fla"`` (flash-linear-attention's ``chunk_kda``, CUDA only).

    Returns:
        ``(o [B,T,H,V] in v.dtype, final_state [N,H,K,V] or None)``.
    """
    if backend == "fla":
        from .fla_backend import fla_chunk_kda
        return fla_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    if backend != "torch":
        raise ValueError(f"backend: expected 'torch' or 'fla', got {backend!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    bounds = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, validate)
    scale = resolve_scale(scale, q.shape[-1])
    bounds = None if bounds is None else tuple(bounds)
    o, ht = _KDAChunkFunction.apply(q, k, v, g, beta, initial_state, scale, bounds, chunk_size)
    return o, (ht if output_final_state else None)
