"""DeepEP V1 normal-mode surface over a ``collectives.Communicator``, so code written for DeepEP runs unchanged.

    from moonep.compat.deepep import Buffer                  # instead of: from deep_ep import Buffer
    buffer = Buffer(comm)                                    # DeepEP takes a ProcessGroup: both are accepted
    n_rank, n_rdma, n_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, per_expert, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)
    y = experts(recv_x, recv_idx, recv_w)                    # the caller applies the routing weights
    out, _, _ = buffer.combine(y, handle)                    # unweighted sum over the ranks the token visited

Semantics follow DeepEP's normal mode: experts live on their home rank (rank ``e // (E/R)``), a token travels once
to every rank holding one of its experts, ``recv_topk_idx`` holds local expert ids (``-1`` for experts elsewhere),
rows arrive grouped by source rank in rank order, each source's rows in token order, and ``combine`` returns the
unweighted sum of the rows sent back (plus optional biases). This is the *unbalanced* classic path: use
``moonep.Buffer`` for MoonEP's exact balance. ``handle`` is opaque to callers, as in DeepEP; its six fields hold
``(rank_prefix_matrix [R,R], send_counts [R], recv_counts [R], recv_src_idx [N], is_token_in_rank [T,R],
send_order [sum send])``. There are no CUDA events on this path: ``EventOverlap`` is a no-op placeholder, and the
low-latency mode is not provided.
"""

from __future__ import annotations

import torch

from ._group import as_communicator


class EventOverlap:
    """DeepEP's event wrapper; operations here complete before they return, so waiting is a no-op."""

    def current_stream_wait(self) -> None:
        return None


