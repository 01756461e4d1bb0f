"""Per-Head Muon with QK-Clip (k3_architecture.md 2.8), AdamW for the rest, as one ``torch.optim.Optimizer``.

    M <- mu M + G;  U = G + mu M (Nesterov);  O = NS5(U) per block;  W <- W (1 - lr wd) - lr 0.2 sqrt(max(r, c)) O

Blocks: head-structured attention matrices are split per head (Q/K/V/gate-like projections along their output
rows, output projections along their input columns, as inferred in the reference), routed experts per expert
([epn, ...] tensors), every other 2-D matrix whole. Embeddings, LM head, norms, router, biases, AttnRes queries,
conv taps, A_log and dt_bias use AdamW. The update of each block depends only on that block's (already summed)
gradient, so the optimizer gives identical results on one rank or many (DP grads summed first, experts local).

QK-Clip (K2): after the step, for each MLA head whose max pre-softmax logit S_h over the global batch exceeds
tau, gamma = tau / S_h scales that head's q_nope and k_nope rows by sqrt(gamma) and its q_rope rows by gamma;
the shared k_rope slice is untouched.
"""
from __future__ import annotations

import torch

NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximate orthogonal polar factor of G [r, c] by the quintic Newton-Schulz iteration (fp32)."""
    a, b, c = NS_COEFFS
    X = G.float()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.t()
    X = X / (X.norm() + eps)
    for _ in range(steps):
        A = X @ X.t()
        X = a * X + (b * A + c * A @ A) @ X
    return X.t() if tall else X


def orthogonalize(U: torch.Tensor, heads: int, axis: int) -> torch.Tensor:
    """NS5 of U per block: ``heads`` equal blocks along ``axis`` (0 rows, 1 columns); 3-D = one per expert.

    Each block is scaled by 0.2 sqrt(max(rows, cols)) so its update RMS matches AdamW's (K2 / Moonlight rule).
    """
    if U.dim() == 3:
        return torch.stack([orthogonalize(u, 1, 0) for u in U])
    blocks = U.chunk(heads, dim=axis)
    out = [newton_schulz(b) * 0.2 * max(b.shape) ** 0.5 for b in blocks]
    return torch.cat(out, dim=axis)


class PerHeadMuon(torch.optim.Optimizer):
    """Param groups carry ``kind`` ("muon" | "adamw"); muon params carry ``heads`` and ``axis`` per param."""

    def __init__(self, groups, *, lr: float, momentum: float = 0.95, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1) -> None:
        super().__init__(groups, dict(lr=lr, momentum=momentum, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if group["kind"] == "muon":
                    self._muon(p, group, group["heads"][i], group["axis"][i])
                else:
                    self._adamw(p, group)

    def _muon(self, p, group, heads: int, axis: int) -> None:
        st = self.state[p]
        if "momentum" not in st:
            st["momentum"] = torch.zeros_like(p, dtype=torch.float32)
        m, mu = st["momentum"], group["momentum"]
        g = p.grad.float()
        m.mul_(mu).add_(g)
        update = orthogonalize(g + mu * m, heads, axis)
        p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update.to(p.dtype), alpha=-group["lr"])

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
        denom = (st["exp_avg_sq"] / (1 - b2 ** t)).sqrt() + group["eps"]
        p.add_((st["exp_avg"] / (1 - b1 ** t)) / denom, alpha=-group["lr"])

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
                st = {k[len(prefix):]: v.to(p.device if v.dim() else v.device, copy=True)
                      for k, v in tensors.items() if k.startswith(prefix)}
                if st:
                    self.state[p] = st


def param_groups(model) -> list[dict]:
    """Split a ``K3Model``'s parameters into a Muon group (with per-param head splits) and an AdamW group."""
    from .kda import KDALayer
    from .mla import GatedMLA

    split: dict[int, tuple[int, int]] = {}
    for module in model.modules():
        if isinstance(module, KDALayer):
            for lin in (module.q_proj, module.k_proj, module.v_proj, module.g_proj, module.f_b_proj):
                split[id(lin.weight)] = (module.h, 0)
            split[id(module.o_proj.weight)] = (module.h, 1)
        elif isinstance(module, GatedMLA):
            for lin in (module.q_b_proj, module.kv_b_proj, module.g_proj):
                split[id(lin.weight)] = (module.h, 0)
            split[id(module.o_proj.weight)] = (module.h, 1)
    adamw_names = ("embed_tokens", "lm_head", "gate.weight")
    muon, heads, axes, adamw = [], [], [], []
    for name, p in model.named_parameters():
        if p.dim() >= 2 and not any(a in name for a in adamw_names) and "conv1d" not in name:
            h, ax = split.get(id(p), (1, 0))
            muon.append(p), heads.append(h), axes.append(ax)
        else:
            adamw.append(p)
    return [{"params": muon, "kind": "muon", "heads": heads, "axis": axes}, {"params": adamw, "kind": "adamw"}]


@torch.no_grad()
def qk_clip(model, comm, tau: float) -> list[float]:
    """Rescale MLA heads whose global max logit (from the last forward, ``track_logits``) exceeds tau.

    One all-reduce (max) over all MLA layers; returns the max logit of each layer.
    """
    from .mla import GatedMLA

    layers = [m for m in model.modules() if isinstance(m, GatedMLA) and m.last_max_logit is not None]
    if not layers:
        return []
    logits = torch.stack([m.last_max_logit.float() for m in layers])            # [n_mla, h]
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
    q = m.q_b_proj.weight[h * qd:(h + 1) * qd]
    q[:m.n].mul_(gamma ** 0.5)
    q[m.n:].mul_(gamma)
    m.kv_b_proj.weight[h * kd:h * kd + m.n].mul_(gamma ** 0.5)


__all__ = ["PerHeadMuon", "param_groups", "qk_clip", "clip_head", "newton_schulz", "orthogonalize"]
