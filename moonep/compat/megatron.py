"""Megatron-core's token-dispatcher protocol over MoonEP's balanced dispatch and combine.

    from moonep.compat.megatron import MoonEPTokenDispatcher
    disp = MoonEPTokenDispatcher(num_local_experts, local_expert_indices, config, pg_collection)
    x, probs = disp.dispatch_preprocess(hidden_states, routing_map, probs)   # [*, H], [s, E] bool, [s, E]
    x, probs = disp.token_dispatch(x, probs)
    x, tokens_per_expert, permuted_probs = disp.dispatch_postprocess(x, probs)
    x, (w1, w2) = disp.expert_weights(x, w1_local, w2_local)               # [epn, ...] -> [2*epn, ...]
    y = grouped_mlp(x, w1, w2, tokens_per_expert) * permuted_probs[:, None]  # the experts apply the probs
    y = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(y)))   # shaped like hidden_states

Megatron's current six stages (``MoETokenDispatcher`` since mid-2025; checked against megatron-core 0.16.1):
``routing_map`` is a bool ``[s, E]`` mask with at most ``config.moe_router_topk`` experts per token (fewer is
fine; none means the token gets zero output), ``probs`` ``[s, E]``. As in Megatron the *experts* multiply by
``permuted_probs`` and combine is an unweighted sum, so gradients flow to ``hidden_states`` and to ``probs``
(selected entries). The pre-2025 two-call API (``token_permutation`` / ``token_unpermutation``) is gone from
megatron-core and not provided.

Where the layout differs from Megatron: MoonEP balances by computing some experts on other ranks, so the
local expert axis has ``2*epn`` groups, this rank's own experts in id order then its ``epn`` replica slots
(the slots' experts change every step). ``tokens_per_expert`` is ``[2*epn]`` (padded segment sizes, CPU int64)
and the grouped GEMM must run over a ``[2*epn, ...]`` weight view: ``expert_weights`` builds it (own experts,
then the replicas pushed from their home ranks) and, in backward, sums the replicas' gradients back into the
home experts. This is moonep.MoE's layout, not the DeepEP adapter's home-expert one (that adapter keeps DeepEP's
unbalanced semantics; this one exists to get MoonEP's balance). Megatron's own experts modules therefore do not
run on it unchanged; ``SequentialExperts`` wraps a ``SequentialMLP``-like module (``.local_experts``) so they do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from collectives.base import Communicator
from moonep._checks import raise_agreed
from moonep.buffer import Buffer
from moonep.comm_plan import CommPlan
from moonep.compat._group import as_communicator
from moonep.ep_step import EPRows, ep_combine, ep_dispatch
from moonep.experts import ensure_replicas, pool_for, repush_guard

PROBLEMS = {
    1: "hidden_states must be a tensor whose last dimension is config.hidden_size",
    2: "routing_map must be a bool tensor of shape [num_tokens, num_experts]",
    3: "probs must be a floating tensor of shape [num_tokens, num_experts]",
    4: "routing_map selects more than moe_router_topk experts for a token",
    5: "probs holds NaN or infinite values where routing_map is True",
}


@dataclass(frozen=True)
class MoonEPDispatcherConfig:
    """The fields of Megatron's ``TransformerConfig`` this dispatcher reads (either object may be passed)."""

    num_moe_experts: int
    """E: routed experts in the layer (a multiple of the EP group size)."""
    moe_router_topk: int
    """K: the most experts one token is routed to."""
    hidden_size: int
    """H: size of a token's hidden vector."""


