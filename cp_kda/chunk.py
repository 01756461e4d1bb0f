"""Chunkwise KDA (WY/UT form): parallel inside chunks, a short sequential loop over chunk states.

Per chunk of C tokens (per batch row and head), :func:`cp_kda.intra.intra_chunk` builds the chunk-local
quantities (decay matrices Aqk and L, the WY factors W and U, QG, K̃, γ; see there for the formulas and the
numerics), and given the state S at the chunk start

    V' = U - W S,   O = QG S + Aqk V',   S_next = γ ⊙ S + K̃ᵀ V'.

Tensors live chunk-major, ``[NC,N,H,C,X]`` (:mod:`cp_kda.layout`). The forward walks the chunks in groups of
about ``GROUP_ELEMENTS`` per ``[C, K]`` tensor: the group's intra-chunk quantities (all its chunks, rows and heads
batched into single matmuls), its stretch of the state loop (two fused matmuls per chunk), its outputs. So the
temporaries stay cache-sized and only the inputs and the output exist at full length.

Backward (``chunk_bwd``) recomputes the intra-chunk quantities and the chunk-start states (nothing per token is
stored by the forward), runs the state-gradient loop by hand in reverse, then pulls the per-chunk gradients back
to q, k, v, g, beta through autograd of the (parallel, chunk-local) intra-chunk graph.
"""

from __future__ import annotations

import torch

from cp_kda.checks import check_kda_inputs, resolve_scale, state_dtype
from cp_kda.fla_backend import fla_chunk_kda
from cp_kda.intra import intra_chunk
from cp_kda.layout import Layout

GROUP_ELEMENTS = 1 << 18  # elements of one [C, K] tensor over a group of chunks (1 MiB in fp32: about L2-sized)


def state_pass(W, U, Kt, gamma, h0):
    """Sequential loop over chunks (chunk-major). W, Kt ``[n,N,H,C,K]``, U ``[n,N,H,C,V]``, gamma ``[n,N,H,K]``,
    h0 ``[N,H,K,V]``. Returns chunk-start states h ``[n,N,H,K,V]``, pseudo-values V' ``[n,N,H,C,V]`` and the
    final state ``[N,H,K,V]``."""
    n, N, H, C, K = W.shape
    V = U.shape[-1]
    W3, U3, Kt3 = W.reshape(n, N * H, C, K), U.reshape(n, N * H, C, V), Kt.reshape(n, N * H, C, K)
    g3 = gamma.reshape(n, N * H, K, 1)
    h = W.new_empty(n + 1, N * H, K, V)  # h[c]: state entering chunk c; h[n]: the final state
    Vp = U.new_empty(n, N * H, C, V)
    h[0] = h0.reshape(N * H, K, V)
    for c in range(n):  # three ops per chunk: the loop is the only sequential part, so keep it lean
        torch.baddbmm(U3[c], W3[c], h[c], alpha=-1, out=Vp[c])  # V' = U - W S
        torch.baddbmm(g3[c] * h[c], Kt3[c].mT, Vp[c], out=h[c + 1])  # S' = γ ⊙ S + K̃ᵀ V'
    return h[:n].view(n, N, H, K, V), Vp.view(n, N, H, C, V), h[n].view(N, H, K, V)


def _prepare(q, k, v, g, beta, h0, bounds, chunk_size):
    """Cast to the compute dtype and lay out one (padded) sequence per row; returns
    ``(layout, [q, k, v, g, beta] as [N,Tp,H,X] rows, h0)`` (beta ``[N,Tp,H,1]``)."""
    cdt = state_dtype(q.dtype)
    lay = Layout(q.shape[0], q.shape[1], bounds, chunk_size, q.device)
    rows = [lay.rows(x.detach().to(cdt)) for x in (q, k, v, g, beta)]
    if h0 is None:
        h0 = q.new_zeros(lay.n_seq, q.shape[2], q.shape[3], v.shape[3], dtype=cdt)
    return lay, rows, h0.detach().to(cdt)


