"""Input checks for ``Buffer.dispatch`` / ``combine`` / ``redispatch`` that fail on every rank, never hang.

Pattern: each rank inspects its own arguments without raising (a problem becomes an integer code plus a local
detail string), the code rides on the collective the call needs anyway (dispatch's all-gather of the counts)
or on one small all-reduce (combine), and then every rank raises the same ``ValueError`` naming the first
failing rank and the problem, before any row moves.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch

from collectives.base import Communicator
from moonep.agreement import UNREADABLE, cost_words, dtype_word, int_word
from planner.slack import check_options, slack_num


class Problem(enum.IntEnum):
    """What a rank found wrong with its arguments; the code travels to every rank, which raises together."""

    OK = 0
    HIDDEN = 1
    TOO_MANY_TOKENS = 2
    TOPK_IDX = 3
    EXPERT_ID = 4
    TOPK_WEIGHTS = 5
    NONFINITE_WEIGHTS = 6
    COUNTS = 7
    TOTAL_TOKENS = 8
    EXPERT_OUT = 9
    RECV_WEIGHTS = 10
    FOREIGN_PLAN = 11
    STALE_PLAN = 12


MAX_TOTAL = 2**40
"""the largest total_num_tokens a growing Buffer accepts (it travels in an int64 with room for the plan's sums)."""

# code -> generic wording (used by ranks that only see the code; the failing rank adds its own detail)
PROBLEMS = {
    Problem.HIDDEN: "hidden has the wrong type, shape, dtype or device",
    Problem.TOO_MANY_TOKENS: "the number of tokens s exceeds the Buffer's capacity S",
    Problem.TOPK_IDX: "topk_idx is not an integer tensor of shape [s, K] on the Buffer's device",
    Problem.EXPERT_ID: "topk_idx holds expert ids outside [-1, E)",
    Problem.TOPK_WEIGHTS: "topk_weights is not a floating tensor of shape [s, K] on the Buffer's device",
    Problem.NONFINITE_WEIGHTS: "topk_weights holds NaN or infinite values on routed slots",
    Problem.COUNTS: "slots_per_expert does not match the histogram of topk_idx",
    Problem.TOTAL_TOKENS: "total_num_tokens is not an integer >= s",
    Problem.EXPERT_OUT: "expert_out has the wrong type, shape, dtype or device",
    Problem.RECV_WEIGHTS: "recv_weights has the wrong type, shape, dtype or device",
    Problem.FOREIGN_PLAN: "plan was made by another Buffer or rank",
    Problem.STALE_PLAN: "plan was made by an earlier dispatch of this Buffer, not its latest",
}


def _tensor_problem(
    t: Any,
    name: str,
    shape: tuple,
    dtype: torch.dtype | None,
    device: torch.device,
    floating: bool = False,
    integer: bool = False,
) -> str | None:
    """Why ``t`` is not a tensor of ``shape`` (None entries match anything), ``dtype`` and ``device``."""
    if not isinstance(t, torch.Tensor):
        return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if t.dim() != len(shape) or any(w is not None and g != w for g, w in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        return f"{name} must have shape {want}, got {list(t.shape)}"
    if dtype is not None and t.dtype != dtype:
        return f"{name} must have dtype {dtype}, got {t.dtype}"
    if floating and not t.dtype.is_floating_point:
        return f"{name} must be a floating tensor, got {t.dtype}"
    if integer and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        return f"{name} must be an integer tensor (expert ids), got {t.dtype}"
    if t.device != device:
        return f"{name} must be on {device}, got {t.device}"
    return None


def dispatch_problem(
    buf, hidden, topk_weights, topk_idx, slots_per_expert, total_num_tokens, reuse: bool
) -> tuple[int, str, int]:
    """(code, detail, s) for one rank's dispatch arguments; code 0 = fine. Never raises."""
    try:
        return _dispatch_problem(buf, hidden, topk_weights, topk_idx, slots_per_expert, total_num_tokens, reuse)
    except Exception as exc:  # a check itself failed on a strange input: still report, never hang the peers
        return Problem.HIDDEN, f"could not inspect the arguments: {type(exc).__name__}: {exc}", 0


def _dispatch_problem(buf, hidden, topk_weights, topk_idx, tpe, total, reuse):
    p = _tensor_problem(hidden, "hidden", (None, buf.H), buf.dtype, buf.device)
    if p:
        return Problem.HIDDEN, p, 0
    s = int(hidden.shape[0])
    if s > buf.S and not getattr(buf, "grow", False):
        return Problem.TOO_MANY_TOKENS, f"hidden has s={s} tokens, which exceeds capacity S={buf.S}", s
    if reuse:
        if topk_weights is not None:
            p = _tensor_problem(topk_weights, "topk_weights", (s, buf.K), None, buf.device, floating=True)
            if p:
                return Problem.TOPK_WEIGHTS, p, s
        return Problem.OK, "", s
    p = _tensor_problem(topk_idx, "topk_idx", (s, buf.K), None, buf.device, integer=True)
    if p:
        return Problem.TOPK_IDX, p, s
    if topk_weights is not None:
        p = _tensor_problem(topk_weights, "topk_weights", (s, buf.K), None, buf.device, floating=True)
        if p:
            return Problem.TOPK_WEIGHTS, p, s
    if tpe is not None:
        p = _tensor_problem(tpe, "slots_per_expert", (buf.E,), None, buf.device, integer=True)
        if p:
            return Problem.COUNTS, p, s
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < s):
        return Problem.TOTAL_TOKENS, f"total_num_tokens must be an int >= s={s}, got {total!r}", s
    most = MAX_TOTAL if getattr(buf, "grow", False) else buf.R * buf.S
    if total is not None and total > most:
        return Problem.TOTAL_TOKENS, f"total_num_tokens={total} exceeds R*S={most} (R ranks of S tokens each)", s
    return Problem.OK, "", s


def routed_ids(buf, topk_idx: torch.Tensor) -> torch.Tensor:
    """topk_idx [s, K] as int64 with ids outside [0, E) set to -1 (``data_code`` reports them; the layout
    never sees an id it cannot place, so every rank reaches the step's host read)."""
    idx = topk_idx.long()
    return torch.where((idx >= 0) & (idx < buf.E), idx, -1)


def data_code(buf, topk_idx, topk_weights, tpe, counts: torch.Tensor) -> torch.Tensor:
    """The checks that need tensor data, as a device scalar (OK, EXPERT_ID, NONFINITE_WEIGHTS or COUNTS; the first
    failing one in that order wins):
    it travels with the counts and is read with the step's split table, not on its own."""
    idx = topk_idx.long()
    code = torch.zeros((), dtype=torch.int64, device=idx.device)
    if tpe is not None:
        code = torch.where((tpe.long() != counts).any(), int(Problem.COUNTS), code)
    if topk_weights is not None:
        bad = ~torch.isfinite(topk_weights) & (idx >= 0)
        code = torch.where(bad.any(), int(Problem.NONFINITE_WEIGHTS), code)
    return torch.where(((idx < -1) | (idx >= buf.E)).any(), int(Problem.EXPERT_ID), code)


def data_detail(buf, topk_idx, topk_weights) -> str:
    """The failing rank's own words for a ``data_code`` (read only on the error path)."""
    bad = topk_idx[(topk_idx < -1) | (topk_idx >= buf.E)]
    if bad.numel():
        return f"topk_idx holds expert id {bad[0].item()}, outside [-1, E={buf.E}) (-1 means no expert)"
    if topk_weights is not None and not bool(torch.isfinite(topk_weights[topk_idx >= 0]).all()):
        return PROBLEMS[Problem.NONFINITE_WEIGHTS]
    return "slots_per_expert does not match the histogram of topk_idx (ids -1 excluded)"


def raise_agreed(
    op: str, rank: int, codes: Sequence[int], detail: str, problems: dict = PROBLEMS, prefix: str = "moonep."
) -> None:
    """Raise the same ValueError on every rank when any rank reported a problem (first failing rank wins):
    ``"{prefix}{op}: rank r: what"``.

    problems: code -> generic wording for the ranks that only see the code (an adapter passes its own table).
    """
    bad = [r for r, c in enumerate(codes) if c]
    if not bad:
        return
    first = bad[0]
    what = detail if first == rank and detail else problems.get(codes[first], f"problem code {codes[first]}")
    others = f" (also ranks {bad[1:]})" if len(bad) > 1 else ""
    raise ValueError(f"{prefix}{op}: rank {first}: {what}{others}")


def check_totals(rank: int, s, totals) -> int:
    """The agreed global token count; raises the same ValueError on every rank when ranks disagree.

    totals[r] = -1 when rank r passed total_num_tokens=None: the count all-gather already carries every rank's
    s, so None on every rank means sum(s). Ranks that pass it must all pass the same value, equal to sum(s).
    """
    s, totals = list(s), list(totals)
    given = [t for t in totals if t >= 0]
    if given and len(given) != len(totals):
        none = [r for r, t in enumerate(totals) if t < 0]
        raise ValueError(
            f"moonep.dispatch: rank {none[0]}: total_num_tokens=None while other ranks pass it; "
            f"pass it on every rank or on none (None: inferred from every rank's token count)"
        )
    wrong = [r for r, t in enumerate(totals) if t >= 0 and t != sum(s)]
    if wrong:
        q = wrong[0]
        raise ValueError(
            f"moonep.dispatch: rank {q}: total_num_tokens={totals[q]} but the ranks' token "
            f"counts {s} sum to {sum(s)} (total_num_tokens per rank: {totals})"
        )
    return sum(s)


def plan_problem(buf, plan, any_step: bool) -> tuple[int, str]:
    """(code, detail) when ``plan`` is not this Buffer's plan on this rank, or (unless ``any_step``) not the plan
    of its latest dispatch: an older plan lays out other rows, and its sizes often match. Host ints only."""
    if getattr(plan, "buffer_id", None) != id(buf) or getattr(plan, "rank", None) != buf.rank:
        return Problem.FOREIGN_PLAN, "plan must be the CommPlan this Buffer's dispatch returned on this rank"
    if not any_step and plan.generation != buf.generation:
        return Problem.STALE_PLAN, (
            f"plan comes from dispatch #{plan.generation} of this Buffer but its latest is #{buf.generation}: a "
            f"plan is valid until the next dispatch (any_step=True: the caller vouches that the rows were laid "
            f"out by that plan's dispatch, e.g. a backward)"
        )
    return Problem.OK, ""


def check_generations(generations) -> None:
    """Every rank's Buffer must be at the same dispatch: the same ValueError on every rank otherwise."""
    generations = list(generations)
    if len(set(generations)) > 1:
        raise ValueError(
            f"moonep.dispatch: the ranks' Buffers are at different dispatch counts {generations} (per rank): a rank "
            f"skipped or repeated a dispatch; every rank of the EP group must make the same calls in the same order"
        )


def combine_problem(buf, plan, expert_out, recv_weights, any_step: bool = False) -> tuple[int, str]:
    """(code, detail) for one rank's combine arguments; code 0 = fine. Never raises."""
    try:
        code, detail = plan_problem(buf, plan, any_step)
        if code:
            return code, detail
        p = _tensor_problem(expert_out, "expert_out", (plan.recv_rows, buf.H), buf.dtype, buf.device)
        if p:
            return Problem.EXPERT_OUT, p
        if recv_weights is not None:
            p = _tensor_problem(recv_weights, "recv_weights", (plan.recv_rows,), None, buf.device, floating=True)
            if p:
                return Problem.RECV_WEIGHTS, p
        return Problem.OK, ""
    except Exception as exc:
        return Problem.EXPERT_OUT, f"could not inspect the arguments: {type(exc).__name__}: {exc}"


def buffer_settings(
    comm: Communicator, S, H, K, E, token_padding, dtype, slack, cost, grow
) -> tuple[dict, tuple[str, str] | None]:
    """(settings words, this rank's own problem or None) of a ``Buffer``'s arguments: every size, dtype and
    balancing option that one plan per step depends on. Never raises (``agreement.agree_settings`` does)."""
    sizes = {"S": S, "H": H, "K": K, "E": E, "token_padding": token_padding}
    words = {n: int_word(v) for n, v in sizes.items()}
    words["dtype"] = dtype_word(dtype)
    try:  # a value that cannot be a word still travels (UNREADABLE): its own check below names it
        words["slack"] = -1 if slack is None else slack_num(slack)
    except ValueError:
        words["slack"] = UNREADABLE
    try:
        words.update({f"cost#{i}": w for i, w in enumerate(cost_words(cost))})
    except Exception:
        words.update({f"cost#{i}": UNREADABLE for i in range(4)})
    words["grow"] = int(bool(grow))
    problem = None
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problem = (name, f"{name} must be a positive int, got {value!r}")
            break
    if problem is None and E % comm.world_size:
        problem = ("E", f"E={E} must be a multiple of the EP group size R={comm.world_size}")
    if problem is None and not isinstance(dtype, torch.dtype):
        problem = ("dtype", f"dtype must be a torch.dtype, got {dtype!r}")
    if problem is None:
        try:
            balance_options(slack, cost)
        except (TypeError, ValueError) as exc:
            problem = ("slack" if cost is None else "cost#0", str(exc))
    return words, problem


def balance_options(slack: Any, cost: Any) -> tuple[float | None, Any, float]:
    """(slack, cost, the largest σ a plan may use) after the planner's own check of the options."""
    check_options(slack, cost)
    return slack, cost, cost.max_slack if cost is not None else (slack or 0.0)
