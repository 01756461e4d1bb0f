"""Context-parallel KDA and short convolution over a ``Communicator`` (the only module here that communicates).

Rank r holds the contiguous global tokens ``[r*T_l, (r+1)*T_l)``; ``cu_seqlens`` are global and identical on
every rank. Strategies for the state entering each rank:

- ``scan``: every rank runs one local pass from a zero state on the augmented state ``[v | 0]``/``[0 | I]``,
  which yields its zero-state outputs, its transfer ``[B | M]`` (fp32) and the output-correction queries q̃;
  one all-gather; each rank folds its predecessors into S_in and corrects ``o = o⁰ + q̃ S_in`` exactly.
  Backward mirrors it: one all-gather of ``[D | Mᵀ]`` messages (D = q̃ᵀ dO), a reverse fold gives the
  gradient of the state this rank passed on, then the local backward from the true S_in. No rank waits for
  another's compute.
- ``ring``: sequential passing (the baseline): receive S_in from r-1, run, send S_end to r+1; backward receives
  dS_end from r+1 and sends dS_in to r-1. W-1 hops, each behind a full local pass.

Parameters are replicated across CP ranks; their gradients (from the gate, conv, projections) need the usual
sum over the CP group, which is the caller's data-parallel reduction, not this module's.
"""

from __future__ import annotations

import torch

from cp_kda.checks import check_cu_seqlens, check_kda_inputs, resolve_scale, state_dtype
from cp_kda.conv import short_conv
from cp_kda.partition import RankPlan, plan_rank
from cp_kda.transfer import (
    LocalPass,
    dfinal_to_local,
    finals_to_global,
    fold,
    rank_backward,
    rank_combine,
    rank_forward,
    rank_local_pass,
    rank_message,
    reverse_fold,
)

STRATEGIES = ("scan", "ring")


def _all_gather_rows(comm, t):
    """``[n, ...]`` on every rank -> list of every rank's tensor, in rank order."""
    t = t.contiguous()
    out = t.new_empty(comm.world_size * t.shape[0], *t.shape[1:])
    comm.all_gather(out, t)
    return list(out.chunk(comm.world_size, dim=0))


def _last_state(plan: RankPlan, finals):
    """The state this rank passes on: its last local sequence's final state ``[Bt,H,K,V]``."""
    return finals if plan.dense else finals[-1:]


class _ContextParallelKDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, comm, plan, strategy, scale, chunk_size, n_seq, want_final, stats):
        V = v.shape[-1]
        lp = None
        if strategy == "scan":
            lp = rank_local_pass(plan, q, k, v, g, beta, scale, chunk_size)
            gathered = _all_gather_rows(comm, lp.transfer) if comm.world_size > 1 else [lp.transfer]
            S_in = (
                fold(gathered[plan.first_from : plan.rank], V)
                if plan.first_from is not None
                else torch.zeros_like(lp.transfer[..., :V])
            )
            o, finals = rank_combine(plan, lp, S_in)
            stats["bytes_per_rank"] = lp.transfer.numel() * lp.transfer.element_size()
        else:
            b = q.shape[0] if plan.dense else 1
            S_in = q.new_zeros(b, q.shape[2], q.shape[3], V, dtype=state_dtype(q.dtype))
            if plan.first_from is not None:
                comm.recv(S_in, plan.rank - 1)
            o, finals = rank_forward(plan, q, k, v, g, beta, scale, chunk_size, S_in)
            if plan.last_to is not None:
                comm.send(_last_state(plan, finals).contiguous(), plan.rank + 1)
            stats["bytes_per_rank"] = S_in.numel() * S_in.element_size()
        final = finals_to_global(plan, finals, n_seq)
        if want_final and comm.world_size > 1:
            comm.all_reduce(final)
        saved = () if lp is None else (lp.q_tilde, lp.M_first, lp.transfer)
        ctx.save_for_backward(q, k, v, g, beta, S_in, *saved)
        ctx.args = (comm, plan, strategy, scale, chunk_size, want_final)
        return o.to(v.dtype), final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, S_in, *saved = ctx.saved_tensors
        comm, plan, strategy, scale, chunk_size, want_final = ctx.args
        V = v.shape[-1]
        if want_final and comm.world_size > 1:
            # the final state is replicated on every rank: its true gradient is the sum of the ranks' gradients
            dfinal = comm.all_reduce(dfinal.contiguous().clone())
        dfinal = dfinal_to_local(plan, dfinal) if want_final else None
        if strategy == "scan":
            q_tilde, M_first, transfer = saved
            msg = rank_message(plan, LocalPass(None, None, q_tilde, M_first, transfer), do, dfinal)
            gathered = _all_gather_rows(comm, msg) if comm.world_size > 1 else [msg]
            dS_end = (
                reverse_fold(gathered[plan.rank + 1 : plan.last_to + 1], V)
                if plan.last_to is not None
                else torch.zeros_like(S_in)
            )
        else:
            dS_end = torch.zeros_like(S_in)
            if plan.last_to is not None:
                comm.recv(dS_end, plan.rank + 1)
        dq, dk, dv, dg, dbeta, dS_in = rank_backward(
            plan, q, k, v, g, beta, scale, chunk_size, S_in, do, dfinal, dS_end
        )
        if strategy == "ring" and plan.first_from is not None:
            comm.send(dS_in.contiguous(), plan.rank - 1)
        return dq, dk, dv, dg, dbeta, *([None] * 8)


