"""Per-Head Muon with QK-Clip (k3_architecture.md 2.8), AdamW for the rest, as one ``torch.optim.Optimizer``.

    M <- mu M + G;  U = G + mu M (Nesterov);  O = NS5(U) per block;  W <- W (1 - lr wd) - lr 0.2 sqrt(max(r, c)) O

Blocks: head-structured attention matrices are split per head (Q/K/V/gate-like projections along their output
rows, output projections along their input columns, as inferred in the reference), routed experts per expert
([epn, ...] tensors), every other 2-D matrix whole. The split is chosen by module type (``param_groups``): every
``nn.Linear`` weight but the LM head and the routed experts of ``LatentMoE`` are Muon; embeddings, LM head,
norms, router, biases, AttnRes queries, conv taps, A_log and dt_bias use AdamW.

One step orthogonalises all blocks at once, as nanochat and modded-nanogpt do: blocks of one shape (the heads of
one matrix and same-shape blocks of other parameters) are stacked into one [B, rows, cols] tensor and NS5 runs
batched. With a communicator of world size W > 1 the blocks of replicated parameters are split over the ranks:
rank r orthogonalises its 1/W of every stack (padded with zero blocks to a multiple of W; NS5(0) = 0) and ONE
all-gather returns the rest. Routed experts are already split by EP (each rank holds different ones), so their
owner orthogonalises them locally. The trainer sums the DP grads with one all-reduce before the step
(``k3.parallelize.DataParallel.sync_grads``), so every rank holds the same summed gradient and keeps the full
momentum; only Newton-Schulz, the expensive part, is divided. Each block's update still depends only on that
block, so one rank or many give the same numbers.

QK-Clip (K2): after the step, for each MLA head whose max pre-softmax logit S_h over the global batch exceeds
tau, gamma = tau / S_h scales that head's q_nope and k_nope rows by sqrt(gamma) and its q_rope rows by gamma;
the shared k_rope slice is untouched.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from k3.kda import KDALayer
from k3.mla import GatedMLA
from k3.moe import LatentMoE

if TYPE_CHECKING:
    from collectives.base import Communicator

NS_COEFFS = (3.4445, -4.7750, 2.0315)
CPU_STACK_ELEMS = 1 << 18
"""Elements per batched NS5 call on CPU (1 MiB of fp32): a larger stack runs in slices of this size so that each
slice's temporaries stay in cache (with whole stacks the small preset's step took 1.3x longer); other devices
take the stack whole."""


def newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximate orthogonal polar factor of G [r, c], or of every matrix of G [B, r, c] at once, by the quintic
    Newton-Schulz iteration (fp32); each matrix is normalised by its own Frobenius norm."""
    if G.dim() == 2:
        return newton_schulz(G[None], steps, eps)[0]
    a, b, c = NS_COEFFS
    X = G.float()
    tall = X.shape[-2] > X.shape[-1]
    if tall:  # iterate on the wide side: X X^T is then the smaller Gram matrix
        X = X.mT
    X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = X @ X.mT  # [B, r, r]
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A A, fused (fewer temporaries)
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    return X.mT if tall else X


