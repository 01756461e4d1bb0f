"""``moonep.MoE``: a drop-in expert-parallel MoE layer (router, balanced dispatch, grouped experts, combine).

Axes: ``s`` tokens on this rank, ``H`` hidden, ``F`` expert FFN size, ``E`` experts, ``K`` top-k, ``R`` ranks,
``epn = E / R``. Rank r holds experts ``[r*epn, (r+1)*epn)`` as ``w13 [epn, H, 2F]`` and ``w2 [epn, F, H]``;
the router and the optional shared expert are replicated (their grads are per-rank partial sums: reduce them
with data-parallel grads as usual).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as Fn
from torch import nn

from collectives.base import Communicator
from moonep.agreement import agree_settings, dtype_word, int_word
from moonep.autograd import dispatch
from moonep.buffer import Buffer
from moonep.comm_plan import CommPlan
from moonep.ep_step import routed_experts
from moonep.geometry import EPGeometry
from moonep.parallel import check_not_replicated, mark_expert
from moonep.router import SigmoidTopKRouter

_LAYER_IDS = itertools.count()


class SharedExpert(nn.Module):
    """Dense SwiGLU applied to every token (replicated on every rank). x [s, H] -> [s, H]."""

    def __init__(self, H: int, F: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.randn(H, 2 * F) / H**0.5)
        self.w2 = nn.Parameter(torch.randn(F, H) / F**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w13
        F = self.w2.shape[0]
        return (Fn.silu(h[:, :F]) * h[:, F:]) @ self.w2


SAME_LAYER = "every rank of the EP group must build the same layer (H, F, E, K, S, shared_F and dtype)"


def agree_layer(comm: Communicator, *, H, F, E, K, S, shared_F, dtype, problem: tuple[str, str] | None) -> None:
    """The layer's sizes and weight dtype agreed across ranks (``agreement.agree_settings``): construction only."""
    sizes = {"H": H, "F": F, "E": E, "K": K, "S": S, "shared_F": shared_F}
    words = {n: int_word(v) for n, v in sizes.items()} | {"dtype": dtype_word(dtype)}
    agree_settings(comm, "MoE", words, problem, hint=SAME_LAYER)