class Buffer:
    """DeepEP-compatible expert-parallel buffer (normal mode) over ``group``, a Communicator or ProcessGroup."""

    def __init__(
        self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False, **unused_tuning
    ):
        if low_latency_mode:
            raise ValueError(
                "moonep.compat.deepep.Buffer supports DeepEP's normal mode only (low_latency_mode=True is not provided)"
            )
        self.comm = as_communicator(group)
        self.group = group
        self.group_size = self.comm.world_size
        self.rank = self.comm.rank
        self.num_nvl_bytes, self.num_rdma_bytes, self.low_latency_mode = num_nvl_bytes, num_rdma_bytes, False

    # ------------------------------------------------------------------------------------------ layout
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """topk_idx [T, K] (``-1`` = no expert) -> (num_tokens_per_rank [R] int32, None, num_tokens_per_expert
        [E] int32, is_token_in_rank [T, R] bool, event)."""
        R = self.group_size
        if num_experts % R:
            raise ValueError(f"num_experts={num_experts} must be a multiple of the group size {R}")
        if topk_idx.dim() != 2 or topk_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_idx must be an integer [T, K] tensor, got {topk_idx.dtype} {tuple(topk_idx.shape)}")
        if ((topk_idx < -1) | (topk_idx >= num_experts)).any():
            raise ValueError(f"topk_idx has expert ids outside [-1, {num_experts})")
        idx = topk_idx.long()
        valid = idx >= 0
        rank_of = torch.where(valid, idx // (num_experts // R), torch.full_like(idx, R))
        in_rank = torch.zeros(idx.shape[0], R + 1, dtype=torch.bool, device=idx.device)
        in_rank.scatter_(1, rank_of, True)
        in_rank = in_rank[:, :R].contiguous()
        per_expert = torch.bincount(idx[valid], minlength=num_experts).to(torch.int32)
        return in_rank.sum(0).to(torch.int32), None, per_expert, in_rank, EventOverlap()

    # ------------------------------------------------------------------------------------------ dispatch
    def dispatch(
        self,
        x: torch.Tensor,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config=None,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """x [T, H] -> (recv_x [N, H], recv_topk_idx [N, K], recv_topk_weights [N, K], num_recv_tokens_per_expert
        list, handle, event); with ``handle`` (cached mode) -> (recv_x, None, None, None, None, event)."""
        if handle is not None:
            rank_prefix, send_counts, recv_counts, _, _, order = handle
            return self._exchange(x[order], send_counts, recv_counts), None, None, None, None, EventOverlap()
        if topk_idx is None or is_token_in_rank is None or num_tokens_per_rank is None:
            raise ValueError(
                "a fresh dispatch needs topk_idx, is_token_in_rank and num_tokens_per_rank "
                "(from get_dispatch_layout), or a cached handle"
            )
        R, T = self.group_size, x.shape[0]
        order = is_token_in_rank.t().nonzero()[:, 1]  # destination-major, token order within a destination
        send_counts = num_tokens_per_rank.to(torch.int64)
        if int(send_counts.sum()) != order.numel():
            raise ValueError("num_tokens_per_rank does not match is_token_in_rank")
        matrix = torch.empty(R, R, dtype=torch.int64, device=x.device)
        self.comm.all_gather(matrix, send_counts.view(1, -1))  # matrix[i, j]: rows rank i sends to rank j
        recv_counts = matrix[:, self.rank].clone()
        if num_tokens_per_expert is None:
            raise ValueError("num_tokens_per_expert (from get_dispatch_layout) is needed to localise expert ids")
        epn = int(num_tokens_per_expert.numel()) // R
        recv_x = self._exchange(x[order], send_counts, recv_counts)
        recv_src_idx = self._exchange(
            torch.arange(T, dtype=torch.int64, device=x.device)[order], send_counts, recv_counts
        )
        recv_idx = self._exchange(topk_idx.long()[order], send_counts, recv_counts)
        local = recv_idx - self.rank * epn
        recv_idx = torch.where((recv_idx >= 0) & (local >= 0) & (local < epn), local, torch.full_like(local, -1))
        recv_w = None
        if topk_weights is not None:
            recv_w = self._exchange(topk_weights.float()[order], send_counts, recv_counts)
        counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=epn).tolist()
        per_expert = [-(-c // expert_alignment) * expert_alignment for c in counts]
        rank_prefix = matrix.cumsum(0).to(torch.int32)
        handle = (rank_prefix, send_counts, recv_counts, recv_src_idx, is_token_in_rank, order)
        return recv_x, recv_idx.to(topk_idx.dtype), recv_w, per_expert, handle, EventOverlap()

    # ------------------------------------------------------------------------------------------ combine
    def combine(
        self,
        x: torch.Tensor,
        handle,
        topk_weights=None,
        bias=None,
        config=None,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """x [N, H] (rows as dispatched) -> (combined_x [T, H] unweighted sum over visited ranks (+ bias),
        combined_topk_weights [T, K] or None, event)."""
        _, send_counts, recv_counts, _, in_rank, order = handle
        T = in_rank.shape[0]
        if x.shape[0] != int(recv_counts.sum()):
            raise ValueError(f"combine got {x.shape[0]} rows, the handle dispatched {int(recv_counts.sum())}")
        back = self._exchange(x, recv_counts, send_counts)
        out = torch.zeros(T, *x.shape[1:], dtype=x.dtype, device=x.device).index_add_(0, order, back)
        for b in bias if isinstance(bias, (tuple, list)) else [bias] if bias is not None else []:
            out += b
        weights = None
        if topk_weights is not None:
            w = self._exchange(topk_weights.float(), recv_counts, send_counts)
            weights = torch.zeros(T, w.shape[1], device=w.device).index_add_(0, order, w)
        return out, weights, EventOverlap()

    def _exchange(self, rows: torch.Tensor, send_counts, recv_counts) -> torch.Tensor:
        out = torch.empty(int(recv_counts.sum()), *rows.shape[1:], dtype=rows.dtype, device=rows.device)
        # splits are consistent by construction (exchanged counts): skip the argument header
        self.comm.all_to_all_single(out, rows.contiguous(), recv_counts.tolist(), send_counts.tolist(), validate=False)
        return out

    def destroy(self) -> None:
        """DeepEP frees its NVSHMEM buffers here; nothing to free on this path."""
