"""The affine state map of a span and the per-rank steps of context parallelism (pure math, no communication).

Over any span of one sequence the end state is affine in the incoming one: ``S_end = M S_in + B`` per head
(M ``[K,K]``, B ``[K,V]``). Both come from one chunked pass on an augmented state ``[B | M]`` of width V + K,
started from ``[0 | I]`` with zero values in the M columns. Composition: ``(M2,B2)∘(M1,B1) = (M2 M1, M2 B1 + B2)``.

Outputs are linear in S_in as well: ``o_t = o_t⁰ + q̃_tᵀ S_in`` with ``q̃_t = scale P_tᵀ q_t`` (P_t the prefix
transition), the output of the M columns of that same augmented pass. So the gradient reaching S_in from this
rank's own outputs is ``D = Σ_t q̃_t do_tᵀ`` and a rank's backward message is ``[D | Mᵀ]``:
``dS_in[r] = D_r + M_rᵀ dS_in[r+1]``.

The ``rank_*`` functions are one rank's steps; ``cp.py`` glues them with a communicator, ``cp_in_process.py``
with a Python list standing in for the all-gather. Transfers and messages live in the state dtype (fp32; fp64 for
fp64 inputs). Shapes: local q ``[B,T_l,H,K]``; transfers and messages ``[Bt,H,K,V+K]`` with Bt = B for dense
batches and 1 for packed sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cp_kda.checks import state_dtype
from cp_kda.chunk import chunk_bwd, chunk_fwd
from cp_kda.partition import RankPlan


def transfer_map(q, k, v, g, beta, scale, chunk_size):
    """``[B | M]`` ``[b,H,K,V+K]`` of a span (one sequence per batch row) started from a zero state."""
    b, T, H, K = q.shape
    V = v.shape[-1]
    cdt = state_dtype(q.dtype)
    v_aug = torch.cat([v.to(cdt), v.new_zeros(b, T, H, K, dtype=cdt)], dim=-1)
    h0 = q.new_zeros(b, H, K, V + K, dtype=cdt)
    h0[..., V:] = torch.eye(K, dtype=cdt, device=q.device)
    _, ht = chunk_fwd(q, k, v_aug, g, beta, scale, h0, None, chunk_size)
    return ht


def fold(pairs, V: int):
    """Incoming state after the spans ``pairs`` (``[B | M]`` each, in token order), starting from zero."""
    S = torch.zeros_like(pairs[0][..., :V])
    for p in pairs:
        S = p[..., V:] @ S + p[..., :V]
    return S


def reverse_fold(messages, V: int):
    """Gradient of the state entering the first of ``messages`` (``[D | Mᵀ]`` each, in token order)."""
    dS = torch.zeros_like(messages[0][..., :V])
    for m in reversed(messages):
        dS = m[..., :V] + m[..., V:] @ dS
    return dS


def place_first(plan: RankPlan, S_in, n_local: int):
    """Initial states of the local sequences ``[n_local,H,K,V]``: S_in for the first, zeros after it."""
    if plan.dense or n_local == 1:
        return S_in
    return torch.cat([S_in, S_in.new_zeros(n_local - 1, *S_in.shape[1:])], dim=0)


def place_last(plan: RankPlan, dS_end, n_local: int):
    """Final-state gradients ``[n_local,H,K,V]`` that are zero except dS_end on the last local sequence."""
    if plan.dense or n_local == 1:
        return dS_end
    return torch.cat([dS_end.new_zeros(n_local - 1, *dS_end.shape[1:]), dS_end], dim=0)


def n_local(plan: RankPlan, batch: int) -> int:
    return batch if plan.dense else len(plan.local_bounds) - 1


def rank_forward(plan: RankPlan, q, k, v, g, beta, scale, chunk_size, S_in):
    """Local pass from S_in. Returns ``(o [B,T_l,H,V] compute dtype, finals [n_local,H,K,V])``."""
    h0 = place_first(plan, S_in, n_local(plan, q.shape[0]))
    bounds = None if plan.dense else list(plan.local_bounds)
    return chunk_fwd(q, k, v, g, beta, scale, h0, bounds, chunk_size)


@dataclass
class LocalPass:
    """One rank's scan-strategy pass from a zero incoming state, with what the correction needs.

    o0 ``[B,T_l,H,V]`` and finals0 ``[n_local,H,K,V]``: outputs and final states from zero; q_tilde
    ``[Bt,first_end,H,K]`` and M_first ``[Bt,H,K,K]``: how the first local sequence's outputs and end state
    depend on S_in; transfer ``[Bt,H,K,V+K]``: ``[B | M]`` of the last local sequence (zeros if it ends here).
    """

    o0: torch.Tensor
    finals0: torch.Tensor
    q_tilde: torch.Tensor
    M_first: torch.Tensor
    transfer: torch.Tensor


def rank_local_pass(plan: RankPlan, q, k, v, g, beta, scale, chunk_size) -> LocalPass:
    """One chunked pass on the augmented state: values ``[v | 0]``, every local sequence from ``[0 | I]``.

    The value columns give the zero-state outputs and finals; the extra K columns give q̃ (outputs) and M (end
    states) at once, so the transfer, the output correction and the backward's D need no further pass.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    cdt = state_dtype(q.dtype)
    n = n_local(plan, B)
    v_aug = torch.cat([v.to(cdt), v.new_zeros(B, T, H, K, dtype=cdt)], dim=-1)
    h0 = q.new_zeros(n, H, K, V + K, dtype=cdt)
    h0[..., V:] = torch.eye(K, dtype=cdt, device=q.device)
    bounds = None if plan.dense else list(plan.local_bounds)
    o_aug, fin = chunk_fwd(q, k, v_aug, g, beta, scale, h0, bounds, chunk_size)
    rows = B if plan.dense else 1
    last = fin if plan.dense else fin[-1:]
    transfer = last if plan.last_to is not None else torch.zeros_like(last)
    return LocalPass(o_aug[..., :V], fin[..., :V], o_aug[:, : plan.first_end, :, V:], fin[:rows, :, :, V:], transfer)


