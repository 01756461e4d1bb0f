"""Context parallelism in one process: the ranks are a Python loop, the all-gather a list (no communicator).

It runs exactly the per-rank steps of ``transfer.py`` that ``cp.py`` runs over a communicator, so it checks the
fold, the messages and the sequence bookkeeping to machine precision without spawning processes (the issue's
design asks for such a simulator as the first oracle of the distributed path).
"""

from __future__ import annotations

import torch

from cp_kda.checks import check_kda_inputs, resolve_scale
from cp_kda.partition import plan_ranks
from cp_kda.transfer import (
    dfinal_to_local,
    finals_to_global,
    fold,
    rank_backward,
    rank_combine,
    rank_local_pass,
    rank_message,
    reverse_fold,
)


def simulate_context_parallel(
    q, k, v, g, beta, world_size, cu_seqlens=None, scale=None, chunk_size=64, do=None, dfinal=None
):
    """Split ``[B,T,...]`` inputs into ``world_size`` contiguous slices and run the scan strategy.

    Args:
        q, k, v, g, beta: whole-sequence inputs (T divisible by ``world_size``).
        do: ``[B,T,H,V]`` output gradient; when given, the backward runs too.
        dfinal: ``[N,H,K,V]`` gradient of the final states (optional, with ``do``).

    Returns:
        ``(o [B,T,H,V], final_state [N,H,K,V], grads)`` where grads is None or
        ``(dq, dk, dv, dg, dbeta)`` in the input layout.
    """
    bounds = check_kda_inputs(q, k, v, g, beta, None, cu_seqlens)
    B, T, H, K = q.shape
    if T % world_size:
        raise ValueError(f"q: T={T} is not divisible by world_size={world_size}")
    scale = resolve_scale(scale, K)
    V = v.shape[-1]
    n_seq = B if bounds is None else len(bounds) - 1
    plans = plan_ranks(world_size, T // world_size, bounds)
    shards = [[x[:, p.start : p.start + p.length] for x in (q, k, v, g, beta)] for p in plans]
    passes = [rank_local_pass(p, *s, scale, chunk_size) for p, s in zip(plans, shards)]
    transfers = [lp.transfer for lp in passes]  # the "all-gather"
    outs, states_in, final = [], [], None
    for p, lp in zip(plans, passes):
        S_in = (
            fold(transfers[p.first_from : p.rank], V)
            if p.first_from is not None
            else torch.zeros_like(lp.transfer[..., :V])
        )
        o, finals = rank_combine(p, lp, S_in)
        states_in.append(S_in)
        outs.append(o)
        part = finals_to_global(p, finals, n_seq)
        final = part if final is None else final + part
    o = torch.cat(outs, dim=1)
    if do is None:
        return o, final, None
    messages = [
        rank_message(p, lp, do[:, p.start : p.start + p.length], dfinal_to_local(p, dfinal))
        for p, lp in zip(plans, passes)
    ]  # the backward all-gather
    grads = []
    for p, s, S_in in zip(plans, shards, states_in):
        dS_end = (
            reverse_fold(messages[p.rank + 1 : p.last_to + 1], V) if p.last_to is not None else torch.zeros_like(S_in)
        )
        grads.append(
            rank_backward(
                p, *s, scale, chunk_size, S_in, do[:, p.start : p.start + p.length], dfinal_to_local(p, dfinal), dS_end
            )[:5]
        )
    return o, final, tuple(torch.cat(parts, dim=1) for parts in zip(*grads))
