"""DeepEP V1 normal mode's ``Buffer`` and ``Config``: the implementation behind ``moonep.compat.deepep`` (whose
docstring is the user's guide). A module of its own so that ``deepep_v2`` builds on ``Buffer`` without importing
the facade that re-exports the V2 names (no import circle).
"""

from __future__ import annotations

from dataclasses import dataclass

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
from moonep.compat._group import as_communicator

topk_idx_t = torch.int64
"""dtype of ``topk_idx`` (as ``deep_ep.topk_idx_t``)."""

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]


@dataclass
class Config:
    """DeepEP's performance config (positional as ``deep_ep.Config``); kept for callers, nothing is chunked here."""

    num_sms: int = 20
    """SMs of the communication kernels (DeepEP requires an even count)."""
    num_max_nvl_chunked_send_tokens: int = 6
    """NVLink send chunk, tokens."""
    num_max_nvl_chunked_recv_tokens: int = 256
    """NVLink receive buffer, tokens."""
    num_max_rdma_chunked_send_tokens: int = 6
    """RDMA send chunk, tokens."""
    num_max_rdma_chunked_recv_tokens: int = 256
    """RDMA receive buffer, tokens."""

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Config.{name} must be a positive int, got {value!r}")
        if self.num_sms % 2:
            raise ValueError(f"Config.num_sms must be even (as in DeepEP), got {self.num_sms}")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer this config needs: 0, the exchange allocates per call."""
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of RDMA buffer this config needs: 0, the exchange allocates per call."""
        return 0


class _Handle(tuple):
    """DeepEP's 6-tuple handle; ``padded_rows`` remembers a ``num_worst_tokens`` dispatch."""

    route: Route
    padded_rows: int