class MoonEPTokenDispatcher:
    """Megatron ``MoETokenDispatcher`` (six stages) with MoonEP's exact balance; see the module docstring.

    num_local_experts: epn = E / R; local_expert_indices: this rank's experts ``[r*epn, (r+1)*epn)`` (Megatron's
    layout). config: a Megatron ``TransformerConfig`` or ``MoonEPDispatcherConfig``. pg_collection: a Megatron
    ``ProcessGroupCollection`` (its ``ep`` group; expert TP must be 1), a torch ProcessGroup or a
    ``collectives.Communicator``. max_tokens: S, the most tokens per call on a rank (None: the Buffer grows to
    the largest call seen, a decision every rank takes alike). buffer: a ``moonep.Buffer`` to share between
    layers. token_padding: grouped-GEMM tile each expert segment is padded to.
    One micro-batch in flight per dispatcher, as in Megatron.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices,
        config,
        pg_collection=None,
        *,
        max_tokens: int | None = None,
        buffer: Buffer | None = None,
        token_padding: int = 1,
    ) -> None:
        group = getattr(pg_collection, "ep", pg_collection)
        if group is None:
            raise ValueError(
                "MoonEPTokenDispatcher needs pg_collection (ProcessGroupCollection, ProcessGroup or Communicator)"
            )
        tp = getattr(pg_collection, "expt_tp", None)
        if tp is not None and tp.size() != 1:
            raise ValueError("MoonEPTokenDispatcher needs expert tensor parallel size 1")
        self.comm: Communicator = as_communicator(group)
        self.config = config
        self.num_experts, self.topk = int(config.num_moe_experts), int(config.moe_router_topk)
        self.hidden_size = int(config.hidden_size)
        R, r = self.comm.world_size, self.comm.rank
        if self.num_experts % R or not 1 <= self.topk <= self.num_experts:
            raise ValueError(
                f"num_moe_experts={self.num_experts} must be a multiple of the EP size {R} and "
                f">= moe_router_topk={self.topk} >= 1"
            )
        self.epn = self.num_experts // R
        want = list(range(r * self.epn, (r + 1) * self.epn))
        if num_local_experts != self.epn or list(local_expert_indices) != want:
            raise ValueError(
                f"rank {r} must own experts {want} (num_local_experts={self.epn}), got "
                f"{num_local_experts} experts {list(local_expert_indices)}"
            )
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
        self.num_local_experts, self.local_expert_indices = num_local_experts, want
        self.max_tokens, self.token_padding, self.buffer = max_tokens, token_padding, buffer
        self._owns_buffer = buffer is None
        self.shared_experts = None
        self.plan: CommPlan | None = None
        """CommPlan of the micro-batch in flight (set by token_dispatch)."""
        self.rows: EPRows | None = None
        """``moonep.ep_step.EPRows`` of the micro-batch in flight (token_combine brings them home)."""

    def _in_flight(self, op: str) -> EPRows:
        """The rows of the micro-batch in flight, or the ValueError that says to call token_dispatch first."""
        if self.rows is None:
            raise ValueError(f"{op} needs this micro-batch's plan: call it after token_dispatch")
        return self.rows

    # ------------------------------------------------------------------------------------------ dispatch
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Local: hidden_states [*, H], routing_map [s, E] bool, probs [s, E] -> (tokens [s, H], topk probs
        [s, K] with ids -1 where a token selects fewer than K). Problems are recorded, raised by token_dispatch
        on every rank."""
        self._code, self._detail = 0, ""
        self.hidden_shape = getattr(hidden_states, "shape", None)
        try:
            tokens = hidden_states.reshape(-1, self.hidden_size)
        except Exception as exc:  # never raise here: the peers are about to enter a collective
            self._code, self._detail = 1, f"H={self.hidden_size}, got shape {self.hidden_shape}: {exc}"
            return hidden_states, probs
        self._code, self._detail = _routing_problem(routing_map, probs, tokens.shape[0], self.num_experts, self.topk)
        if self._code:
            return tokens, probs
        E = self.num_experts
        ids = torch.arange(E, device=routing_map.device).expand_as(routing_map)
        sel = torch.where(routing_map, ids, torch.full_like(ids, E)).sort(dim=1).values[:, : self.topk]
        if sel.shape[1] < self.topk:
            sel = nn.functional.pad(sel, (0, self.topk - sel.shape[1]), value=E)
        valid = sel < E
        self.topk_idx = torch.where(valid, sel, torch.full_like(sel, -1))
        picked = probs.gather(1, sel.clamp(max=E - 1))
        return tokens, torch.where(valid, picked, torch.zeros_like(picked))

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Collective: agree on the inputs (one all-gather of [code, s]), then MoonEP's balanced dispatch.

        Returns (rows [recv_rows, H], row probs [recv_rows] fp32): grouped by (own expert, then replica slot),
        padded."""
        dev = hidden_states.device if isinstance(hidden_states, torch.Tensor) else self.comm.device
        mine = torch.zeros(2, dtype=torch.int64, device=dev)
        mine[0], mine[1] = self._code, hidden_states.shape[0] if self._code == 0 else 0
        every = torch.empty(self.comm.world_size * 2, dtype=torch.int64, device=dev)
        self.comm.all_gather(every, mine, validate=False)
        codes, sizes = every.view(-1, 2).t().tolist()
        # the failing rank names the generic problem and its own detail; the others the generic one
        mine = f"{PROBLEMS[self._code]} ({self._detail})" if self._code and self._detail else ""
        raise_agreed("MoonEPTokenDispatcher", self.comm.rank, codes, mine, problems=PROBLEMS, prefix="")
        buffer = self._ensure_buffer(max(sizes), hidden_states.dtype, hidden_states.device)
        self.rows = rows = ep_dispatch(
            buffer, hidden_states, topk_idx=self.topk_idx, topk_weights=probs, total_num_tokens=sum(sizes)
        )
        self.plan = rows.plan
        self.cu_seqlens, self.num_rows = rows.cu_seqlens, rows.plan.cu_host[-1]  # host copy: dispatch's read
        return rows.rows, rows.weights

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Local: -> (tokens [n, H] grouped by the 2*epn local groups, tokens_per_expert [2*epn] int64 on CPU,
        permuted_probs [n] fp32); n = rows up to the last segment (padding rows have zero tokens and probs)."""
        cu = torch.tensor(self._in_flight("dispatch_postprocess").plan.cu_host, dtype=torch.int64)  # on the CPU
        tokens_per_expert = torch.diff(cu, prepend=cu.new_zeros(1))
        return hidden_states[: self.num_rows], tokens_per_expert, probs[: self.num_rows]

    def expert_weights(self, tokens: torch.Tensor, *local_weights: torch.Tensor):
        """Collective: (tokens [n, H], weights [epn, ...] each) -> (tokens, tuple of [2*epn, ...] views).

        Rows [0, epn) of a view are this rank's experts, rows [epn, 2*epn) this step's replica slots (weights
        pushed from their home ranks; unused slots zero). Backward sums the slots' grads into the home experts'.
        Use the returned tokens: they tie the replica-grad reduction to run after the experts' backward and
        before the dispatch's, the same order on every rank."""
        rows = self._in_flight("expert_weights")
        buf, plan, epn, key = rows.buffer, rows.plan, self.epn, ("megatron-stacked", id(self))
        pools = [
            pool_for(buf, f"megatron-stacked:{i}", tuple(w.shape[1:]), w.dtype) for i, w in enumerate(local_weights)
        ]
        ensure_replicas(buf, plan, key, pools, local_weights)
        per_expert = [w[i] for w in local_weights for i in range(epn)]  # views: grads flow to the stacked params
        tokens, *slots = _PooledSlots.apply(buf, plan, pools, epn, tokens, *per_expert)
        # a [2*epn] tensor needs one copy of the own experts; the slots come from the shared pools (cat copies
        # them too, so a later push into the pools cannot reach this layer's saved weights)
        return tokens, tuple(torch.cat((w, sl)) for w, sl in zip(local_weights, slots))

    # ------------------------------------------------------------------------------------------- combine
    def combine_preprocess(self, hidden_states: torch.Tensor):
        """Local: expert output [n, H] -> [recv_rows, H] (zero rows appended; a wrong shape is refused by combine)."""
        rows = self._in_flight("combine_preprocess")
        n, H = self.num_rows, rows.buffer.H
        if hidden_states.dim() == 2 and tuple(hidden_states.shape) == (n, H):
            hidden_states = nn.functional.pad(hidden_states, (0, 0, 0, rows.plan.recv_rows - n))
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor):
        """Collective: [recv_rows, H] -> [s, H], the unweighted sum of each token's expert outputs."""
        return ep_combine(self._in_flight("token_combine"), hidden_states)

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """Local: [s, H] -> the shape of the hidden_states given to dispatch_preprocess."""
        if self.hidden_shape is None:  # dispatch_preprocess refused it, and token_dispatch raised on every rank
            raise ValueError("combine_postprocess needs the shape dispatch_preprocess saw: call that first")
        return hidden_states.view(self.hidden_shape)

    def set_shared_experts(self, shared_experts) -> None:
        """Megatron's shared-expert overlap hook: not provided (run the shared expert beside the layer)."""
        raise ValueError("MoonEPTokenDispatcher does not overlap shared experts; set moe_shared_expert_overlap=False")

    def _ensure_buffer(self, s_max: int, dtype: torch.dtype, device: torch.device) -> Buffer:
        """Build (or grow, or move) an owned Buffer on the tokens' device; every rank sees the same s_max, so
        they all decide alike.

        A shared Buffer (``buffer=``) is never replaced: too many tokens, another dtype or device is refused by
        its dispatch on every rank."""
        b, need = self.buffer, self.max_tokens or s_max
        if b is not None and (not self._owns_buffer or (b.dtype == dtype and need <= b.S and b.device == device)):
            return b
        S = self.max_tokens or max(s_max, 1, 0 if b is None else b.S)
        self.buffer = b = Buffer(
            self.comm,
            S=S,
            H=self.hidden_size,
            K=self.topk,
            E=self.num_experts,
            token_padding=self.token_padding,
            dtype=dtype,
            device=device,
        )
        return b


