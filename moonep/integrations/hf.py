"""Hugging Face transformers 5.x MoE models made expert-parallel in one call: ``parallelize(model, comm)``.

The 5.x seam: every MoE block computes ``_, weights, idx = block.gate(h)`` then ``block.experts(h, idx, weights)``
with ``h [T, H]``, ``idx [T, K]`` and ``weights [T, K]``; the experts module holds fused Linear-style (out x in)
weights ``gate_up_proj [E, 2F, H]`` (gate half first) and ``down_proj [E, H, F]`` plus ``act_fn``. ``parallelize``
swaps each such ``experts`` module for an ``EPExperts`` holding this rank's ``epn = E / R`` experts
``[rank*epn, (rank+1)*epn)``: the model's own router (softmax, sigmoid, group-limited, correction bias, scaling),
shared experts, attention and norms are untouched. Families on the seam: Qwen3-MoE, Qwen3-Next, DeepSeek-V3,
Mixtral (GPT-OSS is not: in x out weights with biases and a clamped activation; it is refused by name).

Each rank must run the same number of forwards (the EP exchanges are collective): the same batch count. For
``generate()`` the parallelized model does that itself: it runs in transformers' ``synced_gpus`` mode, a rank
whose sequences are done keeps running forwards until every rank's are, and the "all done?" check is agreed over
``comm`` (any backend, one small all-reduce per new token), so ranks may generate different numbers of tokens.
Expert gradients follow moonep's contract (the gradient of the SUM of every EP rank's loss; moonep/README.md).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from collectives.base import Communicator
from moonep.buffer import Buffer
from moonep.ep_step import routed_experts
from moonep.expert_math import SWIGLU, GatedActivation
from moonep.parallel import check_not_replicated, mark_expert

FUSED = ("gate_up_proj", "down_proj")
"""The 5.x experts module's parameter names (kept by ``EPExperts``, so state-dict keys do not change)."""


def _experts_of(block: nn.Module) -> nn.Module:
    """A MoE block's ``experts`` child (a module: ``_is_seam`` picked the block for it)."""
    return cast(nn.Module, block.experts)


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    """The ``gate_up_proj`` / ``down_proj`` weight of an experts module (a tensor on the 5.x seam)."""
    return cast(torch.Tensor, getattr(module, name))


def gated_activation(act_fn: object) -> GatedActivation:
    """The experts' ``act_fn`` as moonep's gated activation ``act(gate, up) = act_fn(gate) * up`` (SiLU gets the
    closed-form SwiGLU derivative; anything else is differentiated by autograd, elementwise)."""
    if isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation":
        return SWIGLU
    if not callable(act_fn):
        raise TypeError(f"experts.act_fn must be callable, got {type(act_fn).__name__}")
    fn = cast(Callable[[torch.Tensor], torch.Tensor], act_fn)  # an elementwise activation: a tensor to a tensor
    return GatedActivation(lambda gate, up: fn(gate) * up)


class _SharedBuffer:
    """One Buffer per parallelized model (every MoE block has the same H, K, E), built on the first forward with
    the hidden states' dtype and device, growing to the largest token count (``S=None``)."""

    def __init__(self, comm: Communicator, H: int, K: int, E: int, S: int | None) -> None:
        self.comm, self.H, self.K, self.E, self.S = comm, H, K, E, S
        self.buffer: Buffer | None = None

    def get(self, x: torch.Tensor) -> Buffer:
        b = self.buffer
        if b is None or b.dtype != x.dtype or b.device != x.device:
            grow = self.S is None
            S = max(self.S or 1, b.S if b is not None else 1)
            self.buffer = b = Buffer(
                self.comm,
                S=S,
                H=self.H,
                K=self.K,
                E=self.E,
                dtype=x.dtype,
                device=x.device,
                check_reuse=False,
                grow=grow,
            )
        return b


