"""torchtitan 0.3 MoE layers made expert-parallel through its ``RoutedExperts`` seam, without editing torchtitan.

torchtitan's ``RoutedExperts.forward`` runs ``token_dispatcher.dispatch(x [T, D], scores [T, K], ids [T, K],
counts [E]) -> (rows, tokens_per_expert, metadata)``, then ``inner_experts(rows, tokens_per_expert)``, then
``token_dispatcher.combine(out_rows, metadata, x) -> [T, D]``. MoonEP replaces both children:

The three children run the phases of moonep's one EP step (``moonep.ep_step``), in its order:

- ``MoonEPTokenDispatcher``: ``ep_dispatch`` into the balanced receive layout (``[recv_rows, D]``: the rank's
  padded rows); its second output is a ``MoonEPStep`` (``EPRows``: the Buffer, the plan and the per-row routing
  weights) that torchtitan hands to the inner experts untouched, and its third the same object as combine's
  metadata; ``combine`` is ``ep_combine`` (the routing weights were applied on the expert side, as moonep's
  contract says);
- ``MoonEPGroupedExperts``: this rank's ``epn = E / R`` experts under torchtitan's names and layout
  (``w1_EFD [epn, F, D]``, ``w3_EFD [epn, F, D]``, ``w2_EDF [epn, D, F]``: nn.Linear style), computed by
  ``ep_experts`` (SwiGLU, fp32 math in the weights' dtype).

Two ways in: ``use_moonep(model_config, comm)`` swaps every ``RoutedExperts.Config``'s children before
``build()`` (as torchtitan's own converters swap dispatchers); ``parallelize(model, comm)`` swaps the children
of an already built model, keeping this rank's slice of its expert weights. torchtitan is imported only here.

``init_states`` on a model built through ``use_moonep`` seeds every expert from its GLOBAL index (see
``MoonEPGroupedExperts._init_self_parameters``): under the usual shared seed, EP = n initialises exactly the
experts EP = 1 does, and no two ranks hold copies of one another's experts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

# torchtitan is not a dependency: importing this module is the opt-in (moonep/__init__ never imports it)
from torchtitan.config import Configurable
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.protocols.module import Module

from collectives.base import Communicator
from moonep.buffer import Buffer
from moonep.ep_step import EPRows, ep_combine, ep_dispatch, ep_experts
from moonep.parallel import check_not_replicated, mark_expert

WEIGHTS = ("w1_EFD", "w3_EFD", "w2_EDF")
"""torchtitan's expert parameter names, in moonep's "linear" layout order (gate, up, down)."""


MoonEPStep = EPRows
"""What the dispatcher hands the inner experts through torchtitan's ``tokens_per_expert`` slot: the step's
``moonep.ep_step.EPRows`` (the Buffer, the plan, the per-row routing weights)."""


class MoonEPTokenDispatcher(Configurable):
    """torchtitan token dispatcher over moonep's balanced dispatch/combine (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        num_experts: int
        """E, every expert of the layer."""
        top_k: int
        """K, experts per token."""
        comm: Communicator | None = None
        """moonep communicator of the EP group; None: taken from torchtitan's ep mesh in ``wire_meshes``."""
        max_tokens: int | None = None
        """tokens per rank per call to size the Buffer for; None: it grows to the largest call."""

    def __init__(self, config: Config) -> None:
        self.num_experts, self.top_k, self.max_tokens = config.num_experts, config.top_k, config.max_tokens
        self.comm: Communicator | None = config.comm
        self.buffer: Buffer | None = None

    def wire_meshes(self, *, ep_mesh) -> None:
        """torchtitan's hook: adopt the EP mesh's process group (unless a communicator was given)."""
        if self.comm is None and ep_mesh is not None:
            from collectives import from_group  # heavy: only when torchtitan wires a mesh

            self.comm = from_group(ep_mesh)

    def _buffer(self, x: torch.Tensor) -> Buffer:
        b = self.buffer
        if self.comm is None:
            raise ValueError("MoonEPTokenDispatcher: no communicator: pass Config(comm=...) or parallelize with EP")
        if b is None or b.dtype != x.dtype or b.device != x.device:
            S = max(self.max_tokens or 1, b.S if b is not None else 1)
            b = Buffer(
                self.comm,
                S=S,
                H=x.shape[-1],
                K=self.top_k,
                E=self.num_experts,
                dtype=x.dtype,
                device=x.device,
                check_reuse=False,
                grow=self.max_tokens is None,
            )
            self.buffer = b
        return b

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        """-> (rows [recv_rows, D], MoonEPStep, MoonEPStep as combine's metadata); the per-expert counts are not
        needed (dispatch plans)."""
        del num_local_tokens_per_expert_E
        buf = self._buffer(x_TD)
        rows = ep_dispatch(buf, x_TD, topk_idx=topk_expert_ids_TK, topk_weights=topk_scores_TK.float())
        return rows.rows, rows, rows

    def combine(self, routed_output_RD, metadata, x_TD):
        """rows [recv_rows, D] (already weighted) -> [T, D] in x's dtype."""
        return ep_combine(metadata, routed_output_RD).to(x_TD.dtype)


