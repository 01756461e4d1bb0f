"""DeepEP V2 ``ElasticBuffer`` surface (``deep_ep`` >= 2.0) over a ``collectives.Communicator``.

The calls torchtitan's DeepEP path and Megatron-core's V2 dispatcher make, on one object:

    from moonep.compat.deepep_v2 import ElasticBuffer       # or: from moonep.compat import deepep as deep_ep
    size = ElasticBuffer.get_buffer_size_hint(group, max_tokens, hidden, num_topk=K)
    buf = ElasticBuffer(group, num_bytes=size, num_max_tokens_per_rank=max_tokens, hidden=hidden, num_topk=K)
    recv_x, recv_idx, recv_w, handle, event = buf.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=E,
        num_sms=buf.get_theoretical_num_sms(E, K))       # do_expand=True: one row per (token, local expert)
    out, combined_w, event = buf.combine(y, handle, topk_weights=recv_w)
    grad_x, *_ = buf.dispatch(grad, handle=handle, num_sms=handle.num_sms, do_cpu_sync=False)   # cached

Compact layout (default): one row per (token, destination rank), as V1, grouped by source rank in rank order,
``recv_topk_idx`` local ids (-1 elsewhere), ``recv_topk_weights`` fp32 zeroed where the id is -1. Expanded layout
(``do_expand=True``): one row per (token, local expert), expert-major, each expert's segment padded with zero rows
to ``expert_alignment``; ``recv_topk_idx`` is None and ``recv_topk_weights`` is one weight per row. The expanded
output has exactly the aligned total of rows (DeepEP sizes it statically with an unused tail; there is no static
buffer here). ``EPHandle`` carries DeepEP's public fields: ``num_recv_tokens_per_expert_list`` (aligned),
``psum_num_recv_tokens_per_expert``, ``psum_num_recv_tokens_per_scaleup_rank``, ``topk_idx`` (a copy unless
``do_handle_copy=False``), ``num_sms``, ``num_recv_tokens``, and ``recv_src_metadata [N, 2 + K]``: column 0 the
source's global token index ``src_rank * num_max_tokens_per_rank + t``, column 1 the row's index in the compact
output, columns 2.. the expanded row of each top-k slot (-1 when not on this rank or not expanded). Rows arrive
already sorted by that global index, so ``deterministic`` needs no extra sort. Combine is the unweighted sum
(reduced in fp32) of the rows sent back, plus 0, 1 or 2 biases; expanded input is summed per token first.

Sizing and tuning calls (``get_buffer_size_hint`` returns 0 bytes, ``num_sms``, ``num_qps``, hybrid mode, timeouts)
are accepted and have nothing to size or tune: exchanges allocate per call on the inputs' device. As in DeepEP,
``previous_event`` requires ``allocate_on_comm_stream=True`` and a cached dispatch takes no ``topk_idx``. Engram,
pipeline send/recv and AG/RS sessions of the V2 buffer are not provided.
"""

from __future__ import annotations

import torch

from collectives.base import Communicator
from moonep.compat._deepep_core import (
    EventHandle,
    EventOverlap,
    Route,
    check_bias,
    combine_rows,
    dispatch_layout,
    plan_route,
    split_fp8,
)
from moonep.compat._deepep_v1 import Buffer
from moonep.compat._group import as_communicator

__all__ = ["ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap"]