class _PooledSlots(torch.autograd.Function):
    """(tokens, own expert params...) -> (tokens, replica-slot views [epn, ...] per parameter name): the slots
    are the shared pools (already pushed); backward: the slots' grads summed home (``reduce_grad``) and returned
    as grads of the own params. The tokens tie this backward after the experts' and before the dispatch's."""

    @staticmethod
    def forward(ctx, buffer: Buffer, plan, pools, epn: int, tokens, *own):
        ctx.buffer, ctx.plan, ctx.epn, ctx.dtypes = buffer, plan, epn, [p.weights.dtype for p in pools]
        ctx.shapes, ctx.device = [p.weights.shape for p in pools], tokens.device
        return (tokens.view_as(tokens),) + tuple(p.weights.detach() for p in pools)

    @staticmethod
    def backward(ctx, grad_tokens, *grad_slots):
        epn, shapes = ctx.epn, ctx.shapes
        home = [torch.zeros(shape, dtype=torch.float32, device=ctx.device) for shape in shapes]
        slots = [
            torch.zeros(shape, dtype=torch.float32, device=ctx.device) if g is None else g.to(torch.float32, copy=True)
            for g, shape in zip(grad_slots, shapes)
        ]
        ctx.buffer.reduce_grad(ctx.plan, home, slots)
        per_param = [h[i].to(dt) for h, dt in zip(home, ctx.dtypes) for i in range(epn)]
        return (None, None, None, None, grad_tokens) + tuple(per_param)