def rank_combine(plan: RankPlan, lp: LocalPass, S_in):
    """Exact outputs and finals given the incoming state: ``o = o0 + q̃ S_in`` on the first sequence's tokens,
    its final state ``B + M S_in``. Returns ``(o [B,T_l,H,V], finals [n_local,H,K,V])``."""
    if plan.first_from is None:
        return lp.o0, lp.finals0
    o, finals = lp.o0.clone(), lp.finals0.clone()
    o[:, : plan.first_end] += torch.einsum("bthk,bhkv->bthv", lp.q_tilde, S_in)
    finals[: S_in.shape[0]] += lp.M_first @ S_in
    return o, finals


def first_ends_here(plan: RankPlan) -> bool:
    """Does the first local sequence end on this rank (so a final-state gradient may reach it)?"""
    if plan.dense:
        return plan.last_to is None
    return len(plan.local_bounds) > 2 or plan.last_to is None


def rank_message(plan: RankPlan, lp: LocalPass, do, dfinal):
    """Backward message ``[D | Mᵀ]`` ``[Bt,H,K,V+K]``: D = gradient reaching S_in from this rank's own
    outputs (and from the first sequence's final state when it ends here), M of this rank's transfer.
    Uses only ``q_tilde``, ``M_first`` and ``transfer`` of ``lp`` (what the autograd Function saves)."""
    V = lp.transfer.shape[-1] - lp.transfer.shape[-2]  # transfer is [Bt,H,K,V+K]
    Mt = lp.transfer[..., V:].transpose(-1, -2)
    if plan.first_from is None:
        return torch.cat([torch.zeros_like(lp.transfer[..., :V]), Mt], dim=-1)
    D = torch.einsum("bthk,bthv->bhkv", lp.q_tilde, do[:, : plan.first_end].to(lp.q_tilde.dtype))
    if first_ends_here(plan) and dfinal is not None:
        D = D + lp.M_first.transpose(-1, -2) @ dfinal[: D.shape[0]].to(D.dtype)
    return torch.cat([D, Mt], dim=-1)


def rank_backward(plan: RankPlan, q, k, v, g, beta, scale, chunk_size, S_in, do, dfinal, dS_end):
    """Local backward from the true S_in. ``dfinal`` ``[n_local,H,K,V]`` (or None) are gradients of final
    states of sequences ending here; ``dS_end`` that of the state passed to the next rank.

    Returns ``(dq, dk, dv, dg, dbeta, dS_in)``.
    """
    n = n_local(plan, q.shape[0])
    h0 = place_first(plan, S_in, n)
    dht = place_last(plan, dS_end, n)
    if dfinal is not None:
        dht = dht + dfinal.to(dht.dtype)
    bounds = None if plan.dense else list(plan.local_bounds)
    dq, dk, dv, dg, dbeta, dh0 = chunk_bwd(q, k, v, g, beta, scale, h0, bounds, chunk_size, do, dht)
    return dq, dk, dv, dg, dbeta, dh0[: S_in.shape[0]]


def finals_to_global(plan: RankPlan, finals, n_seq: int):
    """Scatter the final states of sequences ending on this rank into ``[N,H,K,V]`` (zeros elsewhere)."""
    out = finals.new_zeros(n_seq, *finals.shape[1:])
    if plan.dense:
        return finals if plan.last_to is None else out
    for i, sid in enumerate(plan.seq_ids):
        if i < len(plan.seq_ids) - 1 or plan.last_to is None:
            out[sid] = finals[i]
    return out


def dfinal_to_local(plan: RankPlan, dfinal):
    """Rows of the global final-state gradient ``[N,H,K,V]`` for sequences ending here ``[n_local,H,K,V]``."""
    if dfinal is None:
        return None
    if plan.dense:
        return dfinal if plan.last_to is None else torch.zeros_like(dfinal)
    local = dfinal[list(plan.seq_ids)].clone()
    if plan.last_to is not None:
        local[-1] = 0
    return local