class EPHandle:
    """A V2 dispatch's layout (public fields as DeepEP's ``EPHandle``; see the module docstring)."""

    def __init__(self, route: Route, recv_topk_idx, counts, *, topk_idx, src_global, alignment, do_expand, meta):
        R_counts = route.recv_counts
        aligned = -(-counts // alignment) * alignment
        self.do_expand = do_expand
        self.num_experts, self.num_max_tokens_per_rank, self.num_sms = meta
        self.expert_alignment = alignment
        self.topk_idx = topk_idx
        self.num_recv_tokens = route.num_received
        self.num_recv_tokens_per_expert_list = aligned.tolist()
        self.psum_num_recv_tokens_per_scaleup_rank = R_counts.cumsum(0).to(torch.int32)
        starts = aligned.cumsum(0) - aligned
        self.psum_num_recv_tokens_per_expert = (starts + counts if do_expand else aligned.cumsum(0)).to(torch.int32)
        self.num_unaligned_recv_tokens_per_expert = counts.to(torch.int32) if do_expand else None
        self.num_expanded_tokens = int(aligned.sum()) if do_expand else 0
        self.dst_buffer_slot_idx = self.token_metadata_at_forward = self.channel_linked_list = None
        self._route, self._recv_topk_idx, self._counts = route, recv_topk_idx, counts
        N, K = recv_topk_idx.shape
        slot = torch.full((N, K), -1, dtype=torch.int64, device=recv_topk_idx.device)
        pairs = (recv_topk_idx >= 0).nonzero()  # (row, k), row-major: each expert's rows come in arrival order
        if do_expand and pairs.numel():
            expert = recv_topk_idx[pairs[:, 0], pairs[:, 1]].long()
            expert, order = torch.sort(expert, stable=True)
            pairs = pairs[order]
            before = counts.cumsum(0) - counts
            slot[pairs[:, 0], pairs[:, 1]] = (
                starts[expert] + torch.arange(len(expert), device=slot.device) - before[expert]
            )
        self._slot_pairs = pairs if do_expand else None  # [P, 2] (row, k) of each expanded row, in row order
        self._slot_rows = slot[pairs[:, 0], pairs[:, 1]] if do_expand else None
        rows = torch.arange(N, dtype=torch.int64, device=slot.device)
        self.recv_src_metadata = torch.cat([src_global.view(-1, 1), rows.view(-1, 1), slot], dim=1)

    def expanded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pairs [P, 2] (row, k), expanded row [P]) of each expanded row; only a ``do_expand`` dispatch has them."""
        if self._slot_pairs is None or self._slot_rows is None:
            raise ValueError("this handle's dispatch ran with do_expand=False: it has no expanded rows")
        return self._slot_pairs, self._slot_rows

    def expand(self, t: torch.Tensor, total: int) -> torch.Tensor:
        """Compact rows [N, ...] -> expanded rows [total, ...] (zero padding rows)."""
        pairs, slots = self.expanded()
        return _scatter_rows(t, pairs[:, 0], slots, total)

    def expand_weights(self, w: torch.Tensor) -> torch.Tensor:
        """Compact weights [N, K] -> one weight per expanded row [total] fp32."""
        pairs, slots = self.expanded()
        out = torch.zeros(self.num_expanded_tokens, dtype=torch.float32, device=w.device)
        out[slots] = w[pairs[:, 0], pairs[:, 1]].float()
        return out


class ElasticBuffer:
    """DeepEP V2's ``ElasticBuffer`` (dispatch / combine) over ``group``, a Communicator or ProcessGroup."""

    def __init__(
        self,
        group,
        num_bytes=None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
    ):
        for name, value in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("hidden", hidden)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        self.comm: Communicator = as_communicator(group)
        self.group = group
        self.rank_idx, self.num_ranks = self.comm.rank, self.comm.world_size
        self.num_bytes = int(num_bytes or 0)
        self.num_max_tokens_per_rank, self.hidden, self.num_topk = num_max_tokens_per_rank, hidden, num_topk
        self.use_fp8_dispatch, self.deterministic = use_fp8_dispatch, deterministic
        self.allow_hybrid_mode, self.allow_multiple_reduction = allow_hybrid_mode, allow_multiple_reduction
        self.prefer_overlap_with_compute, self.explicitly_destroy = prefer_overlap_with_compute, explicitly_destroy
        self.num_allocated_qps = num_allocated_qps
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank_idx

    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0, **unused) -> int:
        """Bytes of staging buffer needed: 0, exchanges allocate per call."""
        return 0

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, *unused, **unused_kw) -> int:
        """An SM count to pass back to ``dispatch(num_sms=...)``: ``deepep.Buffer.num_sms`` (nothing uses it)."""
        return Buffer.num_sms

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        return num_sms

    def get_logical_domain_size(self) -> tuple[int, int]:
        """(scale-out ranks, scale-up ranks): one domain of all ranks."""
        return 1, self.num_ranks

    get_physical_domain_size = get_logical_domain_size

    @staticmethod
    def capture() -> EventHandle:
        return EventHandle()

    def get_comm_stream(self):
        return torch.cuda.current_stream() if self.comm.device.type == "cuda" else None

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        self.comm.barrier()

    def destroy(self) -> None:
        """DeepEP releases its NCCL window here; there is none on this path."""

    # ------------------------------------------------------------------------------------------ dispatch
    def dispatch(
        self,
        x,
        topk_idx=None,
        topk_weights=None,
        cumulative_local_expert_recv_stats=None,
        num_experts=None,
        num_max_tokens_per_rank=None,
        expert_alignment=None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync=None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ):
        """x [T, H] or (fp8 [T, H], scales [T, S]) -> (recv_x (same form), recv_topk_idx [N, K] or None,
        recv_topk_weights (fp32 [N, K], or [rows] expanded) or None, EPHandle, event)."""
        _wait(previous_event, allocate_on_comm_stream)
        rows, scales = split_fp8(x)
        if handle is not None:
            if topk_idx is not None or do_cpu_sync:
                raise ValueError("a cached dispatch (handle=...) takes no topk_idx and no do_cpu_sync, as in DeepEP")
            if do_expand and not handle.do_expand:
                raise ValueError("do_expand=True with a compact handle: dispatch with do_expand=True first")
            for name, given, held in (
                ("num_experts", num_experts, handle.num_experts),
                ("expert_alignment", expert_alignment, handle.expert_alignment),
                ("num_max_tokens_per_rank", num_max_tokens_per_rank, handle.num_max_tokens_per_rank),
            ):
                if given is not None and given != held:
                    raise ValueError(f"{name}={given} differs from the handle's {held}")
            recv_w = None
            if topk_weights is not None:
                epn = handle.num_experts // self.num_ranks
                _, recv_w = handle._route.localise(self.comm, handle.topk_idx, topk_weights, epn)
            recv = [handle._route.forward(self.comm, t) for t in (rows, scales) if t is not None]
            return self._outputs(handle, recv, recv_w, cumulative_local_expert_recv_stats)
        if topk_idx is None or num_experts is None:
            raise ValueError("a fresh dispatch needs topk_idx and num_experts (or a cached handle)")
        alignment = 1 if expert_alignment is None else expert_alignment
        if not isinstance(alignment, int) or alignment < 1:
            raise ValueError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
        handle, recv, recv_w = self._fresh(
            rows,
            scales,
            topk_idx,
            topk_weights,
            num_experts,
            alignment,
            num_max_tokens_per_rank,
            do_expand,
            do_handle_copy,
            num_sms,
        )
        return self._outputs(handle, recv, recv_w, cumulative_local_expert_recv_stats)

    def _fresh(self, rows, scales, topk_idx, topk_weights, num_experts, alignment, cap, do_expand, copy, num_sms):
        T, R = rows.shape[0], self.num_ranks
        per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, R)
        tokens = torch.tensor([T], device=rows.device)
        route, _, _, gathered = plan_route(self.comm, T, in_rank, per_rank, per_expert, extra=tokens)
        assert gathered is not None  # plan_route gathers the extra column it is given
        cap = cap or self.num_max_tokens_per_rank or int(gathered.max())
        if int(gathered.max()) > cap:
            raise ValueError(f"a rank has {int(gathered.max())} tokens, more than num_max_tokens_per_rank={cap}")
        recv = [route.forward(self.comm, t) for t in (rows, scales) if t is not None]
        src = route.forward(self.comm, torch.arange(T, dtype=torch.int64, device=rows.device))
        src_rank = torch.repeat_interleave(torch.arange(R, device=rows.device), route.recv_counts.to(rows.device))
        epn = num_experts // R
        recv_idx, recv_w = route.localise(self.comm, topk_idx, topk_weights, epn)
        counts = torch.bincount(recv_idx[recv_idx >= 0].long(), minlength=epn)
        meta = (num_experts, cap, num_sms or Buffer.num_sms)
        handle = EPHandle(
            route,
            recv_idx,
            counts,
            topk_idx=topk_idx.clone() if copy else topk_idx,
            src_global=src_rank * cap + src,
            alignment=alignment,
            do_expand=do_expand,
            meta=meta,
        )
        return handle, recv, recv_w

    def _outputs(self, handle: EPHandle, recv: list, recv_w, stats):
        """The dispatch's return value in the handle's layout; ``stats`` [E/R] += unaligned rows per expert."""
        if stats is not None:
            stats += handle._counts.to(stats.dtype)
        recv_idx = handle._recv_topk_idx
        if handle.do_expand:
            recv = [handle.expand(t, handle.num_expanded_tokens) for t in recv]
            recv_w = handle.expand_weights(recv_w) if recv_w is not None else None
            recv_idx = None
        recv_x = recv[0] if len(recv) == 1 else (recv[0], recv[1])
        return recv_x, recv_idx, recv_w, handle, EventOverlap(EventHandle())

    # ------------------------------------------------------------------------------------------ combine
    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights=None,
        bias=None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """x [N, H] (compact) or [rows, H] (expanded) -> (combined_x [T, H], combined_topk_weights [T, K] fp32 or
        None, event): the fp32 sum of the rows sent back (expanded rows summed per token first), plus biases."""
        _wait(previous_event, allocate_on_comm_stream)
        if not isinstance(handle, EPHandle):
            raise ValueError("handle must be the EPHandle returned by this ElasticBuffer's dispatch")
        if isinstance(x, (tuple, list)):
            raise ValueError("combine takes unquantised rows (DeepEP's combine has no FP8 input)")
        route, dtype = handle._route, x.dtype
        if handle.do_expand:
            x, topk_weights = _fold_expanded(handle, x, topk_weights)
        biases = check_bias(bias, route.num_tokens, x)
        out, weights = combine_rows(self.comm, route, x, topk_weights, biases, out_dtype=dtype)
        return out, weights, EventOverlap(EventHandle())