class SequentialExperts(nn.Module):
    """Runs a Megatron ``SequentialMLP``-like module (``.local_experts``: epn identical expert modules called
    as ``expert(tokens, probs) -> (out, bias)``) on the dispatcher's ``[2*epn]`` layout.

    forward(tokens [n, H], tokens_per_expert [2*epn], permuted_probs [n]) -> (out [n, H], None), like
    SequentialMLP. Own groups call the local experts' parameters in place; replica groups run the expert template
    (torch.func) with weights from moonep's shared replica pools (one per parameter shape, shared by every
    layer, as in ``moonep.grouped_experts``): no stacked or concatenated weight copies. The backward re-pushes
    a layer's replicas if another layer used the pools since, then sums the replicas' grads home."""

    def __init__(self, experts: nn.Module, dispatcher: MoonEPTokenDispatcher) -> None:
        super().__init__()
        self.experts, self.dispatcher = experts, dispatcher
        if len(self._local_experts) != dispatcher.epn:
            raise ValueError(f"experts has {len(self._local_experts)} local experts, the dispatcher {dispatcher.epn}")

    @property
    def _local_experts(self) -> nn.ModuleList:
        """The wrapped module's epn expert modules (``SequentialMLP.local_experts``)."""
        return cast(nn.ModuleList, self.experts.local_experts)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        if getattr(getattr(self.experts, "config", None), "moe_apply_probs_on_input", False):  # as SequentialMLP does
            tokens, permuted_probs = tokens * permuted_probs[:, None].to(tokens.dtype), torch.ones_like(permuted_probs)
        d, local = self.dispatcher, self._local_experts
        rows = d._in_flight("SequentialExperts")
        names = [n for n, _ in local[0].named_parameters()]
        own = [[dict(e.named_parameters())[n] for e in local] for n in names]
        buf, plan, key = rows.buffer, rows.plan, ("megatron", id(self))
        pools = [pool_for(buf, f"megatron:{n}", tuple(ps[0].shape), ps[0].dtype) for n, ps in zip(names, own)]

        def stacked():  # send buffers for a push (the own params are read in place otherwise)
            return [torch.stack([p.detach() for p in ps]) for ps in own]

        ensure_replicas(buf, plan, key, pools, stacked)
        tokens, *slots = _PooledSlots.apply(buf, plan, pools, d.epn, tokens, *[p for ps in own for p in ps])
        sizes, outs = tokens_per_expert.tolist(), []
        for g, (x, p) in enumerate(zip(torch.split(tokens, sizes), torch.split(permuted_probs, sizes))):
            if not x.shape[0]:
                continue
            params: dict[str, torch.Tensor] = {
                n: (ps[g] if g < d.epn else sl[g - d.epn]) for n, ps, sl in zip(names, own, slots)
            }
            out, bias = torch.func.functional_call(local[0], params, (x, p.to(x.dtype)))
            outs.append(out if bias is None else out + bias)
        out = torch.cat(outs) if outs else tokens.new_zeros(0, tokens.shape[1])
        return repush_guard(buf, plan, key, pools, stacked, out), None


