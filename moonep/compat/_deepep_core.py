"""The exchange under the DeepEP adapters (``deepep`` V1 and ``deepep_v2``): layout, route, rows out and back.

A ``Route`` is one dispatch's layout on one rank: which local tokens go to which rank (destination-major, token
order within a destination) and how many rows come from each source. Rows move with one
``all_to_all_single`` each over the ``Communicator``; FP8 rows (which the Communicator does not name) travel as
their raw bytes. All tensors are made on the inputs' device. Events wrap CUDA events when CUDA is in use and are
no-ops otherwise: every exchange here completes on the current stream before it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from collectives.base import Communicator

_WIRE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.int16)
_WIRE_DTYPES += (torch.int8, torch.uint8, torch.bool)


class EventHandle:
    """A CUDA event recorded on the current stream at creation (DeepEP's ``EventHandle``); None-backed on CPU
    or before CUDA is initialised (then no GPU work can be pending)."""

    def __init__(self):
        self.event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record()

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """DeepEP's event wrapper: ``current_stream_wait()``, ``with event:`` (waits on exit), ``event(release_handle)``."""

    def __init__(self, event: EventHandle | None = None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors
        self._release = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
        if release_handle:
            self.event = None

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        self._release = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait(release_handle=self._release)
        self._release = False


def split_fp8(x):
    """x [T, H], or (rows [T, H], scales [T, S]) as DeepEP's FP8 input -> (rows, scales or None)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2 or not all(isinstance(t, torch.Tensor) for t in x):
            raise ValueError("FP8 input must be a pair (rows [T, H], scales [T, S]) of tensors")
        rows, scales = x
        if scales.dim() != 2 or rows.dim() != 2 or scales.shape[0] != rows.shape[0]:
            raise ValueError(f"FP8 scales {tuple(scales.shape)} must be [T, S] for rows {tuple(rows.shape)}")
        if scales.device != rows.device:
            raise ValueError(f"FP8 scales are on {scales.device}, rows on {rows.device}")
        return rows, scales
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a [T, H] tensor or an FP8 pair, got {getattr(x, 'shape', type(x).__name__)}")
    return x, None


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, R: int):
    """topk_idx [T, K] -> (tokens per rank [R] int32, tokens per expert [E] int32, is_token_in_rank [T, R])."""
    if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % R:
        raise ValueError(f"num_experts={num_experts!r} must be a positive multiple of the group size {R}")
    if (
        not isinstance(topk_idx, torch.Tensor)
        or topk_idx.dim() != 2
        or topk_idx.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"topk_idx must be an integer [T, K] tensor, got {getattr(topk_idx, 'dtype', type(topk_idx).__name__)} "
            f"{tuple(getattr(topk_idx, 'shape', ()))}"
        )
    if ((topk_idx < -1) | (topk_idx >= num_experts)).any():
        raise ValueError(f"topk_idx has expert ids outside [-1, {num_experts})")
    idx = topk_idx.long()
    valid = idx >= 0
    rank_of = torch.where(valid, idx // (num_experts // R), torch.full_like(idx, R))
    in_rank = torch.zeros(idx.shape[0], R + 1, dtype=torch.bool, device=idx.device)
    in_rank.scatter_(1, rank_of, True)
    in_rank = in_rank[:, :R].contiguous()
    per_expert = torch.bincount(idx[valid], minlength=num_experts).to(torch.int32)
    return in_rank.sum(0).to(torch.int32), per_expert, in_rank


@dataclass
class Route:
    """One dispatch's layout on this rank (see the module docstring)."""

    send_order: torch.Tensor
    """[sum send] local token index of each sent row, destination-major, token order within a destination."""
    send_counts: torch.Tensor
    """[R] int64 rows sent to each rank."""
    recv_counts: torch.Tensor
    """[R] int64 rows received from each rank."""
    num_tokens: int
    """T, this rank's tokens."""
    rank: int
    """this rank in the group."""

    @property
    def num_received(self) -> int:
        return int(self.recv_counts.sum())

    def forward(self, comm: Communicator, t: torch.Tensor) -> torch.Tensor:
        """t [T, ...] -> [N, ...]: each token's row to every rank it visits."""
        if t.shape[0] != self.num_tokens:
            raise ValueError(f"expected {self.num_tokens} rows (the handle's tokens), got {t.shape[0]}")
        return exchange(comm, t[self.send_order], self.send_counts, self.recv_counts)

    def backward(self, comm: Communicator, t: torch.Tensor) -> torch.Tensor:
        """t [N, ...] -> [T, ...] fp32: rows back to their sources, summed per token (zero for unsent tokens)."""
        back = exchange(comm, t.contiguous(), self.recv_counts, self.send_counts)
        out = torch.zeros(self.num_tokens, *t.shape[1:], dtype=torch.float32, device=t.device)
        return out.index_add_(0, self.send_order, back.float())

    def localise(self, comm: Communicator, topk_idx, topk_weights, experts_per_rank: int):
        """Received top-k ids as local expert ids (-1 elsewhere) and fp32 weights zeroed where the id is -1."""
        if topk_idx.shape[0] != self.num_tokens:
            raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows, x has {self.num_tokens}")
        ids = self.forward(comm, topk_idx.long()) - self.rank * experts_per_rank
        mine = (ids >= 0) & (ids < experts_per_rank)
        recv_idx = torch.where(mine, ids, torch.full_like(ids, -1)).to(topk_idx.dtype)
        if topk_weights is None:
            return recv_idx, None
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_idx {tuple(topk_idx.shape)}")
        recv_w = self.forward(comm, topk_weights.float())
        return recv_idx, torch.where(mine, recv_w, torch.zeros_like(recv_w))


def plan_route(comm: Communicator, num_tokens: int, in_rank, per_rank, per_expert, extra: torch.Tensor | None = None):
    """Agree on one dispatch's layout: one all-gather of each rank's [send counts R | tokens per expert E | extra |
    ok flag], so a rank whose layout is inconsistent makes every rank raise the same ValueError.

    Returns (Route, matrix [R, R] rows rank i sends to rank j, received tokens per local expert [E/R] int64 (the
    senders' counts), and the gathered extra columns [R, X] when ``extra`` is given).
    """
    R = comm.world_size
    E = per_expert.numel()
    if E % R:
        raise ValueError(f"num_tokens_per_expert has {E} experts, not a multiple of the group size {R}")
    device = per_expert.device
    problem = ""
    if in_rank.dtype != torch.bool or tuple(in_rank.shape) != (num_tokens, R):
        problem = f"is_token_in_rank must be bool [{num_tokens}, {R}], got {in_rank.dtype} {tuple(in_rank.shape)}"
        in_rank = torch.zeros(num_tokens, R, dtype=torch.bool, device=device)
    send_counts = in_rank.sum(0).long()
    if not problem and not torch.equal(send_counts, per_rank.to(send_counts.device).long()):
        problem = "num_tokens_per_rank does not match is_token_in_rank"
    flag = torch.tensor([0 if problem else 1], device=send_counts.device)
    parts = [send_counts, per_expert.to(send_counts.device).long()] + ([extra.long()] if extra is not None else [])
    mine = torch.cat(parts + [flag]).view(1, -1)
    gathered = torch.empty(R, mine.shape[1], dtype=torch.int64, device=mine.device)
    comm.all_gather(gathered, mine)  # validated: a rank with another expert count fails on every rank
    bad = (gathered[:, -1] == 0).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"rank {comm.rank}: {problem}"
            if problem
            else f"dispatch layout does not match on rank(s) {bad}: their "
            "num_tokens_per_rank / is_token_in_rank disagree (each raises with the detail)"
        )
    matrix = gathered[:, :R]
    epn = E // R
    totals = gathered[:, R + comm.rank * epn : R + (comm.rank + 1) * epn].sum(0)
    order = in_rank.t().nonzero()[:, 1]
    route = Route(order, send_counts, matrix[:, comm.rank].clone(), num_tokens, comm.rank)
    return route, matrix, totals, (gathered[:, R + E : -1] if extra is not None else None)


def exchange(comm: Communicator, rows: torch.Tensor, send_counts, recv_counts) -> torch.Tensor:
    """all_to_all_single of ``rows`` by counts; dtypes the Communicator does not carry (FP8) move as bytes."""
    rows = rows.contiguous()
    wire = rows if rows.dtype in _WIRE_DTYPES else rows.view(torch.uint8).reshape(rows.shape[0], -1)
    out = torch.empty(int(recv_counts.sum()), *wire.shape[1:], dtype=wire.dtype, device=wire.device)
    # splits are consistent by construction (exchanged counts): skip the argument header
    comm.all_to_all_single(
        out, wire, recv_counts.tolist(), send_counts.tolist(), validate=False, splits_agreed=True
    )  # the counts came from the peers
    if wire is rows:
        return out
    return out.view(rows.dtype).reshape(out.shape[0], *rows.shape[1:])


def check_bias(bias, num_tokens: int, x: torch.Tensor) -> list:
    """0, 1 or 2 biases [T, H] (a tensor or a pair) -> list."""
    biases = list(bias) if isinstance(bias, (tuple, list)) else [bias] if bias is not None else []
    if len(biases) > 2:
        raise ValueError(f"combine takes at most 2 biases, got {len(biases)}")
    for b in biases:
        if tuple(b.shape) != (num_tokens, *x.shape[1:]):
            raise ValueError(f"bias must be [{num_tokens}, {', '.join(map(str, x.shape[1:]))}], got {tuple(b.shape)}")
    return biases


def combine_rows(comm: Communicator, route: Route, x: torch.Tensor, topk_weights, biases: list, out_dtype=None):
    """x [N, H] -> (out [T, H] in ``out_dtype`` (default x's): the fp32 sum of the rows sent back, plus biases;
    weights [T, K] fp32 or None)."""
    if x.shape[0] != route.num_received:
        raise ValueError(f"combine got {x.shape[0]} rows, the handle dispatched {route.num_received}")
    if topk_weights is not None and topk_weights.shape[0] != route.num_received:
        raise ValueError(f"combine got {topk_weights.shape[0]} weight rows, the handle dispatched {route.num_received}")
    out = route.backward(comm, x)
    for b in biases:
        out += b.float()
    weights = route.backward(comm, topk_weights.float()) if topk_weights is not None else None
    return out.to(out_dtype or x.dtype), weights