def _layer_problem(args: dict) -> tuple[str, str] | None:
    """This rank's own check of ``MoE``'s arguments, as (setting, message) for ``agree_layer``; None if fine."""
    for name in ("H", "F", "E", "K"):
        v = args[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return name, f"{name} must be a positive int, got {v!r}"
    if args["E"] % args["comm"].world_size:
        return "E", f"E={args['E']} must be a multiple of the EP group size R={args['comm'].world_size}"
    shared_F, buffer = args["shared_F"], args["buffer"]
    if isinstance(shared_F, bool) or not isinstance(shared_F, int) or shared_F < 0:
        return "shared_F", f"shared_F must be an int >= 0, got {shared_F!r}"
    if not isinstance(args["dtype"], torch.dtype):
        return "dtype", f"dtype must be a torch.dtype, got {args['dtype']!r}"
    if buffer is None:
        return None  # the Buffer agrees on the rest (S, token_padding, balancing) and checks them
    if args["slack"] is not None or args["cost"] is not None:
        return "S", "slack and cost belong to the Buffer: pass them to the shared Buffer instead"
    try:
        geometry = EPGeometry(S=args["S_"], H=args["H"], K=args["K"], E=args["E"], token_padding=args["pad"])
    except ValueError as exc:
        return "S", str(exc)
    if buffer.geometry != geometry:
        return "S", f"the buffer's {buffer.geometry} differs from the layer's {geometry}"
    return None


def _weights_problem(w13, w2, E, R) -> tuple[str, str] | None:
    """``MoE.from_weights``' own check of the given expert weights (None if fine)."""
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0] or w13.shape[2] != 2 * w2.shape[1]:
        got = f"{tuple(w13.shape)} and {tuple(w2.shape)}"
        return "F", f"from_weights needs w13 [E or epn, H, 2F] and w2 [E or epn, F, H]; got {got}"
    if w2.shape[2] != w13.shape[1]:
        return "H", f"from_weights: w2 [.., F, H] must end in H={w13.shape[1]}, got {tuple(w2.shape)}"
    n = w13.shape[0]
    if isinstance(E, bool) or not isinstance(E, int) or E < 1 or E % R or n not in (E, E // R):
        return "E", f"from_weights: {n} experts given; expected all E={E} or E/R={E // R} (R={R})"
    return None


class MoE(nn.Module):
    """Expert-parallel MoE layer: ``y = moe(x)`` for x [..., H] (at most S tokens per call on this rank).

    comm: the EP group's Communicator. H, F, E, K, S (keyword-only): hidden size, expert FFN size, experts,
    top-k, token capacity per rank (S=None: the owned Buffer grows to the largest call, decided alike on every
    rank). buffer: a shared ``Buffer`` (one per group is enough; built if None) whose ``EPGeometry`` must be the
    layer's (token_padding=None takes the buffer's, else 1).
    router: callable x [s, H] -> (topk_idx [s, K], topk_weights [s, K]); default ``SigmoidTopKRouter``.
    shared_F: FFN size of an optional shared expert (0 = none).
    slack, cost: the balancing of an owned Buffer (``Buffer``: a bounded slack, or a ``planner.CostModel``
    choosing it per step; neither = exact balance).
    """

    def __init__(
        self,
        comm: Communicator,
        *,
        H: int,
        F: int,
        E: int,
        K: int,
        S: int | None,
        router: Callable | None = None,
        shared_F: int = 0,
        token_padding: int | None = None,
        buffer: Buffer | None = None,
        dtype: torch.dtype = torch.float32,
        slack: float | None = None,
        cost=None,
    ) -> None:
        super().__init__()
        pad = token_padding or (buffer.token_padding if buffer is not None else 1)
        grow = S is None
        S_ = buffer.S if grow and buffer is not None else S or 1
        # compared across ranks before any rank raises alone: F and the weights' dtype shape the replica push
        agree_layer(comm, H=H, F=F, E=E, K=K, S=S_, shared_F=shared_F, dtype=dtype, problem=_layer_problem(locals()))
        geometry = EPGeometry(S=S_, H=H, K=K, E=E, token_padding=pad)
        # combine's arguments come from this layer's own expert step: checking them would cost a host read
        self.buffer = buffer or Buffer(
            comm, **vars(geometry), dtype=dtype, check_reuse=False, slack=slack, cost=cost, grow=grow
        )
        self._owns_buffer = buffer is None
        b = self.buffer
        self.H, self.F, self.E, self.K, self.epn = H, F, E, K, b.epn
        self.router = router if router is not None else SigmoidTopKRouter(H, E, K)
        self.w13 = nn.Parameter(torch.randn(b.epn, H, 2 * F, dtype=dtype) / H**0.5)
        """[epn, H, 2F] this rank's experts: gate and up projections side by side."""
        self.w2 = nn.Parameter(torch.randn(b.epn, F, H, dtype=dtype) / F**0.5)
        """[epn, F, H] this rank's experts: down projection."""
        mark_expert(self.w13, self.w2)  # one EP rank's experts: data parallelism must leave them alone
        self.shared = SharedExpert(H, shared_F) if shared_F else None
        self._key = ("moe", next(_LAYER_IDS))  # owner key for the shared weight pools
        self._contract_checked = False
        self.last_plan: CommPlan | None = None
        """the plan of the layer's last step (None before the first)."""

    def _buffer_on(self, device: torch.device) -> Buffer:
        """The Buffer on the input's device: an owned Buffer follows the data (rebuilt once after a move)."""
        b = self.buffer
        if b.device != device and self._owns_buffer:
            self.buffer = b = Buffer(
                b.comm,
                **vars(b.geometry),
                dtype=b.dtype,
                device=device,
                check_reuse=b.check_reuse,
                slack=b.slack,
                cost=b.cost,
                grow=b.grow,
            )
        return b

    @classmethod
    def from_weights(
        cls, comm: Communicator, w13: torch.Tensor, w2: torch.Tensor, *, K: int, S: int | None = None, **kwargs
    ) -> MoE:
        """A layer holding existing expert weights: ``w13 [E or epn, H, 2F]`` (gate and up side by side, in x
        out) and ``w2 [E or epn, F, H]``; given all E experts, this rank keeps its ``[rank*epn, (rank+1)*epn)``
        slice (pass ``E=`` when giving only this rank's epn). The weights are copied (dtype and device follow them);
        other arguments as ``MoE``."""
        R, r = comm.world_size, comm.rank
        E = kwargs.pop("E", None) or (w13.shape[0] if w13.dim() == 3 else 0)  # all E unless E says epn given
        problem = _weights_problem(w13, w2, E, R)
        if problem:  # the peers meet this rank in their own layer's agreement and raise with it
            agree_layer(comm, H=0, F=0, E=E, K=K, S=S or 1, shared_F=0, dtype=w13.dtype, problem=problem)
        n, H, F = w13.shape[0], w13.shape[1], w2.shape[1]
        epn = E // R
        mine = slice(r * epn, (r + 1) * epn) if n == E else slice(None)
        layer = cls(comm, H=H, F=F, E=E, K=K, S=S, dtype=w13.dtype, **kwargs)
        with torch.no_grad():
            layer.w13.copy_(w13[mine])
            layer.w2.copy_(w2[mine])
        return layer.to(w13.device)

    def route(self, x2: torch.Tensor, topk_idx=None, topk_weights=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_idx [s, K] int, topk_weights [s, K] fp32): the given routing or the router's, checked for its
        form (the ids and weights themselves are checked on every rank by dispatch)."""
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError("MoE: pass both topk_idx and topk_weights (your own routing) or neither (the router's)")
        who = "the given routing"
        if topk_idx is None:
            out, who = self.router(x2), "router"
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise ValueError(
                    f"MoE: the router must return (topk_idx [s, K], topk_weights [s, K]); it returned "
                    f"{type(out).__name__}{f' of {len(out)} values' if isinstance(out, (tuple, list)) else ''}"
                )
            topk_idx, topk_weights = out
        s = x2.shape[0]
        topk_idx = self._routing_tensor(who, "topk_idx", topk_idx, s)
        topk_weights = self._routing_tensor(who, "topk_weights", topk_weights, s)
        if topk_weights.dtype.is_floating_point is False:
            raise ValueError(f"MoE: {who}'s topk_weights must be floating point, got {topk_weights.dtype}")
        return topk_idx, topk_weights.float()

    def _routing_tensor(self, who: str, name: str, t: object, s: int) -> torch.Tensor:
        """``t`` if it is a tensor [s, K], else the ValueError that names it."""
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (s, self.K):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"MoE: {who}'s {name} must be a tensor [s={s}, K={self.K}], got {got}")
        return t

    def forward(
        self,
        x: torch.Tensor,
        *,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        total_num_tokens: int | None = None,
    ) -> torch.Tensor:
        """The layer, expert-parallel: y = shared(x) + sum over k of topk_weights[:, k] * expert_{topk_idx[:, k]}(x).

        Collective: every rank of the EP group calls it (with its own tokens); bad input on any rank raises the
        same ValueError on all.

        Args:
            x: [..., H] activations in the layer's dtype, T = x.numel() / H tokens (T <= S unless S=None).
            topk_idx: [T, K] integer expert ids in [0, E), -1 = no expert: your model's own routing instead of
                the layer's router (pass both or neither).
            topk_weights: [T, K] float routing weights (used as fp32), with topk_idx.
            total_num_tokens: sum of T over the ranks (None: inferred from every rank's token count).

        Returns:
            y: [..., H] like x (the routed experts' output in the layer's dtype, plus the shared expert's).
        """
        shape = x.shape
        if not self._contract_checked:  # once: a DDP/FSDP wrapper replicating the experts would corrupt them
            check_not_replicated(self)
            self._contract_checked = True
        self._buffer_on(x.device)
        if x.dim() < 1 or shape[-1] != self.H:  # fail on every rank: the bad width rides on dispatch's all-gather
            bad = x.reshape(-1, shape[-1] if x.dim() else 1)
            dispatch(self.buffer, bad, topk_idx=torch.full((bad.shape[0], self.K), -1, device=x.device))
        x2 = x.reshape(-1, self.H)
        topk_idx, topk_weights = self.route(x2, topk_idx, topk_weights)
        weights = (self.w13, self.w2)
        y, self.last_plan = routed_experts(
            self.buffer,
            x2,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            weights=weights,
            key=self._key,
            total_num_tokens=total_num_tokens,
        )
        if self.shared is not None:
            y = y + self.shared(x2)
        return y.reshape(shape)