class EPExperts(nn.Module):
    """Drop-in for a 5.x experts module: ``forward(h [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``
    (sum over k of weight * expert(h)), computed expert-parallel. Holds this rank's experts only:
    ``gate_up_proj [epn, 2F, H]`` and ``down_proj [epn, H, F]`` (the original names and layout, sliced)."""

    def __init__(self, experts: nn.Module, comm: Communicator, shared: _SharedBuffer, first: int, epn: int) -> None:
        super().__init__()
        mine = slice(first, first + epn)
        with torch.no_grad():  # the slice is copied, so the full [E, ...] tensors can be freed with the old module
            self.gate_up_proj = nn.Parameter(_tensor(experts, "gate_up_proj")[mine].clone())
            self.down_proj = nn.Parameter(_tensor(experts, "down_proj")[mine].clone())
        mark_expert(self.gate_up_proj, self.down_proj)
        self.act_fn = experts.act_fn
        self.activation = gated_activation(experts.act_fn)
        self.num_experts, self.first_expert, self.epn = shared.E, first, epn
        self.F = self.down_proj.shape[2]
        self._shared, self._checked = shared, False

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if not self._checked:  # once: a DDP/FSDP wrapper replicating these experts would corrupt them silently
            check_not_replicated(self)
            self._checked = True
        buf = self._shared.get(hidden_states)
        w13, F = self.gate_up_proj, self.F
        weights = (w13[:, :F], w13[:, F:], self.down_proj)  # linear layout: w1 (gate), w3 (up), w2: views
        y, _ = routed_experts(
            buf, hidden_states, topk_idx=top_k_index, topk_weights=top_k_weights.float(), weights=weights,
            layout="linear", activation=self.activation, key=self,
        )  # fmt: skip
        return y.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"experts [{self.first_expert}, {self.first_expert + self.epn}) of {self.num_experts}, F={self.F}"


def _is_seam(module: nn.Module) -> bool:
    """A MoE block: its ``experts`` child holds fused ``gate_up_proj`` weights (checked by ``_check_block``)."""
    experts = getattr(module, "experts", None)
    return isinstance(experts, nn.Module) and hasattr(experts, "gate_up_proj")


