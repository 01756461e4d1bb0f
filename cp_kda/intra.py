"""Chunk-local (intra-chunk) KDA quantities, batched over every leading axis (chunks, rows, heads) at once.

Per chunk of C tokens, with G = cumsum(g) inside the chunk and Γ = exp(G):

    Aqk[i,j] = scale * Σ_d q_id k_jd exp(G_id - G_jd)            j <= i
    L[i,j]   = beta_i * Σ_d k_id k_jd exp(G_id - G_jd)            j <  i
    [W | U]  = (I + L)^{-1} [beta ⊙ Γ ⊙ K | beta ⊙ V]             (unit lower-triangular inverse)
    K̃ = K ⊙ exp(G_last - G),  γ = exp(G_last),  QG = scale * Q ⊙ Γ

The chunk is cut into sub-blocks of 16 tokens, each with a reference token. Every decay is a product
``exp(G_i - G_ref(a)) * exp(G_ref(a) - G_ref(b)) * exp(G_ref(b) - G_j)`` (i in block a, j in block b <= a) whose
log-factors are sums of same-signed g's (0/±1 selector matmuls, :func:`_selectors`), never the difference of
two large cumulative sums, so fp32 keeps its relative accuracy deep into a chunk:

- the reference is the block's middle token when every in-block log-decay to it is within ``FACTOR_LIMIT``
  (:func:`_factoring_is_safe`, decided per group of chunks; always so for ordinary gates). In-block factors are
  then within e^±20 and the cross-block factor is <= 1, so what can underflow in fp32 is below 1e-27.
- otherwise (steep gates: K3's bound -5 held for a block, -1000 resets) rows refer to their block start and
  columns to their block end, so every factor is <= 1 and an underflowing factor means the true value
  underflows too; the diagonal sub-blocks then sum the g's between j and i exactly (:func:`_diag_exact`).

Row block a meets only column blocks 0..a, so the masked upper half of both matrices is never multiplied.
``naive.decay_matrices_naive`` builds the same matrices from the full ``[C, C, K]`` pairwise decays: the twin
of :func:`decay_matrices`, too big to be the fast path.
"""

from __future__ import annotations

from functools import lru_cache

import torch

SUB_BLOCK = 16  # tokens per sub-block (the unit of the factored decays)
FACTOR_LIMIT = 20.0  # |log-decay| to the middle token up to which a sub-block's factors keep full precision


def _segsum(x):
    """``out[..., i, j, :] = Σ_{j<m<=i} x[..., m, :]`` for j <= i, -inf above: ``[..., n, K] -> [..., n, n, K]``.

    A masked cumulative sum of same-signed terms, so no cancellation (``G_i - G_j`` of two large cumsums would
    lose the small differences that matter most)."""
    n = x.shape[-2]
    idx = torch.arange(n, device=x.device)
    after_j = (idx[:, None] > idx[None, :])[..., None]  # [m, j, 1]: m > j
    out = torch.where(after_j, x.unsqueeze(-2), torch.zeros((), dtype=x.dtype, device=x.device)).cumsum(-3)
    keep = (idx[:, None] >= idx[None, :])[..., None]
    return torch.where(keep, out, torch.full((), float("-inf"), dtype=x.dtype, device=x.device))


@lru_cache(maxsize=64)  # constants: built once per (size, dtype, device), not once per group of chunks
def _selectors(sub: int, dtype, device):
    """0/±1 matrices whose products with g ``[..., sub, K]`` give partial sums inside one sub-block, each a sum
    of same-signed terms (exact to relative rounding). A matmul because torch's cumsum over a 16-long middle axis
    runs several times slower than this one small GEMM.

    ``mid`` ``[sub+1, sub]``: row i < sub gives ``d_i = Σ_{m<t<=i} g_t`` (i >= m) or ``-Σ_{i<t<=m} g_t`` (i < m),
    the log-decay from the middle token m to i; row sub gives ``Σ_{t<=m} g_t`` (block start through m).
    ``ends`` ``[2 sub, sub]``: ``Σ_{t<=i} g_t`` (block start through i), then ``Σ_{t>j} g_t`` (after j to the end)."""
    i = torch.arange(sub, device=device)[:, None]
    t = torch.arange(sub, device=device)[None, :]
    m = (sub - 1) // 2
    mid = ((m < t) & (t <= i)).to(dtype) - ((i < t) & (t <= m)).to(dtype)
    mid = torch.cat([mid, (t <= m).to(dtype)])
    ends = torch.cat([(t <= i).to(dtype), (t > i).to(dtype)])
    return mid, ends


def _factoring_is_safe(d) -> bool:
    """Whether every log-decay ``d`` between a sub-block's middle token and its other tokens is within
    ``FACTOR_LIMIT``. Then ``exp(G_i - G_j) = exp(d_i) * exp(-d_j)`` has factors in [e^-20, e^20]: no overflow,
    and fp32 keeps ~1e-6 relative accuracy. Typical gates (|g| well below 1) always qualify; extreme ones (K3's
    bound -5 held for 16 tokens, or -1000) take the exact path."""
    lo, hi = d.aminmax()
    return bool(lo >= -FACTOR_LIMIT) and bool(hi <= FACTOR_LIMIT)


