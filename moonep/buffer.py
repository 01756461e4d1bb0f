"""``Buffer``: MoonEP dispatch / combine / prefetch_weight / reduce_grad over a ``collectives.Communicator``.

This module plans and runs a fresh dispatch (the layout step, its one host read, the side table); the Buffer's
construction, buffers and replica exchanges are ``moonep.buffer_core``, the row movement along a saved plan
(``redispatch``, ``combine``) ``moonep.buffer_rows``.

Axes: ``s`` tokens on this rank (``s <= S``), ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks,
``epn = E / R`` experts owned per rank (rank r owns ``[r*epn, (r+1)*epn)``) = replica slots per rank,
``recv_rows`` receive rows of a step: this rank's padded layout (the plan's ``cu_seqlens[rank][-1]``, from the
step's one host read), or with ``static_rows=True`` MoonEP's NvS = ``align_up(ceil((1 + max_slack) *
total_tokens*K/R) + (pad-1)*2*epn, pad)`` with ``pad = token_padding`` (the same every step).

Everything lives on the Buffer's device (its communicator's, or ``device=``): counts, the plan (the planner's
device kernel on CUDA), the layout (``moonep.layout``), rows and weights. A fresh dispatch reads tensor data
into Python ONCE: the step's split table (the Python split lists that a split-list transport — NCCL, gloo,
MPI — needs for every exchange of the step, forward and backward), read together with the error codes so
that bad input on any rank fails on every rank before any row moves. Its four collectives:
1. all-gather ``[E + 4]`` int64 per rank: ``slots_per_expert`` plus an error code, ``s``,
   ``total_num_tokens`` and the Buffer's dispatch count (``generation``: a plan is valid until the next
   dispatch); the same ``planner.plan`` on every rank, then this rank's send layout;
2. all-gather ``[R + 1]``: the unique (token, destination) rows this rank sends to each rank, and a layout
   check; then the one host read;
3. all-to-all of the per-slot side table (int32: row, unique index, routing weight bits) with the plan's
   exact ``send_counts`` (``validate=False``: the splits come from the shared plan);
4. all-to-all of one row per (token, destination rank), expanded locally into the expert-grouped rows.
"""

from __future__ import annotations

import numpy as np
import torch

import planner
from collectives import Pending
from moonep import _checks
from moonep.buffer_core import INT32_MAX, SAME_BUFFER, resolve_device
from moonep.buffer_rows import BufferRows
from moonep.comm_plan import CommPlan, DispatchLayout, StepRead
from moonep.layout import SendLayout, num_recv_rows, recv_layout, replica_maps, row_sources, send_layout
from moonep.layout_cpu import HAS_NUMBA, send_layout_cpu
from planner.tables import raise_error as raise_plan_error

# Shape suffixes (as torchtitan's models/common/moe.py): T tokens on this rank (s), H hidden, K top-k, E experts,
# R ranks, N receive rows of the step (recv_rows), P routed slots this rank sends, Q routed slots it receives,
# U unique (token, destination) rows it sends, V unique rows it receives; C = E + 4 words of a rank's counts.