class Buffer:
    """DeepEP-compatible expert-parallel buffer (normal mode) over ``group``, a Communicator or ProcessGroup."""

    num_sms: int = 20
    """Class-wide SM count, as ``deep_ep.Buffer.num_sms``; ``set_num_sms`` changes it."""

    def __init__(
        self,
        group,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: object = None,  # DeepEP's own (mpi4py) communicator argument: accepted, unused (group is the EP group)
    ):
        if low_latency_mode:
            raise ValueError(
                "moonep.compat.deepep.Buffer supports DeepEP's normal mode only (low_latency_mode=True is not provided)"
            )
        self.comm: Communicator = as_communicator(group)
        self.group = group
        self.group_size = self.comm.world_size
        self.rank = self.comm.rank
        self.num_nvl_bytes, self.num_rdma_bytes, self.low_latency_mode = num_nvl_bytes, num_rdma_bytes, False
        self.explicitly_destroy = explicitly_destroy

    # ------------------------------------------------------------------------------------------ class knobs
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the class-wide SM count (even, as DeepEP requires); configs made afterwards carry it."""
        if not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"the SM count must be a positive even int, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The dispatch ``Config`` for ``num_ranks`` ranks (DeepEP's tuned chunk sizes have no role here)."""
        if not isinstance(num_ranks, int) or num_ranks <= 0:
            raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The combine ``Config`` for ``num_ranks`` ranks."""
        return Buffer.get_dispatch_config(num_ranks)

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (CUDA), wrapped as DeepEP's ``EventOverlap``."""
        return EventOverlap(EventHandle())

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: the FP8 ``(x, scales)`` dispatch path exists on every device here (callers ask this for FP8)."""
        return True

    def get_comm_stream(self):
        """The stream the exchanges run on: the current CUDA stream (None on CPU)."""
        return torch.cuda.current_stream() if self.comm.device.type == "cuda" else None

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
        _wait(previous_event)
        per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, self.group_size)
        return per_rank, None, per_expert, in_rank, EventOverlap(EventHandle())

    # ------------------------------------------------------------------------------------------ dispatch
    def dispatch(
        self,
        x,
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
        """x [T, H] or (fp8 [T, H], scales [T, S]) -> (recv_x (same form), recv_topk_idx [N, K] or None,
        recv_topk_weights [N, K] fp32 or None, num_recv_tokens_per_expert_list, handle, event); with ``handle``
        (cached mode, no top-k) -> (recv_x, None, None, None, None, event). ``num_worst_tokens`` pads the outputs
        to that many rows (``-1`` ids, zero weights) and returns an empty count list, as DeepEP."""
        _wait(previous_event)
        rows, scales = split_fp8(x)
        if expert_alignment < 1 or num_worst_tokens < 0:
            raise ValueError(
                f"expert_alignment must be >= 1 and num_worst_tokens >= 0, got {expert_alignment}, {num_worst_tokens}"
            )
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle=...) takes no topk_idx/topk_weights, as in DeepEP")
            route = _route_of(handle)
            recv = [route.forward(self.comm, t) for t in (rows, scales) if t is not None]
            recv = _pad_rows(recv, num_worst_tokens, (0,) * len(recv))
            return _pack(recv), None, None, None, None, EventOverlap(EventHandle())
        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError(
                "a fresh dispatch needs num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert "
                "(from get_dispatch_layout), or a cached handle"
            )
        if topk_weights is not None and topk_idx is None:
            raise ValueError("topk_weights without topk_idx: the weights' slots need their expert ids")
        route, matrix, expert_totals, _ = plan_route(
            self.comm, rows.shape[0], is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert
        )
        recv = [route.forward(self.comm, t) for t in (rows, scales) if t is not None]
        src = route.forward(self.comm, torch.arange(rows.shape[0], dtype=torch.int32, device=rows.device))
        recv_idx = recv_w = None
        if topk_idx is not None:
            recv_idx, recv_w = route.localise(self.comm, topk_idx, topk_weights, expert_totals.numel())
        counts = [-(-int(c) // expert_alignment) * expert_alignment for c in expert_totals.tolist()]
        handle = _Handle(
            (
                matrix.cumsum(0).to(torch.int32),
                route.send_counts,
                route.recv_counts,
                src,
                is_token_in_rank,
                route.send_order,
            )
        )
        handle.route, handle.padded_rows = route, num_worst_tokens
        if num_worst_tokens:
            recv = _pad_rows(recv, num_worst_tokens, (0,) * len(recv))
            recv_idx, recv_w = _pad_rows([recv_idx, recv_w], num_worst_tokens, (-1, 0))
            counts = []
        return _pack(recv), recv_idx, recv_w, counts, handle, EventOverlap(EventHandle())

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
        """x [N, H] (rows as dispatched; a ``num_worst_tokens`` dispatch may pass its padded rows) ->
        (combined_x [T, H] unweighted sum over visited ranks (+ biases), combined_topk_weights [T, K] fp32 or
        None, event)."""
        _wait(previous_event)
        route = _route_of(handle)
        n = route.num_received
        if isinstance(x, (tuple, list)):
            raise ValueError("combine takes unquantised rows (DeepEP's combine has no FP8 input)")
        if x.shape[0] != n and not (handle.padded_rows and x.shape[0] == handle.padded_rows):
            raise ValueError(f"combine got {x.shape[0]} rows, the handle dispatched {n}")
        if topk_weights is not None:
            topk_weights = topk_weights[:n]
        out, weights = combine_rows(self.comm, route, x[:n], topk_weights, check_bias(bias, route.num_tokens, x))
        return out, weights, EventOverlap(EventHandle())

    def destroy(self) -> None:
        """DeepEP frees its NVSHMEM buffers here; there are none on this path."""


def _route_of(handle) -> Route:
    route = getattr(handle, "route", None)
    if route is None:
        raise ValueError("handle must be the one returned by this adapter's dispatch")
    return route


def _wait(previous_event) -> None:
    if previous_event is not None:
        previous_event.current_stream_wait()


def _pack(recv: list):
    return recv[0] if len(recv) == 1 else (recv[0], recv[1])


def _pad_rows(tensors: list, rows: int, fills: tuple) -> list:
    """Pad each tensor (or None) to ``rows`` rows with its fill value; ``rows == 0`` leaves them alone."""
    if not rows:
        return tensors
    out = []
    for t, value in zip(tensors, fills):
        if t is None:
            out.append(None)
            continue
        if t.shape[0] > rows:
            raise ValueError(f"num_worst_tokens={rows} is below the {t.shape[0]} rows received")
        pad = torch.full((rows - t.shape[0], *t.shape[1:]), value, dtype=t.dtype, device=t.device)
        out.append(torch.cat([t, pad]))
    return out