def _block_factors(gs):
    """Per-token decay factors of each sub-block, referred to the block's reference tokens.

    gs ``[..., ns, sub, K]`` -> ``(up, down, to_ref, from_ref, tot, exact)``: ``up[i] = exp(G_i - G_ref)`` and
    ``down[j] = exp(G_ref' - G_j)`` ``[..., ns, sub, K]``; the log-decays ``[..., ns, 1, K]`` (<= 0) from the block
    start to the row reference, from the column reference to the block end, and over the whole block; and whether
    the diagonal sub-blocks need :func:`_diag_exact`. ref = ref' = the middle token when
    :func:`_factoring_is_safe`, so up_i * down_j is every in-block decay; otherwise ref is the block start and
    ref' the block end (every factor <= 1)."""
    mid, ends = _selectors(gs.shape[-2], gs.dtype, gs.device)
    sums = mid @ gs  # [..., ns, sub+1, K]
    d = sums[..., :-1, :]
    if _factoring_is_safe(d):
        up = d.exp()
        to_ref, from_ref = sums[..., -1:, :], d[..., -1:, :]
        # 1/up is exp(-d) to one rounding, at a fraction of an exp's cost (|d| <= FACTOR_LIMIT: no overflow)
        return up, up.reciprocal(), to_ref, from_ref, to_ref + from_ref, False
    sub = gs.shape[-2]
    sums = ends @ gs  # [..., ns, 2 sub, K]
    zero = torch.zeros_like(gs[..., :1, :])
    return sums[..., :sub, :].exp(), sums[..., sub:, :].exp(), zero, zero, sums[..., sub - 1 : sub, :], True


def _diag_exact(rows, ks, gs):
    """Diagonal sub-blocks from exact pairwise decays ``Σ_{j<m<=i} g_m`` (no factoring): ``[..., ns, 2, i, j]``.

    rows ``[..., ns, 2, sub, K]`` (q and k rows), ks, gs ``[..., ns, sub, K]``; unmasked. The twin of the
    factored diagonal, and the path for gates too steep to factor."""
    sub, K = gs.shape[-2:]
    ii = torch.arange(sub, device=gs.device)
    select = (ii[None, :, None] < ii[None, None, :]) & (ii[None, None, :] <= ii[:, None, None])  # [i, j, m]
    # decay[i, j] = Σ_{j<m<=i} g_m as one small matmul with a 0/1 selector: a sum of same-signed terms, exact to
    # relative rounding; 0 (so E = 1) above the diagonal, which the caller's mask discards.
    decay = select.to(gs.dtype).reshape(sub * sub, sub) @ gs  # [..., ns, i*j, K]
    E = decay.reshape(*gs.shape[:-2], sub, sub, K).exp()  # [..., ns, i, j, K]
    per_row = rows.transpose(-3, -2) @ (E * ks.unsqueeze(-3)).transpose(-1, -2)  # [..., ns, i, 2, j]
    return per_row.transpose(-3, -2)


def _diag_factored(left, right):
    """Diagonal sub-blocks from middle-token factors, one matmul per sub-block: left ``[..., ns, 2, sub, K]``
    (q and k rows times up), right ``[..., ns, sub, K]`` (k times down) -> ``[..., ns, 2, i, j]``, unmasked."""
    *lead, two, sub, K = left.shape
    return (left.reshape(*lead, two * sub, K) @ right.mT).reshape(*lead, two, sub, sub)


@lru_cache(maxsize=64)
def _keep(sub: int, dtype, device):
    """Diagonal sub-block masks ``[2, i, j]``: q rows keep j <= i, k rows keep j < i."""
    ii = torch.arange(sub, device=device)
    return torch.stack([ii[:, None] >= ii[None, :], ii[:, None] > ii[None, :]]).to(dtype)


@lru_cache(maxsize=64)
def _eye(n: int, dtype, device):
    """The identity ``[n, n]``: right-hand side of the explicit triangular inverse."""
    return torch.eye(n, dtype=dtype, device=device)


@lru_cache(maxsize=64)
def _block_selectors(ns: int, dtype, device):
    """Sums over whole sub-blocks as one small matmul: a 0/1 matrix ``[(ns-1)*ns + 2*ns + 1, ns]`` whose rows
    select the blocks in (b, a-1] for each a >= 1 and b, the blocks after b, the blocks before a, and all blocks;
    and an additive mask ``[ns-1, ns, 1]``, -inf where b >= a (column block b does not precede row block a)."""
    m = torch.arange(ns, device=device)
    a = torch.arange(1, ns, device=device)[:, None, None]
    b = m[None, :, None]
    cross = ((b < m) & (m <= a - 1)).reshape(-1, ns)
    after = m[None, :] > m[:, None]
    before = m[None, :] < m[:, None]
    sel = torch.cat([cross, after, before, torch.ones(1, ns, dtype=torch.bool, device=device)]).to(dtype)
    mask = torch.zeros(ns - 1, ns, 1, dtype=dtype, device=device).masked_fill(b >= a, float("-inf"))
    return sel, mask