def _fold_expanded(handle: EPHandle, x: torch.Tensor, topk_weights):
    """Expanded rows [rows, H] and weights [rows] -> per received token: rows [N, H] fp32 and weights [N, K]."""
    if x.shape[0] < handle.num_expanded_tokens:
        raise ValueError(f"combine got {x.shape[0]} rows, the expanded dispatch made {handle.num_expanded_tokens}")
    pairs, slots = handle.expanded()
    N, K = handle._recv_topk_idx.shape
    rows = torch.zeros(N, *x.shape[1:], dtype=torch.float32, device=x.device)
    rows.index_add_(0, pairs[:, 0], x[slots].float())
    weights = None
    if topk_weights is not None:
        weights = torch.zeros(N, K, dtype=torch.float32, device=x.device)
        weights[pairs[:, 0], pairs[:, 1]] = topk_weights[slots].float()
    return rows, weights


def _scatter_rows(t: torch.Tensor, src_rows, dst_rows, total: int) -> torch.Tensor:
    """out [total, ...] zeros with out[dst_rows] = t[src_rows]; byte views for dtypes without indexing (FP8)."""
    raw = t.is_floating_point() and t.element_size() == 1
    view = t.view(torch.uint8) if raw else t
    out = torch.zeros(total, *view.shape[1:], dtype=view.dtype, device=t.device)
    out[dst_rows] = view[src_rows]
    return out.view(t.dtype) if raw else out


def _wait(previous_event, allocate_on_comm_stream: bool) -> None:
    if previous_event is None:
        return
    if not allocate_on_comm_stream:
        raise ValueError("previous_event requires allocate_on_comm_stream=True (as in DeepEP V2)")
    previous_event.current_stream_wait()