class Buffer(BufferRows):
    """Capacity-sized receive and wire buffers for one EP group, allocated once.

    comm: a ``collectives.Communicator`` over the EP ranks (R = comm.world_size, E % R == 0).
    S, H, K, E, token_padding (keyword-only): the group's ``EPGeometry`` — token capacity per rank, hidden size,
    top-k, experts, and the grouped-GEMM tile each non-empty expert segment is padded to.
    dtype: the hidden rows' dtype. device: where the buffers live; default the communicator's device ("cuda" =
    the current CUDA device).
    check_reuse: check the arguments of plan-reuse calls (combine, redispatch) so that bad input raises on every
    rank; costs one small all-reduce and one host read per call (dispatch's checks ride on its one read).
    ``moonep.MoE`` turns it off: it builds those arguments itself.
    slack: σ, every rank computes at most ``ceil((1 + σ) * slots / R)`` rows with replicas only where that needs
    them; cost: a ``planner.CostModel`` choosing σ per step up to its ``max_slack`` by predicted layer time
    (``moonep.measure_cost_model`` measures one on the group). Neither: the exact plan. The receive buffers are
    sized for the largest σ allowed (``max_slack``).
    grow: instead of refusing a call with more than S tokens, every rank grows its buffers to the largest s any
    rank brings (decided after dispatch's count all-gather, which carries every rank's s: alike on all ranks,
    no extra collective). ``buf.S`` and ``buf.geometry`` follow.
    static_rows: receive views of MoonEP's static NvS rows whatever the routing (CUDA graphs, compiled experts
    without dynamic shapes); default: the step's own padded rows (DeepEP's normal mode). With slack the NvS
    bound is (1 + max_slack) x the mean, and every elementwise pass of the step (epilogue, row weights,
    combine, their backward) runs over its empty tail.
    """

    # ------------------------------------------------------------------------------------------ dispatch
    def get_dispatch_layout(
        self,
        hidden: torch.Tensor,
        *,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor | None = None,
        slots_per_expert: torch.Tensor | None = None,
        total_num_tokens: int | None = None,
    ) -> DispatchLayout:
        """Plan a dispatch before any row moves (DeepEP's layout step): checks, the count all-gather, the plan,
        the unique-row all-gather and the step's one host read; bad input on any rank fails on every rank here.

        Args:
            hidden, topk_idx, topk_weights, slots_per_expert, total_num_tokens: as ``dispatch``.

        Returns:
            The ``DispatchLayout`` that ``dispatch(..., layout=)`` moves the rows along; its replica maps let the
            replica weight push start first (``moonep.experts.start_push``).
        """
        code, detail, s = _checks.dispatch_problem(
            self, hidden, topk_weights, topk_idx, slots_per_expert, total_num_tokens, reuse=False
        )
        self.generation += 1  # on every rank, even when this call raises: the ranks raise together
        E, R = self.E, self.R
        idx_TK = _checks.routed_ids(self, topk_idx) if code == 0 else torch.full((0, self.K), -1, device=self.device)
        counts_C = torch.zeros(E + 5, dtype=torch.int64, device=self.device)  # the last entry takes -1 ids
        counts_C.scatter_add_(
            0, torch.where(idx_TK >= 0, idx_TK, E + 4).reshape(-1), torch.ones_like(idx_TK).reshape(-1)
        )
        counts_C = counts_C[: E + 4]
        if code == 0:
            counts_C[E] = _checks.data_code(self, topk_idx, topk_weights, slots_per_expert, counts_C[:E])
        else:
            counts_C[E] = code
        counts_C[E + 1] = s
        counts_C[E + 2] = -1 if total_num_tokens is None or code else total_num_tokens
        counts_C[E + 3] = self.generation
        gathered = torch.empty(R * (E + 4), dtype=torch.int64, device=self.device)
        self.comm.all_gather(gathered, counts_C, validate=False)
        g_RC = gathered.view(R, E + 4)
        global_plan = planner.plan(  # tensor counts: a TensorPlan on their device
            g_RC[:, :E], token_padding=self.token_padding, slack=self.slack, cost=self.cost, defer_errors=True
        )
        compiled = HAS_NUMBA and idx_TK.device.type == "cpu"  # one compiled pass instead of a dozen tensor ops
        lay: SendLayout = (send_layout_cpu if compiled else send_layout)(global_plan, self.rank, idx_TK)
        mismatch = torch.ne(lay.slot_splits, global_plan.send_counts[self.rank]).any().long()
        mine = torch.cat((lay.uniq_splits, mismatch[None]))
        uniq = torch.empty(R * (R + 1), dtype=torch.int64, device=self.device)
        self.comm.all_gather(uniq, mine, validate=False)
        uniq_R1 = uniq.view(R, R + 1)  # per rank: unique rows to each rank, then its layout check
        step = self._read_step(g_RC, global_plan, uniq_R1)  # the one host read
        code_detail = detail or (_checks.data_detail(self, topk_idx, topk_weights) if step.codes[self.rank] else "")
        total = self._check_step(step, code_detail)
        return self._layout(global_plan, lay, step, uniq_R1[:, self.rank], s, total)

    def _check_step(self, step: StepRead, code_detail: str) -> int:
        """Raise, on every rank alike, what the step's read says is wrong; returns the agreed total tokens."""
        _checks.raise_agreed("dispatch", self.rank, step.codes, code_detail)
        _checks.check_generations(step.generations)
        total = _checks.check_totals(self.rank, step.s, step.totals)
        if step.err[0]:
            raise_plan_error(np.asarray(step.err), self.epn)
        if self.grow and max(step.s) > self.S:
            self._allocate(max(step.s))
        if any(step.mismatch):
            raise AssertionError(
                f"moonep.dispatch: routed slots per destination differ from the plan's "
                f"send_counts on ranks {[r for r, m in enumerate(step.mismatch) if m]}"
            )
        return total

    def _layout(
        self,
        global_plan: planner.TensorPlan,
        lay: SendLayout,
        step: StepRead,
        recv_uniq_R: torch.Tensor,
        s: int,
        total: int,
    ) -> DispatchLayout:
        r, R = self.rank, self.R
        push_rows, my_slots = replica_maps(global_plan, r)
        push = [step.replicas[d] if step.donor[d] == r else 0 for d in range(R)]
        mine = [step.replicas[r] if step.donor[r] == q else 0 for q in range(R)]
        return DispatchLayout(
            buffer_id=id(self),
            rank=r,
            generation=self.generation,
            global_plan=global_plan,
            send=lay,
            step=step,
            num_tokens=s,
            total_num_tokens=total,
            recv_uniq=recv_uniq_R,
            push_rows=push_rows[: sum(push)],
            push_splits=push,
            my_slots=my_slots[: sum(mine)],
            slot_splits=mine,
            num_replicas=sum(step.replicas),
        )

    def dispatch(
        self,
        hidden: torch.Tensor,
        *,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor | None = None,
        slots_per_expert: torch.Tensor | None = None,
        total_num_tokens: int | None = None,
        layout: DispatchLayout | None = None,
        zero_copy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, CommPlan]:
        """Send every routed (token, expert) slot to the rank and row the balanced plan gives it.

        Collective: every rank of the EP group calls it; bad input on any rank raises the same ValueError on all.
        Keyword arguments in DeepEP's order.

        Args:
            hidden: [T, H] activations in the Buffer's dtype (bf16/fp32/...), on its device; T <= S (or any T
                with ``grow``).
            topk_idx: [T, K] integer expert ids in [0, E), -1 = no expert.
            topk_weights: [T, K] float routing weights (optional; travel per slot, NaN/inf on a routed slot is an
                error).
            slots_per_expert: [E] integer histogram of topk_idx (optional; checked against it).
            total_num_tokens: sum of T over the ranks, the same int on every rank (None: inferred from the count
                all-gather).
            layout: this call's ``get_dispatch_layout`` of the same arguments (None: planned here).
            zero_copy: return views of the Buffer (overwritten by the next dispatch) instead of fresh tensors.

        Returns:
            ``(recv_hidden, recv_weights, cu_seqlens, plan)``:
            recv_hidden: [N, H] rows in the Buffer's dtype, N = ``plan.recv_rows``, grouped by (own expert, then
                replica slot) and padded per segment to ``token_padding``; padding and tail rows are zero.
            recv_weights: [N] fp32 routing weight of each row (0 on padding), or None without topk_weights.
            cu_seqlens: [2*epn] int64 padded segment ends (host copy: ``plan.cu_host``).
            plan: the step's ``CommPlan`` (combine, redispatch and the replica exchanges reuse it).
        """
        if layout is None:
            layout = self.get_dispatch_layout(
                hidden,
                topk_idx=topk_idx,
                topk_weights=topk_weights,
                slots_per_expert=slots_per_expert,
                total_num_tokens=total_num_tokens,
            )
        elif not isinstance(layout, DispatchLayout) or (layout.buffer_id, layout.rank) != (id(self), self.rank):
            raise ValueError(
                f"moonep.dispatch: rank {self.rank}: layout must come from this Buffer's get_dispatch_layout"
            )
        elif layout.generation != self.generation:  # the same on every rank: generations agree at each layout
            raise ValueError(
                f"moonep.dispatch: rank {self.rank}: layout of dispatch #{layout.generation}, but this Buffer "
                f"planned #{self.generation} since"
            )
        plan, rows = self._exchange_meta(layout, hidden, topk_weights)
        rows_NH, w_N = self._expand(plan, rows, topk_weights is not None, zero_copy)
        return rows_NH, w_N, plan.cu_seqlens, plan

    def _read_step(self, g_RC: torch.Tensor, global_plan: planner.TensorPlan, uniq_R1: torch.Tensor) -> StepRead:
        """THE host read of a dispatch: every rank's (code, s, total), the plan's error and send counts, the
        unique-row counts, donors, replica counts and this rank's segment ends, in one transfer."""
        parts = (
            g_RC[:, self.E :].reshape(-1),
            global_plan.err,
            global_plan.send_counts.reshape(-1),
            uniq_R1.reshape(-1),
            global_plan.donor,
            (global_plan.experts_to_copy >= 0).sum(1),
            global_plan.cu_seqlens[self.rank],
        )
        return StepRead.from_flat(torch.cat(parts).tolist(), self.R, self.epn)

    def _exchange_meta(
        self, layout: DispatchLayout, x_TH: torch.Tensor, w_TK: torch.Tensor | None
    ) -> tuple[CommPlan, Pending]:
        """Side-table all-to-all (exact plan counts) -> the receive maps; fills the receive weights. The token
        rows' all-to-all starts beside the side table's (its splits are known from the step's read too).
        Returns (plan, the rows' Pending)."""
        r, R, step, lay, global_plan = self.rank, self.R, layout.step, layout.send, layout.global_plan
        send_slots, recv_slots = list(step.send[r]), [step.send[q][r] for q in range(R)]
        send_uniq, recv_uniq = list(step.uniq[r]), [step.uniq[q][r] for q in range(R)]
        P, U = sum(send_slots), sum(send_uniq)
        meta_P3 = self._meta_out[:P]
        meta_P3[:, 0] = lay.dest_row[:P]
        meta_P3[:, 1] = lay.uniq_local[:P]
        pos_P = lay.slot_pos[:P]
        if w_TK is None:
            meta_P3[:, 2] = 0
        else:  # fp32 bits in an int32 column: integer tables travel as integers, weights exactly
            meta_P3[:, 2] = w_TK.detach().reshape(-1).index_select(0, pos_P).float().view(torch.int32)
        got_Q3 = self._meta_in[: sum(recv_slots)]
        side = self.comm.all_to_all_single_start(got_Q3, meta_P3, recv_slots, send_slots, splits_agreed=True)
        rows = self._start_rows(x_TH, lay.uniq_token[:U], send_uniq, recv_uniq)
        side.wait()
        row_Q, uniq_Q = recv_layout(got_Q3[:, 0], got_Q3[:, 1], global_plan.send_counts[:, r], layout.recv_uniq)
        if self.static_rows:
            N = num_recv_rows(layout.total_num_tokens, self.K, R, self.epn, self.token_padding, self.max_slack)
        else:
            N = step.cu[-1]
        plan = CommPlan(
            global_plan=global_plan,
            rank=r,
            buffer_id=id(self),
            generation=layout.generation,
            num_tokens=layout.num_tokens,
            total_num_tokens=layout.total_num_tokens,
            recv_rows=N,
            cu_seqlens=global_plan.cu_seqlens[r],
            row_source=row_sources(row_Q, uniq_Q, N),
            cu_host=step.cu,
            slot_pos=pos_P,
            send_slot_splits=send_slots,
            uniq_token=lay.uniq_token[:U],
            send_uniq_splits=send_uniq,
            recv_slot_row=row_Q,
            recv_slot_uniq=uniq_Q,
            recv_slot_splits=recv_slots,
            recv_uniq_splits=recv_uniq,
            layout=layout,
        )
        if w_TK is not None:
            self._weights_from(plan, got_Q3[:, 2].contiguous().view(torch.float32))
        return plan, rows


__all__ = ["INT32_MAX", "SAME_BUFFER", "Buffer", "CommPlan", "resolve_device"]