def context_parallel_kda(
    q,
    k,
    v,
    g,
    beta,
    comm,
    *,
    strategy="scan",
    cu_seqlens=None,
    scale=None,
    chunk_size=64,
    output_final_state=False,
    validate=False,
    stats=None,
):
    """KDA over a sequence split across the ranks of ``comm`` (contiguous, equal slices in rank order).

    Args:
        q, k, g: local ``[B,T_l,H,K]``; v ``[B,T_l,H,V]``; beta ``[B,T_l,H]`` (rank r holds global tokens
            ``[r*T_l, (r+1)*T_l)``).
        comm: a ``collectives.Communicator`` (any object with rank, world_size, all_gather, all_reduce,
            send, recv).
        strategy: ``"scan"`` (all-gather of transfers and a fold) or ``"ring"`` (sequential state passing).
        cu_seqlens: global ``[N+1]`` boundaries (B must be 1), the same on every rank; sequences may start or end
            anywhere, including on rank boundaries, and span any number of ranks.
        output_final_state: also return the final states ``[N,H,K,V]`` of all sequences, identical on every
            rank (one all-reduce; its gradient is summed over ranks).
        stats: optional dict, filled with ``bytes_per_rank`` (state payload each rank contributes per pass).

    Returns:
        ``(o [B,T_l,H,V] in v.dtype, final_state [N,H,K,V] or None)``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
    check_kda_inputs(q, k, v, g, beta, None, None, validate)
    B, T_l = q.shape[:2]
    bounds = check_cu_seqlens(cu_seqlens, comm.world_size * T_l, B)
    plan = plan_rank(comm.rank, comm.world_size, T_l, bounds)
    n_seq = B if bounds is None else len(bounds) - 1
    stats = {} if stats is None else stats
    o, final = _ContextParallelKDA.apply(
        q,
        k,
        v,
        g,
        beta,
        comm,
        plan,
        strategy,
        resolve_scale(scale, q.shape[-1]),
        chunk_size,
        n_seq,
        bool(output_final_state),
        stats,
    )
    return o, (final if output_final_state else None)


class _Halo(torch.autograd.Function):
    """Previous rank's last ``width`` rows of x (zeros on rank 0); backward returns the halo gradient home."""

    @staticmethod
    def forward(ctx, x, comm, width):
        ctx.comm, ctx.width, ctx.shape = comm, width, x.shape
        if comm.world_size == 1:
            return x.new_zeros(x.shape[0], width, x.shape[2])
        tails = _all_gather_rows(comm, x[:, -width:])
        return tails[comm.rank - 1].clone() if comm.rank > 0 else torch.zeros_like(tails[0])

    @staticmethod
    def backward(ctx, dhalo):
        comm, width = ctx.comm, ctx.width
        dx = dhalo.new_zeros(ctx.shape)
        if comm.world_size > 1:
            grads = _all_gather_rows(comm, dhalo)
            if comm.rank + 1 < comm.world_size:
                dx[:, -width:] = grads[comm.rank + 1]
        return dx, None, None


def context_parallel_short_conv(x, weight, comm, *, bias=None, activation="silu", cu_seqlens=None):
    """Causal depthwise conv on a sequence split across ranks: the W-1 tokens of left context come from the
    previous rank (masked where a sequence starts inside them), and their gradient goes back to it.

    x ``[B,T_l,D]`` (T_l >= W-1), weight ``[D,W]``; ``cu_seqlens`` global as in :func:`context_parallel_kda`.
    Returns y ``[B,T_l,D]``.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError("x: expected a tensor [B,T_l,D]")
    width = weight.shape[-1] - 1
    B, T_l, D = x.shape
    if T_l < width:
        raise ValueError(f"x: each rank needs at least {width} tokens for the conv halo, got {T_l}")
    bounds = check_cu_seqlens(cu_seqlens, comm.world_size * T_l, B)
    plan = plan_rank(comm.rank, comm.world_size, T_l, bounds)
    halo = _Halo.apply(x, comm, width)  # [B, width, D]
    valid = plan.halo(width)  # trailing halo rows in the seq
    keep = (torch.arange(width, device=x.device) >= width - valid).to(x.dtype)
    state = (halo * keep[None, :, None]).transpose(1, 2)  # [B, D, width]
    local_cu = None
    if not plan.dense:
        n_local = len(plan.local_bounds) - 1
        state = torch.cat([state, state.new_zeros(n_local - 1, D, width)], dim=0)
        local_cu = torch.tensor(plan.local_bounds, device=x.device)
    y, _ = short_conv(x, weight, bias, activation, initial_state=state, cu_seqlens=local_cu)
    return y
