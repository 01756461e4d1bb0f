"""DeepEP V1 normal-mode surface over a ``collectives.Communicator``, so code written for DeepEP runs unchanged.

    from moonep.compat import deepep as deep_ep             # instead of: import deep_ep
    buffer = deep_ep.Buffer(group)                           # a ProcessGroup or a Communicator
    n_rank, n_rdma, n_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, per_expert, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)    # x may be (fp8 rows [T, H], scales [T, S])
    y = experts(recv_x, recv_idx, recv_w)                    # the caller applies the routing weights
    out, combined_w, event = buffer.combine(y, handle, topk_weights=recv_w)   # unweighted sum over visited ranks
    grad_x, *_ = buffer.dispatch(grad, handle=handle)        # cached: the handle's layout, no top-k

Semantics follow DeepEP's intranode normal mode: experts live on their home rank (rank ``e // (E/R)``), a token
travels once to every rank holding one of its experts, rows arrive grouped by source rank in rank order (each
source's rows in token order), ``recv_topk_idx`` holds local expert ids with ``-1`` for experts elsewhere and
``recv_topk_weights`` is zero in those slots (so combining the weights returns each weight once), the per-expert
counts come from the senders' ``num_tokens_per_expert`` (aligned up to ``expert_alignment``), a fresh dispatch
without ``topk_idx`` moves rows only, FP8 input ``(x, scales)`` moves the scales with their rows, and ``combine``
returns the unweighted sum (reduced in fp32) of the rows sent back plus 0, 1 or 2 biases. Everything is
allocated on the inputs' device. This is the *unbalanced* classic path: ``moonep.Buffer`` is MoonEP's exact
balance. ``handle`` is a 6-tuple, opaque to callers as in DeepEP, with ``handle[0]`` DeepEP's
``rank_prefix_matrix [R, R]`` (then send counts, receive counts, ``recv_src_idx``, ``is_token_in_rank``, send
order). Tuning knobs (``Config``, SM counts, buffer byte sizes) are accepted and have nothing to tune here; the
low-latency mode is not provided. DeepEP V2's ``ElasticBuffer`` is in ``moonep.compat.deepep_v2`` (also
reachable as ``deepep.ElasticBuffer``, as in ``deep_ep`` 2.x). The V1 code is ``moonep.compat._deepep_v1``.
"""

from __future__ import annotations

from moonep.compat._deepep_v1 import Buffer, Config, EventHandle, EventOverlap, topk_idx_t
from moonep.compat.deepep_v2 import ElasticBuffer, EPHandle

__all__ = ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap", "topk_idx_t"]