def _chunks(lay: Layout, rows, sl=slice(None)):
    """Chunks ``sl`` of the input rows, chunk-major: q, k, g ``[n,N,H,C,K]``, v ``[n,N,H,C,V]``, beta
    ``[n,N,H,C]``."""
    out = [lay.chunk_slice(r, sl) for r in rows]
    out[4] = out[4].squeeze(-1)
    return out


def _groups(lay: Layout, heads: int, width: int):
    """Slices of the chunk axis whose ``[C, width]`` tensors hold about GROUP_ELEMENTS elements: the
    intra-chunk temporaries only ever exist for one group, so memory stays flat in T, and the elementwise
    passes, which are memory-bound, stay in cache (over the whole 8k-token benchmark they ran 3-5x slower;
    much smaller groups pay per-op Python overhead instead)."""
    step = max(1, GROUP_ELEMENTS // (lay.n_seq * heads * lay.C * width))
    return [slice(a, min(a + step, lay.n_chunks)) for a in range(0, lay.n_chunks, step)]


def _intra_grouped(lay, chunks, scale):
    """:func:`intra_chunk` over all chunks (chunk-major), one group at a time, into preallocated outputs."""
    outs = None
    for sl in _groups(lay, chunks[0].shape[2], chunks[0].shape[-1]):
        part = intra_chunk(*(c[sl] for c in chunks), scale)
        if outs is None:
            outs = [p.new_empty(lay.n_chunks, *p.shape[1:]) for p in part]
        for full, p in zip(outs, part):
            full[sl] = p
    return outs


def _flat(x):
    """``[n,N,H,a,b]`` -> ``[n*N*H,a,b]``: one matmul batch (a view for every tensor passed here)."""
    return x.reshape(-1, *x.shape[-2:])


def chunk_fwd(q, k, v, g, beta, scale, h0, bounds, chunk_size):
    """Forward without autograd. Public layout in, ``(o [B,T,H,V] compute dtype, ht [N,H,K,V])`` out.

    One group of chunks at a time: its inputs moved to the chunk-major layout, its intra-chunk quantities, its
    stretch of the state loop, its outputs written straight into the output rows."""
    with torch.no_grad():
        lay, rows, S = _prepare(q, k, v, g, beta, h0, bounds, chunk_size)
        H, V = rows[2].shape[2:]
        o_rows = rows[2].new_empty(lay.n_seq, lay.padded, H, V)
        for sl in _groups(lay, H, q.shape[-1]):
            W, U, QG, Aqk, Kt, gamma = intra_chunk(*_chunks(lay, rows, sl), scale)
            h, Vp, S = state_pass(W, U, Kt, gamma, S)
            o = (_flat(QG) @ _flat(h)).baddbmm_(_flat(Aqk), _flat(Vp))  # O = QG S + Aqk V'
            lay.chunk_view(o_rows, sl).copy_(o.view(Vp.shape))
        return lay.from_rows(o_rows), S


def _reverse_state_pass(W, Kt, gamma, AtdO, QtdO, dht):
    """Reverse loop (chunk-major): gradients of the loss w.r.t. each chunk's end state and pseudo-values.

    W, Kt ``[NC,N,H,C,K]``, gamma ``[NC,N,H,K]``, AtdO ``[NC,N,H,C,V]`` (Aqkᵀ dO), QtdO ``[NC,N,H,K,V]`` (QGᵀ dO),
    dht ``[N,H,K,V]``. Returns dS_next ``[NC,N,H,K,V]`` (grad of the state after chunk c), dVp
    ``[NC,N,H,C,V]`` and dh0 ``[N,H,K,V]``."""
    NC, N, H, C, K = W.shape
    V = AtdO.shape[-1]
    W3, Kt3, A3 = W.reshape(NC, N * H, C, K), Kt.reshape(NC, N * H, C, K), AtdO.reshape(NC, N * H, C, V)
    Q3, g3 = QtdO.reshape(NC, N * H, K, V), gamma.reshape(NC, N * H, K, 1)
    dS = W.new_empty(NC + 1, N * H, K, V)  # dS[c]: grad of the state entering chunk c; dS[NC]: of the final one
    dVp = AtdO.new_empty(NC, N * H, C, V)
    dS[NC] = dht.reshape(N * H, K, V)
    for c in range(NC - 1, -1, -1):
        torch.baddbmm(A3[c], Kt3[c], dS[c + 1], out=dVp[c])  # dV' = Aqkᵀ dO + K̃ dS'
        torch.baddbmm(torch.addcmul(Q3[c], g3[c], dS[c + 1]), W3[c].mT, dVp[c], alpha=-1, out=dS[c])
    return dS[1:].view(NC, N, H, K, V), dVp.view(NC, N, H, C, V), dS[0].view(N, H, K, V)


def chunk_bwd(q, k, v, g, beta, scale, h0, bounds, chunk_size, do, dht):
    """Backward by recomputation. ``do [B,T,H,V]``, ``dht [N,H,K,V]`` or None.

    Returns ``(dq, dk, dv, dg, dbeta, dh0)`` in the input dtypes (dh0 in the state dtype).
    """
    with torch.no_grad():
        lay, rows, h0 = _prepare(q, k, v, g, beta, h0, bounds, chunk_size)
        chunks = _chunks(lay, rows)
        W, U, QG, Aqk, Kt, gamma = _intra_grouped(lay, chunks, scale)
        h, Vp, _ = state_pass(W, U, Kt, gamma, h0)
        doc = lay.to_chunks(do.to(h.dtype))
        dht = torch.zeros_like(h0) if dht is None else dht.to(h.dtype)
        AtdO = Aqk.transpose(-1, -2) @ doc
        QtdO = QG.transpose(-1, -2) @ doc
        dSn, dVp, dh0 = _reverse_state_pass(W, Kt, gamma, AtdO, QtdO, dht)
        grads_out = (
            -(dVp @ h.transpose(-1, -2)),  # dW:  V' = U - W S
            dVp,  # dU
            doc @ h.transpose(-1, -2),  # dQG: O = QG S + ...
            doc @ Vp.transpose(-1, -2),  # dAqk: O = ... + Aqk V'
            Vp @ dSn.transpose(-1, -2),  # dKt: S_next = ... + Kt^T V'
            (h * dSn).sum(-1),
        )  # dgamma: S_next = gamma * S + ...
    grads = [torch.zeros_like(c) for c in chunks]
    for sl in _groups(lay, chunks[0].shape[2], chunks[0].shape[-1]):  # recompute each group's graph, pull back
        leaves = [c[sl].requires_grad_(True) for c in chunks]
        with torch.enable_grad():
            outs = intra_chunk(*leaves, scale)
        got = torch.autograd.grad(outs, leaves, [go[sl] for go in grads_out], allow_unused=True)
        for full, part in zip(grads, got):
            if part is not None:
                full[sl] = part
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


def kda_chunk(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    chunk_size=64,
    backend="torch",
    validate=False,
):
    """Chunkwise KDA with its own backward; same contract as :func:`cp_kda.kda_recurrent`.

    Args:
        q, k, g: ``[B,T,H,K]``; v: ``[B,T,H,V]``; beta: ``[B,T,H]``; initial_state ``[N,H,K,V]``.
        chunk_size: C, tokens per chunk (T need not be a multiple of it).
        backend: ``"torch"`` (this module) or ``"fla"`` (flash-linear-attention's ``chunk_kda``, CUDA only).

    Returns:
        ``(o [B,T,H,V] in v.dtype, final_state [N,H,K,V] or None)``.
    """
    if backend == "fla":
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