def _between(tot, to_ref, from_ref):
    """Log-decays between reference tokens of different sub-blocks, each a sum of same-signed terms.

    tot, to_ref, from_ref ``[..., ns, 1, K]`` -> ``cross`` ``[..., ns-1, ns, K]`` (row a-1, column b < a: from
    block b's column reference to block a's row reference; -inf for b >= a), ``to_end`` ``[..., ns, 1, K]``
    (block b's column reference to the chunk end), ``from_start`` ``[..., ns, 1, K]`` (chunk start to block
    a's row reference) and ``whole`` ``[..., K]`` (the whole chunk)."""
    ns = tot.shape[-3]
    sel, mask = _block_selectors(ns, tot.dtype, tot.device)
    sums = sel @ tot.squeeze(-2)  # [..., rows of sel, K]
    n = (ns - 1) * ns
    cross = sums[..., :n, :].unflatten(-2, (ns - 1, ns)) + to_ref[..., 1:, :, :] + from_ref.transpose(-3, -2)
    to_end = sums[..., n : n + ns, :].unsqueeze(-2) + from_ref
    from_start = sums[..., n + ns : n + 2 * ns, :].unsqueeze(-2) + to_ref
    return cross + mask, to_end, from_start, sums[..., -1, :]


def decay_matrices(q, k, g):
    """``Aqk[i,j] = Σ_d q_id k_jd exp(G_id - G_jd)`` (j <= i) and ``L`` the same with k_i (j < i), 0 above.

    q, k, g ``[..., C, K]`` -> ``(Aqk, L, eG, Kt, gamma)``: the two ``[..., C, C]`` matrices, and by-products
    built from the same factors: ``eG = exp(G)`` (chunk start through i) and ``Kt = k ⊙ exp(G_last - G)`` (k
    decayed to the chunk end), ``[..., C, K]`` each, and ``gamma = exp(G_last)`` ``[..., K]``.
    """
    *lead, C, K = g.shape
    sub = SUB_BLOCK if C % SUB_BLOCK == 0 else C
    ns = C // sub
    gs, qs, ks = (x.reshape(*lead, ns, sub, K) for x in (g, q, k))
    up, down, to_ref, from_ref, tot, exact = _block_factors(gs)
    cross, to_end, from_start, whole = _between(tot, to_ref, from_ref)
    rows = torch.stack([qs, ks], dim=-3)  # [..., ns, 2, sub, K]
    left, right = rows * up.unsqueeze(-3), ks * down
    diag = _diag_exact(rows, ks, gs) if exact else _diag_factored(left, right)
    both = g.new_zeros(*lead, 2, C, C)  # [Aqk, L]
    blocks = both.view(*lead, 2, ns, sub, ns, sub)
    blocks.diagonal(0, -4, -2).copy_((diag * _keep(sub, g.dtype, g.device)).movedim(-4, -1))  # [..., 2, i, j, ns]
    f = cross.exp().unsqueeze(-2)  # [..., a-1, b, 1, K], <= 1
    for a in range(1, ns):  # row block a meets column blocks 0..a-1 only: the upper half is never multiplied
        rt = (right[..., :a, :, :] * f[..., a - 1, :a, :, :]).reshape(*lead, a * sub, K)
        off = left[..., a, :, :, :].reshape(*lead, 2 * sub, K) @ rt.mT
        both[..., a * sub : (a + 1) * sub, : a * sub] = off.reshape(*lead, 2, sub, a * sub)
    eG = (up * from_start.exp()).reshape(*lead, C, K)
    Kt = (right * to_end.exp()).reshape(*lead, C, K)
    return both[..., 0, :, :], both[..., 1, :, :], eG, Kt, whole.exp()


def intra_chunk(q, k, v, g, beta, scale):
    """Chunk-local quantities. q, k, g ``[..., C, K]``, v ``[..., C, V]``, beta ``[..., C]``.

    Returns W ``[...,C,K]``, U ``[...,C,V]``, QG ``[...,C,K]``, Aqk ``[...,C,C]``, Kt ``[...,C,K]``,
    gamma ``[...,K]``.
    """
    C = q.shape[-2]
    qs = q * scale  # scales Aqk and QG alike
    Aqk, L, eG, Kt, gamma = decay_matrices(qs, k, g)
    b = beta.unsqueeze(-1)
    # unitriangular=True treats the diagonal as 1, i.e. inverts I + L. The explicit inverse turns the two
    # right-hand sides into plain matmuls: together ~1.7x faster on a CPU than one 256-wide triangular solve.
    T = torch.linalg.solve_triangular(L * b, _eye(C, q.dtype, q.device), upper=False, unitriangular=True)
    Tb = T * b.mT  # (I + L)^{-1} Diag(beta)
    return Tb @ (eG * k), Tb @ v, qs * eG, Aqk, Kt, gamma
