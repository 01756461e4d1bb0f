"""``Buffer``: MoonEP dispatch / combine / prefetch_weight / reduce_grad over a ``collectives.Communicator``.

Axes: ``s`` tokens on this rank (``s <= S``), ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks,
``epn = E / R`` experts owned per rank (rank r owns ``[r*epn, (r+1)*epn)``) = replica slots per rank,
``nvs`` receive rows = ``align_up(ceil(total_tokens*K/R) + (tp-1)*2*epn, tp)``.

Data path of a fresh dispatch (three collectives, none of them a separate count exchange):
1. all-gather ``[E + 3]`` int64 per rank: this rank's ``tokens_per_expert`` plus an error code, ``s`` and
   ``total_num_tokens`` — bad input on any rank fails on every rank here, before any row moves;
2. the same ``planner.plan`` on every rank; all-to-all of the per-slot side table (row, unique index, weight)
   with the plan's exact ``send_counts`` (``validate=False``: the splits come from the shared plan);
3. all-to-all of one row per (token, destination rank), expanded locally into the expert-grouped rows.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

import planner

from . import _checks
from .layout import CommPlan, empty_rows, nvs_rows, recv_layout, send_layout

_BACKENDS = ("auto", "collectives", "nvshmem")


class Buffer:
    """Capacity-sized receive and wire buffers for one EP group, allocated once.

    comm: a ``collectives.Communicator`` over the EP ranks (R = comm.world_size, E % R == 0).
    S, H, K, E: token capacity per rank, hidden size, top-k, experts. token_padding: each non-empty expert
    segment is padded to a multiple of this (the grouped-GEMM tile). dtype: the hidden rows' dtype.
    backend: "auto"/"collectives" = the communicator's all_to_all_single (gloo, NCCL or MPI, whatever comm is);
    "nvshmem" needs a GPU communicator built with the nvshmem backend (not available on CPU).
    check_combine: check the arguments of plan-reuse calls (combine, dispatch with ``plan=``) so that bad input
    raises on every rank; costs one small all-reduce per call (dispatch's checks ride on its count all-gather).
    """

    def __init__(self, comm, S: int, H: int, K: int, E: int, *, token_padding: int = 1,
                 dtype: torch.dtype = torch.float32, backend: str = "auto", device: Any = None,
                 check_combine: bool = True) -> None:
        for name, v in (("S", S), ("H", H), ("K", K), ("E", E), ("token_padding", token_padding)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        R = comm.world_size
        if E % R:
            raise ValueError(f"E={E} must be a multiple of the EP group size R={R}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if backend == "nvshmem" and getattr(comm, "backend", None) != "nvshmem":
            raise ValueError("backend='nvshmem' needs a communicator from collectives' nvshmem backend (GPU)")
        self.comm, self.S, self.H, self.K, self.E, self.R = comm, S, H, K, E, R
        self.rank, self.epn, self.tp, self.dtype = comm.rank, E // R, token_padding, dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.check_combine = check_combine
        self.max_rows = nvs_rows(R * S, K, R, self.epn, token_padding)
        # receive rows (expert-grouped) and the two wire buffers: sizes never depend on the routing
        self._recv = torch.zeros(self.max_rows, H, dtype=dtype, device=self.device)
        self._recv_w = torch.zeros(self.max_rows, dtype=torch.float32, device=self.device)
        self._wire_out = torch.empty(S * min(K, R), H, dtype=dtype, device=self.device)
        self._wire_in = torch.empty(S * K, H, dtype=dtype, device=self.device)
        self._meta_out = torch.empty(S * K, 3, dtype=torch.float64, device=self.device)
        self._meta_in = torch.empty(S * K, 3, dtype=torch.float64, device=self.device)

    @property
    def nbytes(self) -> int:
        """Bytes held by this Buffer (static)."""
        ts = (self._recv, self._recv_w, self._wire_out, self._wire_in, self._meta_out, self._meta_in)
        return sum(t.numel() * t.element_size() for t in ts)

    # ------------------------------------------------------------------------------------------ dispatch
    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, tokens_per_expert: torch.Tensor | None = None, *,
                 total_num_tokens: int | None = None, plan: CommPlan | None = None, zero_copy: bool = False):
        """Send every routed (token, expert) slot to the rank and row the balanced plan gives it.

        hidden [s, H] (dtype of the Buffer), topk_weights [s, K] float (optional), topk_idx [s, K] int expert
        ids (-1 = no expert), tokens_per_expert [E] (optional, checked against topk_idx).
        total_num_tokens: sum of s over ranks when ranks pass different s (same value on every rank).
        plan: a CommPlan from an earlier dispatch: re-send ``hidden`` (and weights if given) along it,
        without planning (the combine-backward path); topk_idx/tokens_per_expert are then ignored.
        Returns (recv_hidden [nvs, H], recv_weights [nvs] fp32 | None, cu_seqlens [2*epn] int64, plan).
        Rows are grouped by (local expert, then replica slot) and padded per segment; padding and tail rows
        are zero. zero_copy=True returns views of the Buffer (overwritten by the next dispatch).
        """
        if plan is not None:
            return self._redispatch(plan, hidden, topk_weights, zero_copy)
        code, detail, s = _checks.dispatch_problem(self, hidden, topk_weights, topk_idx, tokens_per_expert,
                                                   total_num_tokens, reuse=False)
        counts = torch.zeros(self.E + 3, dtype=torch.int64, device=self.device)
        if code == 0:
            idx = topk_idx.reshape(-1).long()
            counts[:self.E] = torch.bincount(idx[idx >= 0], minlength=self.E)
        counts[self.E:] = torch.tensor([code, s, -1 if total_num_tokens is None else total_num_tokens])
        gathered = torch.empty(self.R * (self.E + 3), dtype=torch.int64, device=self.device)
        self.comm.all_gather(gathered, counts, validate=False)
        g = gathered.view(self.R, self.E + 3).cpu().numpy()
        _checks.raise_agreed("dispatch", self.rank, g[:, self.E].tolist(), detail)
        total = _checks.check_totals(self.rank, g[:, self.E + 1].tolist(), g[:, self.E + 2].tolist())
        global_plan = planner.plan(g[:, :self.E], token_padding=self.tp)
        idx_np = topk_idx.detach().cpu().numpy().astype(np.int64)
        cp = self._exchange_meta(global_plan, idx_np, topk_weights, s, total)
        return self._send_rows(cp, hidden, topk_weights is not None, zero_copy) + (cp.cu_seqlens, cp)

    def _exchange_meta(self, gp: planner.Plan, idx: np.ndarray, weights, s: int, total: int) -> CommPlan:
        """Side-table all-to-all (exact plan counts) -> the receive maps; fills the receive weights."""
        lay = send_layout(gp, self.rank, idx)
        n = lay.slot_pos.size
        meta = self._meta_out[:n]
        meta[:, 0] = torch.from_numpy(lay.dest_row)
        meta[:, 1] = torch.from_numpy(lay.uniq_local)
        pos = torch.from_numpy(lay.slot_pos).to(self.device)
        meta[:, 2] = 0.0 if weights is None else weights.detach().reshape(-1)[pos].double()
        rsplits = gp.send_counts[:, self.rank]
        got = self._meta_in[:int(rsplits.sum())]
        self.comm.all_to_all_single(got, meta, rsplits.tolist(), lay.slot_splits.tolist(), validate=False)
        got_np = got[:, :2].cpu().numpy().astype(np.int64)
        row, uniq, uniq_splits = recv_layout(got_np, rsplits)
        nvs = nvs_rows(total, self.K, self.R, self.epn, self.tp)
        dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        cp = CommPlan(plan=gp, rank=self.rank, buffer_id=id(self), num_tokens=s, total_num_tokens=total,
                      nvs=nvs, cu_seqlens=dev(gp.cu_seqlens[self.rank].astype(np.int64)), slot_pos=pos,
                      send_slot_splits=lay.slot_splits.tolist(), uniq_token=dev(lay.uniq_token),
                      send_uniq_splits=lay.uniq_splits.tolist(), recv_slot_row=dev(row),
                      recv_slot_uniq=dev(uniq), recv_slot_splits=rsplits.tolist(),
                      recv_uniq_splits=uniq_splits.tolist(), empty_rows=dev(empty_rows(row, nvs)))
        self._weights_from(cp, got[:, 2] if weights is not None else None)
        return cp

    def _weights_from(self, cp: CommPlan, per_slot: torch.Tensor | None) -> None:
        """Scatter received per-slot weights [n_recv] into the [nvs] weight rows (empty rows zero)."""
        if per_slot is None:
            return
        w = self._recv_w[:cp.nvs]
        w.index_fill_(0, cp.empty_rows, 0.0)
        w.index_copy_(0, cp.recv_slot_row, per_slot.to(torch.float32))

    def _send_rows(self, cp: CommPlan, hidden: torch.Tensor, with_weights: bool, zero_copy: bool):
        """One row per (token, destination) over the wire, expanded into the expert-grouped receive rows."""
        U = cp.uniq_token.numel()
        src = self._wire_out[:U]
        torch.index_select(hidden, 0, cp.uniq_token, out=src)
        got = self._wire_in[:sum(cp.recv_uniq_splits)]
        self.comm.all_to_all_single(got, src, cp.recv_uniq_splits, cp.send_uniq_splits, validate=False)
        out = self._recv[:cp.nvs]
        out.index_fill_(0, cp.empty_rows, 0)
        out.index_copy_(0, cp.recv_slot_row, got.index_select(0, cp.recv_slot_uniq))
        weights = self._recv_w[:cp.nvs] if with_weights else None
        if zero_copy:
            return out, weights
        return out.clone(), None if weights is None else weights.clone()

    def _redispatch(self, cp: CommPlan, hidden, topk_weights, zero_copy: bool):
        """Dispatch along a saved plan (no planning, no side table; weights travel per slot if given)."""
        if self.check_combine:  # plan-reuse calls carry no count exchange: checking costs one all-reduce
            code, detail, _ = _checks.dispatch_problem(self, hidden, topk_weights, None, None, None, reuse=True)
            if code == 0 and (cp.buffer_id != id(self) or hidden.shape[0] != cp.num_tokens):
                code, detail = 11, f"plan was made for s={cp.num_tokens} tokens by another Buffer/rank"
            self._agree("dispatch", code, detail)
        if topk_weights is not None:
            per_slot = self._slots_forward(cp, topk_weights.detach().reshape(-1)[cp.slot_pos].float())
            self._weights_from(cp, per_slot)
        return self._send_rows(cp, hidden, topk_weights is not None, zero_copy) + (cp.cu_seqlens, cp)

    def _slots_forward(self, cp: CommPlan, per_slot: torch.Tensor) -> torch.Tensor:
        """[n] values in send order -> [n_recv] in receive order (exact plan counts)."""
        got = torch.empty(sum(cp.recv_slot_splits), dtype=per_slot.dtype, device=self.device)
        self.comm.all_to_all_single(got, per_slot.contiguous(), cp.recv_slot_splits, cp.send_slot_splits,
                                    validate=False)
        return got

    def _agree(self, op: str, code: int, detail: str) -> None:
        """One small all-reduce of the error code so that every rank raises together (or none does)."""
        flags = torch.zeros(self.R, dtype=torch.int64, device=self.device)
        flags[self.rank] = code
        self.comm.all_reduce(flags, "sum", validate=False)
        _checks.raise_agreed(op, self.rank, flags.tolist(), detail)

    # ------------------------------------------------------------------------------------------- combine
    def combine(self, plan: CommPlan, expert_out: torch.Tensor, recv_weights: torch.Tensor | None = None):
        """Bring every slot's expert output home and sum a token's K copies (UNWEIGHTED).

        expert_out [nvs, H]: rows in the dispatch layout (the expert side already applied routing weights).
        recv_weights [nvs] (optional): also gathered per slot -> gathered_weights [s, K] (masked slots 0).
        Returns (out [s, H], gathered_weights [s, K] fp32 | None). Rows outside routed slots are ignored.
        """
        if self.check_combine:
            code, detail = _checks.combine_problem(self, plan, expert_out, recv_weights)
            self._agree("combine", code, detail)
        cp = plan
        # prologue: a token's slots on this rank are summed into its one unique row before it travels home
        U_in = sum(cp.recv_uniq_splits)
        uniq = self._wire_in[:U_in]
        uniq.zero_()
        uniq.index_add_(0, cp.recv_slot_uniq, expert_out.index_select(0, cp.recv_slot_row))
        back = self._wire_out[:cp.uniq_token.numel()]
        self.comm.all_to_all_single(back, uniq, cp.send_uniq_splits, cp.recv_uniq_splits, validate=False)
        out = torch.zeros(cp.num_tokens, self.H, dtype=self.dtype, device=self.device)
        out.index_add_(0, cp.uniq_token, back)
        if recv_weights is None:
            return out, None
        per_slot = recv_weights.detach().index_select(0, cp.recv_slot_row).float().contiguous()
        home = torch.empty(cp.slot_pos.numel(), dtype=torch.float32, device=self.device)
        self.comm.all_to_all_single(home, per_slot, cp.send_slot_splits, cp.recv_slot_splits, validate=False)
        gathered = torch.zeros(cp.num_tokens * self.K, dtype=torch.float32, device=self.device)
        gathered.index_copy_(0, cp.slot_pos, home)
        return out, gathered.view(cp.num_tokens, self.K)

    # ------------------------------------------------------------------------------ weights and grads
    def prefetch_weight(self, plan: CommPlan, local_weights, prefetch_buffers) -> None:
        """Copy the replicated experts' weights into the replica slots of the ranks that compute them.

        local_weights: [epn, ...] tensor (or a sequence of them, one per projection) = this rank's experts.
        prefetch_buffers: [epn, ...] replica slots (same structure); slot b of rank d receives expert
        ``plan.plan.experts_to_copy[d, b]`` (unused slots are left untouched). Collective: every rank calls it.
        """
        locs, bufs = _as_list(local_weights), _as_list(prefetch_buffers)
        gp, r, epn = plan.plan, self.rank, self.epn
        recv = [d for d in range(self.R) if gp.donor[d] == r]  # ranks that compute replicas of my experts
        send_rows = [int(e) - r * epn for d in recv for e in gp.experts_to_copy[d] if e >= 0]
        in_splits = [int((gp.experts_to_copy[d] >= 0).sum()) if gp.donor[d] == r else 0 for d in range(self.R)]
        my_slots = np.nonzero(gp.experts_to_copy[r] >= 0)[0]
        out_splits = [len(my_slots) if gp.donor[r] == j else 0 for j in range(self.R)]
        for loc, buf in zip(locs, bufs):
            inp = loc.detach().reshape(epn, -1)[send_rows].to(buf.dtype)
            got = torch.empty(len(my_slots), inp.shape[1], dtype=buf.dtype, device=buf.device)
            self.comm.all_to_all_single(got, inp, out_splits, in_splits, validate=False)
            if len(my_slots):
                buf.view(buf.shape[0], -1)[torch.from_numpy(my_slots)] = got

    def reduce_grad(self, plan: CommPlan, local_grads, reduce_buffers) -> None:
        """Sum the replica slots' weight-gradients into their home experts' grads; zero the consumed slots.

        local_grads: [epn, ...] (or a sequence); reduce_buffers: [epn, ...] slot grads (same structure).
        Collective: every rank calls it, after every rank wrote its slot grads.
        """
        grads, bufs = _as_list(local_grads), _as_list(reduce_buffers)
        gp, r, epn = plan.plan, self.rank, self.epn
        my_slots = np.nonzero(gp.experts_to_copy[r] >= 0)[0]
        in_splits = [len(my_slots) if gp.donor[r] == j else 0 for j in range(self.R)]
        recv = [d for d in range(self.R) if gp.donor[d] == r]
        rows = [int(e) - r * epn for d in recv for e in gp.experts_to_copy[d] if e >= 0]
        out_splits = [int((gp.experts_to_copy[d] >= 0).sum()) if gp.donor[d] == r else 0 for d in range(self.R)]
        slots = torch.from_numpy(my_slots)
        for grad, buf in zip(grads, bufs):
            flat = buf.view(buf.shape[0], -1)
            inp = flat[slots].contiguous()
            got = torch.empty(len(rows), inp.shape[1], dtype=buf.dtype, device=buf.device)
            self.comm.all_to_all_single(got, inp, out_splits, in_splits, validate=False)
            if rows:
                grad.view(epn, -1).index_add_(0, torch.tensor(rows, device=grad.device), got.to(grad.dtype))
            flat[slots] = 0


def _as_list(x) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


__all__ = ["Buffer", "CommPlan"]