def _check_block(name: str, block: nn.Module, R: int) -> None:
    """One-line errors for MoE blocks off the 5.x seam or with experts not divisible over R ranks."""
    experts, name = _experts_of(block), f"{name}.experts"
    kind = type(experts).__name__
    extra = sorted(n for n, _ in experts.named_parameters(recurse=False) if n not in FUSED)
    if extra or not hasattr(experts, "down_proj") or not hasattr(experts, "act_fn") or not hasattr(block, "gate"):
        raise ValueError(
            f"moonep.integrations.hf: {name} ({kind}) is not on the 5.x fused seam (gate_up_proj [E, 2F, H], "
            f"down_proj [E, H, F], act_fn, a sibling gate; extra parameters: {extra})"
        )
    gu, dn = _tensor(experts, "gate_up_proj"), _tensor(experts, "down_proj")
    E, twoF, H = gu.shape
    if tuple(dn.shape) != (E, H, twoF // 2) or twoF % 2:
        raise ValueError(
            f"moonep.integrations.hf: {name} ({kind}) has gate_up_proj {tuple(gu.shape)} and down_proj "
            f"{tuple(dn.shape)}; expected [E, 2F, H] and [E, H, F] (Linear style)"
        )
    if E % R:
        raise ValueError(f"moonep.integrations.hf: {name} has E={E} experts, not a multiple of the EP size R={R}")


def parallelize(model: nn.Module, comm: Communicator, *, S: int | None = None) -> nn.Module:
    """Make ``model`` (a transformers 5.x MoE model, the same weights on every rank) expert-parallel over ``comm``
    in place and return it. Every ``experts`` module on the seam becomes an ``EPExperts`` with this rank's slice
    (the full tensors go with the old module); ``S``: tokens per rank per call to size the Buffer for (None: it
    grows to the largest call). Keep expert params out of DDP/FSDP: ``moonep.ignore_in_ddp(model)``."""
    blocks = [(n, m) for n, m in model.named_modules() if _is_seam(m)]
    if not blocks:
        raise ValueError(
            f"moonep.integrations.hf: {type(model).__name__} has no MoE block with gate and experts.gate_up_proj "
            f"(the transformers 5.x seam)"
        )
    done = [n for n, m in blocks if isinstance(m.experts, EPExperts)]
    if done:
        raise ValueError(f"moonep.integrations.hf: {type(model).__name__} is already expert-parallel ({done[0]})")
    R, shared = comm.world_size, None
    for name, block in blocks:
        _check_block(name, block, R)
    for name, block in blocks:
        E, _, H = _tensor(_experts_of(block), "gate_up_proj").shape
        K = _top_k(name, block)
        if shared is None:
            shared = _SharedBuffer(comm, H, K, E, S)
        elif (shared.H, shared.K, shared.E) != (H, K, E):
            raise ValueError(
                f"moonep.integrations.hf: {name} has (H, K, E)={(H, K, E)}, other blocks "
                f"{(shared.H, shared.K, shared.E)}; one model, one geometry"
            )
        epn = E // R
        block.experts = EPExperts(_experts_of(block), comm, shared, comm.rank * epn, epn)
    _sync_generate(model, comm)
    return model


def _sync_generate(model: nn.Module, comm: Communicator) -> None:
    """``model.generate`` in synced mode with the finished check over ``comm`` (bound methods on the instance:
    ``copy.deepcopy`` rebinds them to the copy)."""
    if not callable(getattr(type(model), "generate", None)):
        return
    # plain attributes (not parameters, buffers or modules): set as ``model.x = ...`` would, which nn.Module's
    # typed __setattr__ does not describe
    setattr(model, "_moonep_comm", comm)  # noqa: B010
    setattr(model, "generate", types.MethodType(_generate_synced, model))  # noqa: B010
    setattr(model, "_has_unfinished_sequences", types.MethodType(_unfinished_on_any_rank, model))  # noqa: B010


def _generate_synced(self, *args, **kwargs):
    """transformers' ``generate`` with ``synced_gpus=True`` unless the caller says otherwise."""
    kwargs.setdefault("synced_gpus", True)
    return type(self).generate(self, *args, **kwargs)


def _unfinished_on_any_rank(self, this_peer_finished: bool, synced_gpus: bool, device: torch.device) -> bool:
    """transformers' loop condition; synced, "some rank still generates" from an all-reduce over the EP ranks
    (collective: every rank evaluates it once per new token, finished or not)."""
    if not synced_gpus:
        return not this_peer_finished
    flag = torch.tensor([0 if this_peer_finished else 1], dtype=torch.int64, device=device)
    return bool(self._moonep_comm.all_reduce(flag, "sum").item())


def _top_k(name: str, block: nn.Module) -> int:
    """Top-k of a block's router (its ``top_k`` attribute; the config's otherwise)."""
    for owner in (block.gate, block, getattr(block, "config", None)):
        for attr in ("top_k", "num_experts_per_tok"):
            k = getattr(owner, attr, None)
            if isinstance(k, int):
                return k
    raise ValueError(f"moonep.integrations.hf: cannot find top_k on {name}.gate ({type(block.gate).__name__})")


@torch.no_grad()
def gather_state_dict(model: nn.Module, comm: Communicator) -> dict[str, torch.Tensor]:
    """The original HF state dict of a parallelized ``model`` (collective): every ``EPExperts``'s
    ``gate_up_proj [E, 2F, H]`` and ``down_proj [E, H, F]`` gathered from all ranks (rank order = expert order),
    under the original names; other entries as ``model.state_dict()``. Same on every rank: save it on one."""
    state = model.state_dict()
    for name, module in model.named_modules():
        if not isinstance(module, EPExperts):
            continue
        for pname in FUSED:
            local = getattr(module, pname).detach().contiguous()
            full = local.new_empty(comm.world_size * local.shape[0], *local.shape[1:])
            comm.all_gather(full, local)
            state[f"{name}.{pname}" if name else pname] = full
    return state


__all__ = ["parallelize", "gather_state_dict", "EPExperts", "gated_activation"]