class MoonEPGroupedExperts(Module):
    """torchtitan inner experts holding this rank's experts (``[rank*epn, (rank+1)*epn)``) under torchtitan's
    names; ``forward(rows, step)`` is ``moonep.grouped_experts`` on the dispatch layout."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        """D, the model width."""
        hidden_dim: int
        """F, one expert's FFN width."""
        num_experts: int
        """E, every expert of the layer (this rank holds E / R)."""
        comm: Communicator | None = None
        """moonep communicator of the EP group (its world size and rank pick the slice)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        R = 1 if config.comm is None else config.comm.world_size
        if config.num_experts % R:
            raise ValueError(f"MoonEPGroupedExperts: E={config.num_experts} is not a multiple of the EP size R={R}")
        self.num_experts, self.epn = config.num_experts, config.num_experts // R
        self.first_expert = 0 if config.comm is None else config.comm.rank * self.epn
        D, F, epn = config.dim, config.hidden_dim, self.epn
        self.w1_EFD = nn.Parameter(torch.empty(epn, F, D))
        self.w2_EDF = nn.Parameter(torch.empty(epn, D, F))
        self.w3_EFD = nn.Parameter(torch.empty(epn, F, D))
        mark_expert(self.w1_EFD, self.w2_EDF, self.w3_EFD)
        self._checked = False

    def _init_self_parameters(self) -> None:
        """torchtitan's ``init_states`` hook: expert e's weights come from a seed of its own, the same at any EP size.

        torchtitan's default runs ``param_init`` on the local ``[epn, ...]`` tensor from the shared RNG, so every
        rank drew the same values: 64 experts on 2 ranks were 32 duplicated pairs. Here one draw from the CPU RNG
        (identical on every rank and at every EP size, so the rest of the model initialises as at EP = 1 too) is
        mixed with the weight's name and the global expert index into a seed per expert; ``param_init`` runs on
        that expert's ``[1, ...]`` slice under it, and the generator's state is restored afterwards. Fan-based
        initialisers thus see one expert (torchtitan's own expert inits are fixed-std normals).
        """
        if self._param_init is None:
            super()._init_self_parameters()  # torchtitan's own error: no param_init and no reset_parameters
            return
        base = int(torch.randint(0, 2**62, (1,)).item())
        for name, param in self.named_parameters(recurse=False):
            gen = _default_generator(param.device)
            if gen is None:  # meta: nothing is drawn
                self._init_param(name, param)
                continue
            state = gen.get_state()
            try:
                with torch.no_grad():
                    for j in range(self.epn):
                        gen.manual_seed(_expert_seed(base, name, self.first_expert + j))
                        # one expert's view: torchtitan's initialisers take any tensor (annotated Parameter)
                        self._init_param(name, param[j : j + 1])  # pyright: ignore[reportArgumentType]
            finally:
                gen.set_state(state)

    def forward(self, x_RD: torch.Tensor, step: MoonEPStep) -> torch.Tensor:
        if not isinstance(step, MoonEPStep):
            raise TypeError(
                f"MoonEPGroupedExperts needs MoonEPTokenDispatcher beside it (got {type(step).__name__} for "
                f"tokens_per_expert): swap both children (use_moonep / parallelize)"
            )
        if not self._checked:  # once: DDP/FSDP replicating these experts would corrupt them
            check_not_replicated(self)
            self._checked = True
        ws = tuple(getattr(self, n) for n in WEIGHTS)
        return ep_experts(step, ws, x=x_RD, layout="linear", key=self)


def _default_generator(device: torch.device) -> torch.Generator | None:
    """The generator ``param_init``'s in-place initialisers draw from on ``device``; None on meta (no data)."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[torch.cuda.current_device() if device.index is None else device.index]
    if device.type == "meta":
        return None
    raise ValueError(f"MoonEPGroupedExperts: cannot seed experts per global index on device {device}")


def _expert_seed(base: int, weight: str, expert: int) -> int:
    """A 63-bit seed of (base, weight name, global expert index); hashed so that nearby inputs share no structure."""
    digest = hashlib.blake2b(f"{base}/{weight}/{expert}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def use_moonep(model_config, comm: Communicator, *, max_tokens: int | None = None) -> int:
    """Swap every ``RoutedExperts.Config`` inside ``model_config`` (any torchtitan config tree) to moonep's
    dispatcher and experts, before ``build()``; returns how many were swapped (0 raises). ``init_states`` then
    seeds each expert from its global index: EP = n gives EP = 1's experts."""
    n = 0
    for _, cfg, _, _ in model_config.traverse(RoutedExperts.Config, recurse=True):
        inner, disp = cfg.inner_experts, cfg.token_dispatcher
        cfg.inner_experts = MoonEPGroupedExperts.Config(
            dim=inner.dim,
            hidden_dim=inner.hidden_dim,
            num_experts=inner.num_experts,
            comm=comm,
            param_init=getattr(inner, "param_init", None),
        )
        cfg.token_dispatcher = MoonEPTokenDispatcher.Config(
            num_experts=disp.num_experts, top_k=disp.top_k, comm=comm, max_tokens=max_tokens
        )
        n += 1
    if not n:
        raise ValueError(f"use_moonep: {type(model_config).__name__} holds no RoutedExperts.Config")
    return n


def parallelize(model: nn.Module, comm: Communicator, *, max_tokens: int | None = None) -> nn.Module:
    """Make a built torchtitan model (the same weights on every rank) expert-parallel in place: every
    ``RoutedExperts`` gets moonep's dispatcher and inner experts holding this rank's slice of its weights."""
    found = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    if not found:
        raise ValueError(f"moonep.integrations.torchtitan: {type(model).__name__} has no RoutedExperts")
    for routed in found:
        old = routed.inner_experts
        if not isinstance(old, GroupedExperts):
            raise ValueError(
                f"moonep.integrations.torchtitan: inner_experts is {type(old).__name__}, not GroupedExperts"
            )
        E, F, D = old.w1_EFD.shape
        new = MoonEPGroupedExperts(MoonEPGroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E, comm=comm))
        mine = slice(new.first_expert, new.first_expert + new.epn)
        with torch.no_grad():
            for name in WEIGHTS:
                getattr(new, name).data = getattr(old, name).detach()[mine].clone()
        routed.inner_experts = new
        routed.token_dispatcher = MoonEPTokenDispatcher(
            MoonEPTokenDispatcher.Config(num_experts=E, top_k=_top_k(routed), comm=comm, max_tokens=max_tokens)
        )
    return model


def _top_k(routed: nn.Module) -> int:
    """top_k of the dispatcher torchtitan built for this ``RoutedExperts``."""
    k = getattr(routed.token_dispatcher, "top_k", None)
    if not isinstance(k, int):
        raise ValueError(f"moonep.integrations.torchtitan: cannot read top_k from {type(routed.token_dispatcher)}")
    return k


__all__ = ["MoonEPTokenDispatcher", "MoonEPGroupedExperts", "MoonEPStep", "use_moonep", "parallelize"]