def _ns_stack(X: torch.Tensor) -> torch.Tensor:
    """NS5 of X [B, r, c] scaled by 0.2 sqrt(max(r, c)) (K2 / Moonlight: the update RMS then matches AdamW's)."""
    n = max(1, CPU_STACK_ELEMS // (X.shape[1] * X.shape[2])) if X.device.type == "cpu" else X.shape[0]
    parts = [newton_schulz(x) for x in X.split(n)]  # cache blocking: one slice on a GPU
    return (parts[0] if len(parts) == 1 else torch.cat(parts)) * (0.2 * max(X.shape[1:]) ** 0.5)


def head_blocks(U: torch.Tensor, heads: int, axis: int) -> torch.Tensor:
    """U [r, c] -> blocks [heads, r / heads, c] (axis 0, rows) or [heads, r, c / heads] (axis 1, columns), as
    views; U [E, r, c] (routed experts) is already one block per expert."""
    if U.dim() == 3:
        return U
    r, c = U.shape
    if axis == 0:
        return U.view(heads, r // heads, c)
    return U.view(r, heads, c // heads).transpose(0, 1)


def from_blocks(O: torch.Tensor, shape: torch.Size, axis: int) -> torch.Tensor:
    """Inverse of ``head_blocks``: blocks [heads, rows, cols] back to a tensor of ``shape``."""
    if len(shape) == 3:
        return O
    return O.reshape(shape) if axis == 0 else O.transpose(0, 1).reshape(shape)


def orthogonalize(U: torch.Tensor, heads: int, axis: int) -> torch.Tensor:
    """NS5 of U per block (``head_blocks``), all blocks in one batched call, each block scaled by
    0.2 sqrt(max(rows, cols)) so its update RMS matches AdamW's (K2 / Moonlight rule). One parameter's
    ``orthogonalize_all``: the same numbers as inside the optimizer."""
    return orthogonalize_all([(U, heads, axis, False)])[0][0]


def _stacks(items) -> dict[tuple[int, int, bool], list[tuple[int, torch.Tensor]]]:
    """Group the blocks of ``items`` by (rows, cols, replicated): {key: [(item index, blocks [n, rows, cols])]}.

    In item order, so every rank holding the same replicated parameters builds the same stacks in the same order.
    Tall and wide blocks stay apart although NS5(X^T) = NS5(X)^T: merging them would save few calls (13 -> 10
    stacks on tiny) and a transposed copy would add its own rounding.
    """
    stacks: dict[tuple[int, int, bool], list[tuple[int, torch.Tensor]]] = {}
    for i, (U, heads, axis, replicated) in enumerate(items):
        B = head_blocks(U, heads, axis)
        stacks.setdefault((B.shape[-2], B.shape[-1], bool(replicated)), []).append((i, B))
    return stacks


def _share(X: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s ceil(B / W) blocks of X [B, r, c], zero-padded at the end: [ceil(B / W), r, c]."""
    per = math.ceil(X.shape[0] / world)
    mine = X[rank * per : (rank + 1) * per]
    if mine.shape[0] == per:
        return mine
    pad = X.new_zeros((per - mine.shape[0], *X.shape[1:]))
    return torch.cat([mine, pad])


def _all_gather_shares(shares: list[torch.Tensor], comm: Communicator) -> list[torch.Tensor]:
    """Every rank's ``shares`` (one [per_k, r_k, c_k] per stack k, the same shapes on every rank) -> the stacks
    [W * per_k, r_k, c_k] in rank order, with ONE all-gather of the flattened shares."""
    flat = torch.cat([s.reshape(-1) for s in shares])
    out = flat.new_empty((comm.world_size, flat.numel()))
    comm.all_gather(out, flat.view(1, -1))
    stacks, offset = [], 0
    for s in shares:
        n = s.numel()
        stacks.append(out[:, offset : offset + n].reshape(comm.world_size * s.shape[0], *s.shape[1:]))
        offset += n
    return stacks


def orthogonalize_all(items, comm: Communicator | None = None) -> tuple[list[torch.Tensor], int]:
    """``orthogonalize`` of many updates at once: items are (U, heads, axis, replicated), U [r, c] or [E, r, c].

    Same-shape blocks run as one batched NS5. With ``comm`` (world size W > 1) replicated items must be equal on
    every rank: each rank orthogonalises 1/W of every replicated stack and one all-gather shares the results;
    other items stay on their rank. Returns (the orthogonalised updates in item order, blocks this rank ran).
    """
    world = comm.world_size if comm is not None else 1
    stacks = _stacks(items)
    results: dict[tuple[int, int, bool], torch.Tensor] = {}
    sharded, shares, ran = [], [], 0
    for key, members in stacks.items():
        X = torch.cat([B for _, B in members])  # [B, rows, cols]
        split = key[2] and world > 1
        if split:
            X = _share(X, comm.rank, world)
        O = _ns_stack(X)
        ran += O.shape[0]
        if split:
            sharded.append(key), shares.append(O)
        else:
            results[key] = O
    if shares:
        results.update(zip(sharded, _all_gather_shares(shares, comm)))
    out: list[torch.Tensor] = [torch.empty(0)] * len(items)
    for key, members in stacks.items():
        offset = 0
        for i, B in members:
            out[i] = from_blocks(results[key][offset : offset + B.shape[0]], items[i][0].shape, items[i][2])
            offset += B.shape[0]
    return out, ran


class PerHeadMuon(torch.optim.Optimizer):
    """Param groups carry ``kind`` ("muon" | "adamw"); muon groups carry per-param lists ``heads`` and ``axis``
    (``head_blocks``) and optionally ``replicated`` (default all True: the same gradient on every rank of
    ``comm``; False for rank-local parameters such as EP experts). ``comm``: a ``collectives.Communicator`` over
    the ranks that hold the replicated parameters (None or world size 1: everything runs locally)."""

    def __init__(
        self,
        groups,
        *,
        lr: float,
        momentum: float = 0.95,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        comm: Communicator | None = None,
    ) -> None:
        super().__init__(
            groups, {"lr": lr, "momentum": momentum, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        self.comm = comm
        self.ns_blocks = 0
        """Blocks this rank ran through Newton-Schulz in the last step (padding included)."""

    @torch.no_grad()
    def step(self, closure=None):
        muon = []  # (param, group, U, heads, axis, replicated)
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if group["kind"] == "muon":
                    rep = group["replicated"][i] if "replicated" in group else True
                    muon.append((p, group, self._nesterov(p, group), group["heads"][i], group["axis"][i], rep))
                else:
                    self._adamw(p, group)
        updates, self.ns_blocks = orthogonalize_all([item[2:] for item in muon], self.comm)
        for (p, group, *_), update in zip(muon, updates):
            p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update.to(p.dtype), alpha=-group["lr"])

    def _nesterov(self, p, group) -> torch.Tensor:
        """Momentum update M <- mu M + G; returns U = G + mu M (fp32, the shape of p)."""
        st = self.state[p]
        if "momentum" not in st:
            st["momentum"] = torch.zeros_like(p, dtype=torch.float32)
        m, mu = st["momentum"], group["momentum"]
        g = p.grad.float()
        m.mul_(mu).add_(g)
        return g + mu * m

    def _adamw(self, p, group) -> None:
        st = self.state[p]
        if "exp_avg" not in st:
            st["step"] = torch.zeros((), dtype=torch.float64)
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        (b1, b2), g = group["betas"], p.grad.float()
        st["step"] += 1
        t = float(st["step"])
        st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
        st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        if p.dim() >= 2:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        denom = (st["exp_avg_sq"] / (1 - b2**t)).sqrt() + group["eps"]
        p.add_((st["exp_avg"] / (1 - b1**t)) / denom, alpha=-group["lr"])

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    # state as flat named tensors (safetensors checkpoints; nothing pickled)
    def state_tensors(self, names: dict[int, str]) -> dict[str, torch.Tensor]:
        return {f"{names[id(p)]}.{k}": v for p, st in self.state.items() for k, v in st.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], names: dict[int, str]) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                prefix = names[id(p)] + "."
                # tensors follow their parameter's device; the 0-dim AdamW step count stays a host scalar
                st = {
                    k[len(prefix) :]: v.to(p.device if v.dim() else v.device, copy=True)
                    for k, v in tensors.items()
                    if k.startswith(prefix)
                }
                if st:
                    self.state[p] = st


def _head_splits(model) -> dict[int, tuple[int, int]]:
    """id(weight) -> (heads, axis) of the head-structured attention projections (``head_blocks``)."""
    split: dict[int, tuple[int, int]] = {}
    for module in model.modules():
        if isinstance(module, KDALayer):
            rows = (module.q_proj, module.k_proj, module.v_proj, module.g_proj, module.f_b_proj)
        elif isinstance(module, GatedMLA):
            rows = (module.q_b_proj, module.kv_b_proj, module.g_proj)
        else:
            continue
        split.update({id(lin.weight): (module.h, 0) for lin in rows})
        split[id(module.o_proj.weight)] = (module.h, 1)
    return split


def param_groups(model) -> list[dict]:
    """A ``K3Model``'s parameters by module type -> [Muon group, AdamW group], in ``named_parameters`` order.

    Muon: every ``nn.Linear`` weight except the LM head (split per head where ``_head_splits`` says, else whole)
    and ``LatentMoE``'s routed experts w1/w2/w3 (one block per expert; ``replicated=False``: under EP each rank
    holds different experts). AdamW: everything else, i.e. the embedding, the LM head (its rows are per-token
    classifiers, not a map between hidden spaces: Muon practice keeps it on AdamW), and every parameter a module
    owns directly: norms, the router weight, AttnRes queries, KDA conv taps, A_log, dt_bias, o_norm.
    """
    split, head = _head_splits(model), getattr(model, "lm_head", None)
    muon: dict = {"params": [], "kind": "muon", "heads": [], "axis": [], "replicated": []}
    adamw: dict = {"params": [], "kind": "adamw"}
    seen: set[int] = set()
    for module in model.modules():
        experts = {id(module.w1), id(module.w2), id(module.w3)} if isinstance(module, LatentMoE) else set()
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # a tied parameter is stepped once
                continue
            seen.add(id(p))
            matrix = isinstance(module, nn.Linear) and name == "weight" and module is not head
            if matrix or id(p) in experts:
                h, ax = split.get(id(p), (1, 0))
                muon["params"].append(p), muon["heads"].append(h), muon["axis"].append(ax)
                muon["replicated"].append(id(p) not in experts)
            else:
                adamw["params"].append(p)
    return [muon, adamw]


@torch.no_grad()
def qk_clip(model, comm: Communicator | None, tau: float) -> list[float]:
    """Rescale MLA heads whose global max logit (from the last forward, ``track_logits``) exceeds tau.

    One all-reduce (max) over all MLA layers; returns the max logit of each layer.
    """
    layers = [m for m in model.modules() if isinstance(m, GatedMLA) and m.last_max_logit is not None]
    if not layers:
        return []
    logits = torch.stack([m.last_max_logit.float() for m in layers])  # [n_mla, h]
    if comm is not None and comm.world_size > 1:
        comm.all_reduce(logits, op="max")
    for m, s in zip(layers, logits):
        for h in torch.nonzero(s > tau).flatten().tolist():
            gamma = tau / float(s[h])
            clip_head(m, h, gamma)
    return logits.amax(-1).tolist()


def clip_head(m, h: int, gamma: float) -> None:
    """Scale head h of an MLA layer: q_nope and k_nope rows by sqrt(gamma), q_rope rows by gamma."""
    qd, kd = m.n + m.r, m.n + m.v
    q = m.q_b_proj.weight[h * qd : (h + 1) * qd]
    q[: m.n].mul_(gamma**0.5)
    q[m.n :].mul_(gamma)
    m.kv_b_proj.weight[h * kd : h * kd + m.n].mul_(gamma**0.5)


__all__ = [
    "PerHeadMuon",
    "param_groups",
    "qk_clip",
    "clip_head",
    "newton_schulz",
    "orthogonalize",
    "orthogonalize_all",
    "head_blocks",
    "from_blocks",
]
