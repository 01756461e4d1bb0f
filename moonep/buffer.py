"""``Buffer``: MoonEP dispatch / combine / prefetch_weight / reduce_grad over a ``collectives.Communicator``.

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

from typing import Any

import torch

import planner
from collectives import Pending
from moonep import _checks, replica_exchange
from moonep._checks import Problem
from moonep.agreement import agree_settings
from moonep.comm_plan import CommPlan, DispatchLayout, StepRead
from moonep.geometry import EPGeometry
from moonep.layout import num_recv_rows, recv_layout, replica_maps, row_sources, send_layout
from moonep.layout_cpu import HAS_NUMBA, send_layout_cpu
from planner.tables import raise_error as raise_plan_error

INT32_MAX = 2**31 - 1
SAME_BUFFER = "every rank of the EP group must pass the same sizes, dtype, token_padding and balancing"


def resolve_device(comm, device: Any) -> torch.device:
    """The Buffer's device: ``device`` ("cuda" = the current CUDA device), else the communicator's, else CPU."""
    if device is None:
        device = getattr(comm, "device", None) or "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class Buffer:
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

    def __init__(
        self,
        comm,
        *,
        S: int,
        H: int,
        K: int,
        E: int,
        token_padding: int = 1,
        dtype: torch.dtype = torch.float32,
        device: Any = None,
        check_reuse: bool = True,
        slack: float | None = None,
        cost: planner.CostModel | None = None,
        grow: bool = False,
        static_rows: bool = False,
    ) -> None:
        # compared across ranks BEFORE any rank raises on its own: a bad value on one rank is the same error on all
        words, problem = _checks.buffer_settings(comm, S, H, K, E, token_padding, dtype, slack, cost, grow)
        agree_settings(comm, "Buffer", words, problem, hint=SAME_BUFFER)
        self.geometry = EPGeometry(S=S, H=H, K=K, E=E, token_padding=token_padding)
        self.comm, self.S, self.H, self.K, self.E, self.R = comm, S, H, K, E, comm.world_size
        self.rank, self.epn, self.token_padding, self.dtype = comm.rank, E // self.R, token_padding, dtype
        self.device = resolve_device(comm, device)
        self.check_reuse = check_reuse
        self.slack, self.cost, self.max_slack = _checks.balance_options(slack, cost)
        self.grow = bool(grow)
        self.static_rows = bool(static_rows)
        self.generation = 0
        """dispatches made so far (agreed across ranks by each dispatch); a plan is valid until the next one."""
        self._allocate(S)

    def _allocate(self, S: int) -> None:
        """(Re)allocate every buffer for capacity S: their sizes never depend on the routing."""
        R, K, H, dtype, dev = self.R, self.K, self.H, self.dtype, self.device
        self.S, self.geometry = S, EPGeometry(S=S, H=H, K=K, E=self.E, token_padding=self.token_padding)
        self.max_recv_rows = num_recv_rows(R * S, K, R, self.epn, self.token_padding, self.max_slack)
        max_slots = planner.row_bound(R * S * K, R, self.max_slack)  # routed slots one rank may receive
        if max(self.max_recv_rows, S * K) > INT32_MAX:
            raise ValueError(f"receive rows {self.max_recv_rows} or slots S*K={S * K} exceed the int32 side table")
        # receive rows (expert-grouped) and the two wire buffers
        self._recv = torch.zeros(self.max_recv_rows, H, dtype=dtype, device=dev)
        self._recv_w = torch.zeros(self.max_recv_rows, dtype=torch.float32, device=dev)
        self._wire_out = torch.empty(S * min(K, R), H, dtype=dtype, device=dev)
        self._wire_in = torch.zeros(1 + max_slots, H, dtype=dtype, device=dev)  # row 0: the zero row (row_sources)
        self._meta_out = torch.empty(S * K, 3, dtype=torch.int32, device=dev)
        self._meta_in = torch.empty(max_slots, 3, dtype=torch.int32, device=dev)

    @property
    def nbytes(self) -> int:
        """Bytes held by this Buffer (static)."""
        ts = (self._recv, self._recv_w, self._wire_out, self._wire_in, self._meta_out, self._meta_in)
        return sum(t.numel() * t.element_size() for t in ts)

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

        Arguments as ``dispatch``. Returns the ``DispatchLayout`` that ``dispatch(..., layout=)`` moves the rows
        along; its replica maps let the replica weight push start first (``moonep.experts.start_push``).
        """
        code, detail, s = _checks.dispatch_problem(
            self, hidden, topk_weights, topk_idx, slots_per_expert, total_num_tokens, reuse=False
        )
        self.generation += 1  # on every rank, even when this call raises: the ranks raise together
        idx = _checks.routed_ids(self, topk_idx) if code == 0 else torch.full((0, self.K), -1, device=self.device)
        counts = torch.zeros(self.E + 5, dtype=torch.int64, device=self.device)  # the last entry takes -1 ids
        counts.scatter_add_(0, torch.where(idx >= 0, idx, self.E + 4).reshape(-1), torch.ones_like(idx).reshape(-1))
        counts = counts[: self.E + 4]
        if code == 0:
            counts[self.E] = _checks.data_code(self, topk_idx, topk_weights, slots_per_expert, counts[: self.E])
        else:
            counts[self.E] = code
        counts[self.E + 1] = s
        counts[self.E + 2] = -1 if total_num_tokens is None or code else total_num_tokens
        counts[self.E + 3] = self.generation
        gathered = torch.empty(self.R * (self.E + 4), dtype=torch.int64, device=self.device)
        self.comm.all_gather(gathered, counts, validate=False)
        g = gathered.view(self.R, self.E + 4)
        global_plan = planner.plan(
            g[:, : self.E], token_padding=self.token_padding, slack=self.slack, cost=self.cost, defer_errors=True
        )
        compiled = HAS_NUMBA and idx.device.type == "cpu"  # one compiled pass instead of a dozen tensor ops
        lay = (send_layout_cpu if compiled else send_layout)(global_plan, self.rank, idx)
        mismatch = (lay.slot_splits != global_plan.send_counts[self.rank]).any().long()
        mine = torch.cat((lay.uniq_splits, mismatch[None]))
        uniq = torch.empty(self.R * (self.R + 1), dtype=torch.int64, device=self.device)
        self.comm.all_gather(uniq, mine, validate=False)
        uniq = uniq.view(self.R, self.R + 1)
        step = self._read_step(g, global_plan, uniq)  # the one host read
        code_detail = detail or (_checks.data_detail(self, topk_idx, topk_weights) if step.codes[self.rank] else "")
        total = self._check_step(step, code_detail)
        return self._layout(global_plan, lay, step, uniq[:, self.rank], s, total)

    def _check_step(self, step: StepRead, code_detail: str) -> int:
        """Raise, on every rank alike, what the step's read says is wrong; returns the agreed total tokens."""
        _checks.raise_agreed("dispatch", self.rank, step.codes, code_detail)
        _checks.check_generations(step.generations)
        total = _checks.check_totals(self.rank, step.s, step.totals)
        if step.err[0]:
            raise_plan_error(step.err, self.epn)
        if self.grow and max(step.s) > self.S:
            self._allocate(max(step.s))
        if any(step.mismatch):
            raise AssertionError(
                f"moonep.dispatch: routed slots per destination differ from the plan's "
                f"send_counts on ranks {[r for r, m in enumerate(step.mismatch) if m]}"
            )
        return total

    def _layout(self, global_plan, lay, step: StepRead, recv_uniq_t, s: int, total: int) -> DispatchLayout:
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
            recv_uniq=recv_uniq_t,
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
    ):
        """Send every routed (token, expert) slot to the rank and row the balanced plan gives it.

        hidden [s, H] (dtype of the Buffer); keyword-only, in DeepEP's order: topk_idx [s, K] int expert ids
        (-1 = no expert), topk_weights [s, K] float (optional), slots_per_expert [E] (optional, checked against
        topk_idx). total_num_tokens: sum of s over ranks when ranks pass different s (same value on every rank).
        layout: this call's ``get_dispatch_layout`` of the same arguments (None: planned here).
        Returns (recv_hidden [recv_rows, H], recv_weights [recv_rows] fp32 | None, cu_seqlens [2*epn] int64,
        plan: the step's CommPlan).
        Rows are grouped by (local expert, then replica slot) and padded per segment; padding and tail rows
        are zero. zero_copy=True returns views of the Buffer (overwritten by the next dispatch).
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
        return self._expand(plan, rows, topk_weights is not None, zero_copy) + (plan.cu_seqlens, plan)

    def _read_step(self, g: torch.Tensor, global_plan, uniq: torch.Tensor) -> StepRead:
        """THE host read of a dispatch: every rank's (code, s, total), the plan's error and send counts, the
        unique-row counts, donors, replica counts and this rank's segment ends, in one transfer."""
        R = self.R
        parts = (
            g[:, self.E :].reshape(-1),
            global_plan.err,
            global_plan.send_counts.reshape(-1),
            uniq.reshape(-1),
            global_plan.donor,
            (global_plan.experts_to_copy >= 0).sum(1),
            global_plan.cu_seqlens[self.rank],
        )
        return StepRead.from_flat(torch.cat(parts).tolist(), R, self.epn)

    def _exchange_meta(self, layout: DispatchLayout, hidden, weights):
        """Side-table all-to-all (exact plan counts) -> the receive maps; fills the receive weights. The token
        rows' all-to-all starts beside the side table's (its splits are known from the step's read too).
        Returns (plan, the rows' Pending)."""
        r, R, step, lay, global_plan = self.rank, self.R, layout.step, layout.send, layout.global_plan
        send_slots, recv_slots = list(step.send[r]), [step.send[q][r] for q in range(R)]
        send_uniq, recv_uniq = list(step.uniq[r]), [step.uniq[q][r] for q in range(R)]
        n, U = sum(send_slots), sum(send_uniq)
        meta = self._meta_out[:n]
        meta[:, 0] = lay.dest_row[:n]
        meta[:, 1] = lay.uniq_local[:n]
        pos = lay.slot_pos[:n]
        if weights is None:
            meta[:, 2] = 0
        else:  # fp32 bits in an int32 column: integer tables travel as integers, weights exactly
            meta[:, 2] = weights.detach().reshape(-1).index_select(0, pos).float().view(torch.int32)
        got = self._meta_in[: sum(recv_slots)]
        side = self.comm.all_to_all_single_start(got, meta, recv_slots, send_slots, splits_agreed=True)
        rows = self._start_rows(hidden, lay.uniq_token[:U], send_uniq, recv_uniq)
        side.wait()
        row, uniq = recv_layout(got[:, 0], got[:, 1], global_plan.send_counts[:, r], layout.recv_uniq)
        if self.static_rows:
            recv_rows = num_recv_rows(layout.total_num_tokens, self.K, R, self.epn, self.token_padding, self.max_slack)
        else:
            recv_rows = step.cu[-1]
        plan = CommPlan(
            global_plan=global_plan,
            rank=r,
            buffer_id=id(self),
            generation=layout.generation,
            num_tokens=layout.num_tokens,
            total_num_tokens=layout.total_num_tokens,
            recv_rows=recv_rows,
            cu_seqlens=global_plan.cu_seqlens[r],
            row_source=row_sources(row, uniq, recv_rows),
            cu_host=step.cu,
            slot_pos=pos,
            send_slot_splits=send_slots,
            uniq_token=lay.uniq_token[:U],
            send_uniq_splits=send_uniq,
            recv_slot_row=row,
            recv_slot_uniq=uniq,
            recv_slot_splits=recv_slots,
            recv_uniq_splits=recv_uniq,
            layout=layout,
        )
        if weights is not None:
            self._weights_from(plan, got[:, 2].contiguous().view(torch.float32))
        return plan, rows

    def _zero_unwritten(self, view: torch.Tensor, plan: CommPlan) -> None:
        """Zero the receive rows no slot writes: unpadded, the slots fill a prefix; padded, padding interleaves."""
        if self.token_padding == 1:
            view[plan.recv_slot_row.numel() :].zero_()
        else:
            view.zero_()

    def _weights_from(self, plan: CommPlan, per_slot: torch.Tensor | None) -> None:
        """Scatter received per-slot weights [n_recv] into the [recv_rows] weight rows (empty rows zero)."""
        if per_slot is None:
            return
        w = self._recv_w[: plan.recv_rows]
        self._zero_unwritten(w, plan)
        w.index_copy_(0, plan.recv_slot_row, per_slot.to(torch.float32))

    def _start_rows(self, hidden: torch.Tensor, uniq_token: torch.Tensor, send_uniq: list, recv_uniq: list):
        """Start the all-to-all of one row per (token, destination) into the wire buffer (behind its zero row)."""
        src = self._wire_out[: uniq_token.numel()]
        torch.index_select(hidden, 0, uniq_token, out=src)
        got = self._wire_in[1 : 1 + sum(recv_uniq)]
        return self.comm.all_to_all_single_start(got, src, recv_uniq, send_uniq, splits_agreed=True)

    def _expand(self, plan: CommPlan, rows, with_weights: bool, zero_copy: bool):
        """The rows landed, expanded into the expert-grouped receive rows."""
        rows.wait()
        wire = self._wire_in[: 1 + sum(plan.recv_uniq_splits)]
        weights = self._recv_w[: plan.recv_rows] if with_weights else None
        if not zero_copy:  # the epilogue in one pass, straight into the caller's own tensor
            return wire.index_select(0, plan.row_source), None if weights is None else weights.clone()
        out = self._recv[: plan.recv_rows]
        torch.index_select(wire, 0, plan.row_source, out=out)
        return out, weights

    def _send_rows(self, plan: CommPlan, hidden: torch.Tensor, with_weights: bool, zero_copy: bool):
        """One row per (token, destination) over the wire, expanded into the expert-grouped receive rows."""
        rows = self._start_rows(hidden, plan.uniq_token, plan.send_uniq_splits, plan.recv_uniq_splits)
        return self._expand(plan, rows, with_weights, zero_copy)

    def redispatch(
        self,
        plan: CommPlan,
        hidden: torch.Tensor,
        *,
        topk_weights: torch.Tensor | None = None,
        zero_copy: bool = False,
        any_step: bool = False,
    ):
        """Dispatch ``hidden`` [s, H] (and ``topk_weights`` [s, K] if given) along a saved plan: no planning, no
        side table, no host read (combine's backward). Returns what ``dispatch`` returns.
        any_step: accept a plan of an earlier dispatch of this Buffer (a backward after later dispatches);
        otherwise, with ``check_reuse``, only the latest dispatch's plan is accepted."""
        if self.check_reuse:  # plan-reuse calls carry no count exchange: checking costs one all-reduce
            code, detail = _checks.plan_problem(self, plan, any_step)
            if code == 0:
                code, detail, _ = _checks.dispatch_problem(self, hidden, topk_weights, None, None, None, reuse=True)
            if code == 0 and hidden.shape[0] != plan.num_tokens:
                code = Problem.FOREIGN_PLAN
                detail = f"hidden has {hidden.shape[0]} tokens but the plan was made for s={plan.num_tokens}"
            self._agree("redispatch", code, detail)
        if topk_weights is not None:
            per_slot = self._slots_forward(
                plan, topk_weights.detach().reshape(-1).index_select(0, plan.slot_pos).float()
            )
            self._weights_from(plan, per_slot)
        return self._send_rows(plan, hidden, topk_weights is not None, zero_copy) + (plan.cu_seqlens, plan)

    def _slots_forward(self, plan: CommPlan, per_slot: torch.Tensor) -> torch.Tensor:
        """[n] values in send order -> [n_recv] in receive order (exact plan counts)."""
        got = torch.empty(sum(plan.recv_slot_splits), dtype=per_slot.dtype, device=self.device)
        self.comm.all_to_all_single(
            got, per_slot.contiguous(), plan.recv_slot_splits, plan.send_slot_splits, validate=False, splits_agreed=True
        )
        return got

    def _check_owner(self, op: str, plan) -> None:
        """A plan-taking call refuses a plan (or layout) that this Buffer did not make on this rank (a plan is one
        rank's view of one Buffer's step; another's splits would exchange the wrong rows)."""
        ours = isinstance(plan, (CommPlan, DispatchLayout))
        if not ours or plan.buffer_id != id(self) or plan.rank != self.rank:
            where = "another Buffer or rank" if ours else type(plan).__name__
            raise ValueError(
                f"moonep.{op}: rank {self.rank}: plan must be the CommPlan this Buffer's dispatch returned on this "
                f"rank, got one from {where}"
            )

    def _agree(self, op: str, code: int, detail: str) -> None:
        """One small all-reduce of the error code so that every rank raises together (or none does)."""
        flags = torch.zeros(self.R, dtype=torch.int64, device=self.device)
        flags[self.rank] = code
        self.comm.all_reduce(flags, "sum", validate=False)
        _checks.raise_agreed(op, self.rank, flags.tolist(), detail)

    # ------------------------------------------------------------------------------------------- combine
    def combine(
        self,
        plan: CommPlan,
        expert_out: torch.Tensor,
        recv_weights: torch.Tensor | None = None,
        *,
        any_step: bool = False,
    ):
        """Bring every slot's expert output home and sum a token's K copies (UNWEIGHTED).

        expert_out [recv_rows, H]: rows in the dispatch layout (the expert side already applied routing weights).
        recv_weights [recv_rows] (optional): also gathered per slot -> gathered_weights [s, K] (masked slots 0).
        any_step: accept a plan of an earlier dispatch of this Buffer (dispatch's backward after later
        dispatches); otherwise, with ``check_reuse``, a plan other than the latest dispatch's is an error on
        every rank (checked on the all-reduce that ``check_reuse`` costs anyway).
        Returns (out [s, H], gathered_weights [s, K] fp32 | None). Rows outside routed slots are ignored.
        """
        if self.check_reuse:
            code, detail = _checks.combine_problem(self, plan, expert_out, recv_weights, any_step)
            self._agree("combine", code, detail)
        # prologue: a token's slots on this rank are summed into its one unique row before it travels home;
        # unfilled rows sum into the zero row, which is zeroed again for the next dispatch
        ext = self._wire_in[: 1 + sum(plan.recv_uniq_splits)]
        ext.zero_()
        ext.index_add_(0, plan.row_source, expert_out)
        back = self._wire_out[: plan.uniq_token.numel()]
        rows = self.comm.all_to_all_single_start(
            back, ext[1:], plan.send_uniq_splits, plan.recv_uniq_splits, splits_agreed=True
        )
        if recv_weights is not None:  # the per-slot values travel beside the rows
            per_slot = recv_weights.detach().index_select(0, plan.recv_slot_row).float().contiguous()
            home = torch.empty(plan.slot_pos.numel(), dtype=torch.float32, device=self.device)
            slots = self.comm.all_to_all_single_start(
                home, per_slot, plan.send_slot_splits, plan.recv_slot_splits, splits_agreed=True
            )
        rows.wait()
        ext[0].zero_()
        out = torch.zeros(plan.num_tokens, self.H, dtype=self.dtype, device=self.device)
        out.index_add_(0, plan.uniq_token, back)
        if recv_weights is None:
            return out, None
        slots.wait()
        gathered = torch.zeros(plan.num_tokens * self.K, dtype=torch.float32, device=self.device)
        gathered.index_copy_(0, plan.slot_pos, home)
        return out, gathered.view(plan.num_tokens, self.K)

    # ------------------------------------------------------------------------------ weights and grads
    def prefetch_weight(self, plan: CommPlan, local_weights, prefetch_buffers) -> None:
        """Copy the replicated experts' weights into the replica slots of the ranks that compute them.

        local_weights: [epn, ...] tensor (or a sequence of them, one per projection) = this rank's experts.
        prefetch_buffers: [epn, ...] replica slots (same structure); slot b of rank d receives expert
        ``plan.global_plan.experts_to_copy[d, b]`` (unused slots are left untouched). Collective: every rank calls it.
        """
        self.prefetch_weight_start(plan, local_weights, prefetch_buffers).wait()

    def prefetch_weight_start(self, plan: CommPlan, local_weights, prefetch_buffers) -> Pending:
        """``prefetch_weight`` started (one asynchronous all-to-all for all projections of one dtype: a copy's
        rows side by side); ``wait()`` lands the slots. Until then the slots are undefined and the local weights
        must not change."""
        self._check_owner("prefetch_weight", plan)
        return replica_exchange.push_start(self.comm, self.epn, plan, local_weights, prefetch_buffers)

    def reduce_grad(self, plan: CommPlan, local_grads, reduce_buffers) -> None:
        """Sum the replica slots' weight-gradients into their home experts' grads; zero the consumed slots.

        local_grads: [epn, ...] (or a sequence); reduce_buffers: [epn, ...] slot grads (same structure).
        Collective: every rank calls it, after every rank wrote its slot grads. One all-to-all for all
        projections of one dtype.
        """
        self._check_owner("reduce_grad", plan)
        replica_exchange.reduce(self.comm, self.epn, plan, local_grads, reduce_buffers)

    def reduce_grad_start(self, plan: CommPlan, reduce_buffers) -> replica_exchange.GradsInFlight:
        """``reduce_grad`` started before the home grads exist (the EP step's backward computes its own experts
        meanwhile): sends the slots' grads and zeros them; ``.finish(epn, local_grads)`` adds them home."""
        self._check_owner("reduce_grad", plan)
        return replica_exchange.reduce_start(self.comm, plan, reduce_buffers)


__all__ = ["Buffer", "CommPlan", "resolve_device"]
