"""``BufferRows``: the rows of a step moved along its saved ``CommPlan`` (no planning, no host read).

The pieces ``moonep.buffer``'s dispatch ends with (the rows' all-to-all, their expansion into the
expert-grouped receive rows, the receive weights), and the two plan-reuse calls built from them:
``redispatch`` (combine's backward) and ``combine`` (dispatch's backward). Collective: every rank calls them in
the same order.
"""

from __future__ import annotations

import torch

from collectives import Pending
from moonep import _checks
from moonep._checks import Problem
from moonep.buffer_core import BufferCore
from moonep.comm_plan import CommPlan

# Shape suffixes (as torchtitan's models/common/moe.py): T tokens on this rank (s), H hidden, K top-k,
# N receive rows of the step (recv_rows: expert-grouped, padded per segment), P routed slots this rank sends,
# Q routed slots it receives, U unique (token, destination) rows it sends, V unique rows it receives (the wire
# buffer holds 1 + V of them: row 0 is the zero row that unfilled receive rows read).


class BufferRows(BufferCore):
    """Row movement along a saved plan (``moonep.buffer.Buffer`` adds the planned dispatch)."""

    def _zero_unwritten(self, view: torch.Tensor, plan: CommPlan) -> None:
        """Zero the receive rows no slot writes: unpadded, the slots fill a prefix; padded, padding interleaves."""
        if self.token_padding == 1:
            view[plan.recv_slot_row.numel() :].zero_()
        else:
            view.zero_()

    def _weights_from(self, plan: CommPlan, per_slot_Q: torch.Tensor | None) -> None:
        """Scatter received per-slot weights [Q] into the [N] weight rows (empty rows zero)."""
        if per_slot_Q is None:
            return
        w_N = self._recv_w[: plan.recv_rows]
        self._zero_unwritten(w_N, plan)
        w_N.index_copy_(0, plan.recv_slot_row, per_slot_Q.to(torch.float32))

    def _start_rows(
        self, x_TH: torch.Tensor, uniq_token_U: torch.Tensor, send_uniq: list[int], recv_uniq: list[int]
    ) -> Pending:
        """Start the all-to-all of one row per (token, destination) into the wire buffer (behind its zero row)."""
        src_UH = self._wire_out[: uniq_token_U.numel()]
        torch.index_select(x_TH, 0, uniq_token_U, out=src_UH)
        got_VH = self._wire_in[1 : 1 + sum(recv_uniq)]
        return self.comm.all_to_all_single_start(got_VH, src_UH, recv_uniq, send_uniq, splits_agreed=True)

    def _expand(
        self, plan: CommPlan, rows: Pending, with_weights: bool, zero_copy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows landed, expanded into the expert-grouped receive rows: (rows [N, H], weights [N] fp32 | None)."""
        rows.wait()
        wire_VH = self._wire_in[: 1 + sum(plan.recv_uniq_splits)]  # 1 + V rows: the zero row first
        w_N = self._recv_w[: plan.recv_rows] if with_weights else None
        if not zero_copy:  # the epilogue in one pass, straight into the caller's own tensor
            return wire_VH.index_select(0, plan.row_source), None if w_N is None else w_N.clone()
        out_NH = self._recv[: plan.recv_rows]
        torch.index_select(wire_VH, 0, plan.row_source, out=out_NH)
        return out_NH, w_N

    def _send_rows(
        self, plan: CommPlan, x_TH: torch.Tensor, with_weights: bool, zero_copy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One row per (token, destination) over the wire, expanded into the expert-grouped receive rows."""
        rows = self._start_rows(x_TH, plan.uniq_token, plan.send_uniq_splits, plan.recv_uniq_splits)
        return self._expand(plan, rows, with_weights, zero_copy)

    def _slots_forward(self, plan: CommPlan, per_slot_P: torch.Tensor) -> torch.Tensor:
        """[P] values in send order -> [Q] in receive order (exact plan counts)."""
        got_Q = torch.empty(sum(plan.recv_slot_splits), dtype=per_slot_P.dtype, device=self.device)
        self.comm.all_to_all_single(
            got_Q, per_slot_P.contiguous(), plan.recv_slot_splits, plan.send_slot_splits, validate=False,
            splits_agreed=True,
        )  # fmt: skip
        return got_Q

    def redispatch(
        self,
        plan: CommPlan,
        hidden: torch.Tensor,
        *,
        topk_weights: torch.Tensor | None = None,
        zero_copy: bool = False,
        any_step: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, CommPlan]:
        """Dispatch new rows along a saved plan: no planning, no side table, no host read (combine's backward).

        Args:
            plan: the ``CommPlan`` a dispatch of this Buffer returned on this rank.
            hidden: [T, H] rows in the Buffer's dtype, on its device, T = ``plan.num_tokens``.
            topk_weights: [T, K] float routing weights to send along (optional).
            zero_copy: return views of the Buffer (overwritten by its next dispatch) instead of fresh tensors.
            any_step: accept a plan of an earlier dispatch of this Buffer (a backward after later dispatches);
                otherwise, with ``check_reuse``, only the latest dispatch's plan is accepted.

        Returns:
            ``(recv_hidden, recv_weights, cu_seqlens, plan)`` as ``Buffer.dispatch`` returns them:
            recv_hidden [N, H] (Buffer dtype), recv_weights [N] fp32 or None without ``topk_weights``,
            cu_seqlens [2*epn] int64 and the same ``plan``.
        """
        x_TH, w_TK = hidden, topk_weights
        if self.check_reuse:  # plan-reuse calls carry no count exchange: checking costs one all-reduce
            code, detail = _checks.plan_problem(self, plan, any_step)
            if code == 0:
                code, detail, _ = _checks.dispatch_problem(self, x_TH, w_TK, None, None, None, reuse=True)
            if code == 0 and x_TH.shape[0] != plan.num_tokens:
                code = Problem.FOREIGN_PLAN
                detail = f"hidden has {x_TH.shape[0]} tokens but the plan was made for s={plan.num_tokens}"
            self._agree("redispatch", code, detail)
        if w_TK is not None:
            w_P = w_TK.detach().reshape(-1).index_select(0, plan.slot_pos).float()
            self._weights_from(plan, self._slots_forward(plan, w_P))
        rows_NH, w_N = self._send_rows(plan, x_TH, w_TK is not None, zero_copy)
        return rows_NH, w_N, plan.cu_seqlens, plan

    def combine(
        self,
        plan: CommPlan,
        expert_out: torch.Tensor,
        recv_weights: torch.Tensor | None = None,
        *,
        any_step: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bring every slot's expert output home and sum a token's K copies (UNWEIGHTED: the expert side
        already applied the routing weights). Rows outside routed slots are ignored.

        Args:
            plan: the ``CommPlan`` of the dispatch that laid the rows out (this Buffer's, this rank's).
            expert_out: [N, H] rows in the dispatch layout, N = ``plan.recv_rows``, in the Buffer's dtype and
                on its device.
            recv_weights: [N] float per-row values (optional) gathered home per slot, e.g. the routing weights'
                grads in dispatch's backward.
            any_step: accept a plan of an earlier dispatch of this Buffer (dispatch's backward after later
                dispatches); otherwise, with ``check_reuse``, a plan other than the latest dispatch's is an error
                on every rank (checked on the all-reduce that ``check_reuse`` costs anyway).

        Returns:
            ``(out, gathered_weights)``: out [T, H] in the Buffer's dtype, T = ``plan.num_tokens``, each token's
            K copies summed; gathered_weights [T, K] fp32 (masked slots 0), or None without ``recv_weights``.
        """
        z_NH, w_N = expert_out, recv_weights
        if self.check_reuse:
            code, detail = _checks.combine_problem(self, plan, z_NH, w_N, any_step)
            self._agree("combine", code, detail)
        # prologue: a token's slots on this rank are summed into its one unique row before it travels home;
        # unfilled rows sum into the zero row, which is zeroed again for the next dispatch
        ext_VH = self._wire_in[: 1 + sum(plan.recv_uniq_splits)]  # 1 + V rows: the zero row first
        ext_VH.zero_()
        ext_VH.index_add_(0, plan.row_source, z_NH)
        back_UH = self._wire_out[: plan.uniq_token.numel()]
        rows = self.comm.all_to_all_single_start(
            back_UH, ext_VH[1:], plan.send_uniq_splits, plan.recv_uniq_splits, splits_agreed=True
        )
        if w_N is not None:  # the per-slot values travel beside the rows
            w_Q = w_N.detach().index_select(0, plan.recv_slot_row).float().contiguous()
            home_P = torch.empty(plan.slot_pos.numel(), dtype=torch.float32, device=self.device)
            slots = self.comm.all_to_all_single_start(
                home_P, w_Q, plan.send_slot_splits, plan.recv_slot_splits, splits_agreed=True
            )
        rows.wait()
        ext_VH[0].zero_()
        out_TH = torch.zeros(plan.num_tokens, self.H, dtype=self.dtype, device=self.device)
        out_TH.index_add_(0, plan.uniq_token, back_UH)
        if w_N is None:
            return out_TH, None
        slots.wait()
        gathered_TK = torch.zeros(plan.num_tokens * self.K, dtype=torch.float32, device=self.device)
        gathered_TK.index_copy_(0, plan.slot_pos, home_P)
        return out_TH, gathered_TK.view(plan.num_tokens, self.K)


__all__ = ["BufferRows"]