def _routing_problem(routing_map, probs, s: int, E: int, K: int) -> tuple[int, str]:
    """(code, detail) for routing_map / probs; code 0 = fine. Never raises."""
    try:
        if (
            not isinstance(routing_map, torch.Tensor)
            or routing_map.dtype != torch.bool
            or tuple(routing_map.shape) != (s, E)
        ):
            got = (
                (routing_map.dtype, list(routing_map.shape))
                if isinstance(routing_map, torch.Tensor)
                else type(routing_map).__name__
            )
            return 2, f"want [{s}, {E}] torch.bool, got {got}"
        if not isinstance(probs, torch.Tensor) or not probs.dtype.is_floating_point or tuple(probs.shape) != (s, E):
            got = (probs.dtype, list(probs.shape)) if isinstance(probs, torch.Tensor) else type(probs).__name__
            return 3, f"want [{s}, {E}] floating, got {got}"
        per_token = routing_map.sum(1)
        if s and int(per_token.max()) > K:
            return 4, f"moe_router_topk={K}, token {int(per_token.argmax())} selects {int(per_token.max())}"
        if not bool(torch.isfinite(probs.detach()[routing_map]).all()):
            bad = int((~torch.isfinite(probs.detach()) & routing_map).any(1).nonzero()[0])
            return 5, f"first at token {bad}"
        return 0, ""
    except Exception as exc:
        return 3, f"could not inspect routing_map/probs: {type(exc).__name__}: {exc}"


__all__ = ["MoonEPDispatcherConfig", "MoonEPTokenDispatcher", "SequentialExperts"]
