"""Naive twins of k3's fast paths, for tests: host-side Python and per-item loops, written to be read.

``qb_histogram_host`` and ``qb_bias_loop`` are Quantile Balancing (``k3.balance``) as it was before it moved
onto the device: the range read back as Python floats, ``bincount``, and one expert at a time. The device
versions must equal them bit for bit on CPU (tests/k3/test_balance_device.py).

``attn_res_mix_autograd`` is the AttnRes mix (``k3.attnres``) as it was before it got its own backward: the
formula on fp32 stacks of the sources, differentiated by autograd (tests/k3/test_saved_memory.py holds the
hand-written backward to it).

``newton_schulz_loop``, ``orthogonalize_loop``, ``PerHeadMuonLoop`` and ``param_groups_by_name`` are Per-Head
Muon (``k3.muon``) as it was before Newton-Schulz was batched over blocks and sharded over data-parallel ranks:
one NS5 per head block in a Python loop (chunk / cat / stack), every rank orthogonalising every block, and the
Muon/AdamW split chosen by parameter-name strings. tests/k3/test_muon.py holds the batched, sharded optimizer to
them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from k3.kda import KDALayer, l2_normalize
from k3.mla import GatedMLA
from k3.muon import PerHeadMuon


def qb_histogram_host(scores: torch.Tensor, bias: torch.Tensor, K: int, nb: int) -> torch.Tensor:
    """scores [m, E], bias [E] -> int64 counts [E, nb] of r_ij = alpha_i - s_ij over [min b - 1, max b + 1]."""
    E = scores.shape[1]
    alpha = torch.topk(scores + bias, K + 1, dim=-1).values[:, -1:]  # [m, 1] the token's cutoff
    r = (alpha - scores).double()
    lo, hi = float(bias.min()) - 1.0, float(bias.max()) + 1.0
    idx = ((r - lo) / (hi - lo) * nb).floor().long().clamp_(0, nb - 1)
    flat = idx + torch.arange(E, device=idx.device)[None, :] * nb
    return torch.bincount(flat.flatten(), minlength=E * nb).view(E, nb)


def qb_bias_loop(hist: torch.Tensor, bias: torch.Tensor, K: int) -> torch.Tensor:
    """Histogram [E, nb] and the bias it was built with [E] -> the next, mean-centred bias [E]; expert by expert.

    The quantile of expert j is linearly interpolated inside the first bin whose cumulative count reaches the
    rank ceil(m K / E) (m = the tokens counted in row 0); an empty bin counts as 1, a rank past the end uses
    the last bin.
    """
    E, nb = hist.shape
    lo, hi = float(bias.min()) - 1.0, float(bias.max()) + 1.0
    width = (hi - lo) / nb
    m = int(hist[0].sum())
    target = math.ceil(m * K / E)
    cum = hist.cumsum(-1)
    b_hat = torch.empty(E, dtype=torch.float64, device=hist.device)
    for j in range(E):
        b = int(torch.searchsorted(cum[j], torch.tensor(target, device=cum.device)))  # first bin reaching the rank
        b = min(b, nb - 1)
        before = int(cum[j, b - 1]) if b > 0 else 0
        inside = max(int(hist[j, b]), 1)
        b_hat[j] = lo + width * (b + (target - before) / inside)
    return (b_hat - b_hat.mean()).to(bias.dtype)


NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz_loop(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximate orthogonal polar factor of ONE matrix G [r, c] by the quintic Newton-Schulz iteration (fp32)."""
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


def orthogonalize_loop(U: torch.Tensor, heads: int, axis: int) -> torch.Tensor:
    """NS5 of U per block, one block at a time: ``heads`` equal blocks along ``axis`` (0 rows, 1 columns);
    U [E, r, c] = one block per expert. Each block is scaled by 0.2 sqrt(max(rows, cols))."""
    if U.dim() == 3:
        return torch.stack([orthogonalize_loop(u, 1, 0) for u in U])
    blocks = U.chunk(heads, dim=axis)
    out = [newton_schulz_loop(b) * 0.2 * max(b.shape) ** 0.5 for b in blocks]
    return torch.cat(out, dim=axis)


class PerHeadMuonLoop(PerHeadMuon):
    """The optimizer stepping parameter by parameter and head by head: no batching, no sharding (a ``comm`` is
    ignored, so every rank orthogonalises every block). AdamW is the shared, unchanged ``PerHeadMuon._adamw``."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if group["kind"] == "muon":
                    self._muon_loop(p, group, group["heads"][i], group["axis"][i])
                else:
                    self._adamw(p, group)

    def _muon_loop(self, p, group, heads: int, axis: int) -> None:
        st = self.state[p]
        if "momentum" not in st:
            st["momentum"] = torch.zeros_like(p, dtype=torch.float32)
        m, mu = st["momentum"], group["momentum"]
        g = p.grad.float()
        m.mul_(mu).add_(g)
        update = orthogonalize_loop(g + mu * m, heads, axis)
        p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update.to(p.dtype), alpha=-group["lr"])


def param_groups_by_name(model) -> list[dict]:
    """The Muon/AdamW split by name strings: every >= 2-D parameter is Muon unless its name contains
    ``embed_tokens``, ``lm_head``, ``gate.weight`` or ``conv1d``; head splits from the attention modules."""
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


__all__ = [
    "qb_histogram_host",
    "qb_bias_loop",
    "newton_schulz_loop",
    "orthogonalize_loop",
    "PerHeadMuonLoop",
    "param_groups_by_name",
]


def qb_exact(scores: torch.Tensor, bias: torch.Tensor, K: int) -> torch.Tensor:
    """Exact single-process twin: sorted-quantile version of the same update (for tests). -> [E]."""
    alpha = torch.topk(scores + bias, K + 1, dim=-1).values[:, -1:]
    r = (alpha - scores).double()
    m, E = r.shape
    target = math.ceil(m * K / E)
    b_hat = r.sort(0).values[target - 1]
    return (b_hat - b_hat.mean()).to(bias.dtype)


def kda_layer_naive(layer: KDALayer, x: torch.Tensor) -> torch.Tensor:
    """Formula twin of ``KDALayer.forward``: explicit conv loop, gate formula and the token recurrence."""
    B, T, _ = x.shape
    h, K = layer.h, layer.K

    def conv(u, w):  # u [B, T, D], w [D, W]: y_t = silu(sum_j w[:, j] u_{t-W+1+j})
        W = w.shape[1]
        pad = torch.cat([u.new_zeros(B, W - 1, u.shape[2]), u], dim=1)
        return F.silu(sum(pad[:, j : j + T] * w[:, j] for j in range(W)))

    q = l2_normalize(conv(layer.q_proj(x), layer.q_conv1d).view(B, T, h, K)) * K**-0.5
    k = l2_normalize(conv(layer.k_proj(x), layer.k_conv1d).view(B, T, h, K))
    v = conv(layer.v_proj(x), layer.v_conv1d).view(B, T, h, K)
    f = layer.f_b_proj(layer.f_a_proj(x)).view(B, T, h, K) + layer.dt_bias.view(h, K)
    g = layer.lower_bound * torch.sigmoid(layer.A_log.exp()[:, None] * f)
    beta = torch.sigmoid(layer.b_proj(x))
    S = x.new_zeros(B, h, K, K)
    outs = []
    for t in range(T):
        S = torch.exp(g[:, t])[..., None] * S  # decay along the key axis
        kt, vt, bt = k[:, t], v[:, t], beta[:, t][..., None]
        S = S + bt[..., None] * kt[..., None] * (vt - torch.einsum("bhkv,bhk->bhv", S, kt))[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, dim=1)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.eps) * layer.o_norm
    return layer.o_proj(o.reshape(B, T, -1) * torch.sigmoid(layer.g_proj(x)))


def mla_naive(layer: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """Formula twin: per-head explicit masked softmax in fp32 over the same projections."""
    B, T, _ = x.shape
    q, k, v = layer.qkv(x)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    outs = []
    for hd in range(layer.h):
        s = torch.einsum("btc,bsc->bts", q[:, hd].float(), k[:, hd].float()) / (layer.n + layer.r) ** 0.5
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        outs.append(torch.einsum("bts,bsc->btc", p, v[:, hd].float()))
    o = torch.cat(outs, dim=-1).to(x.dtype)
    return layer.o_proj(o * torch.sigmoid(layer.g_proj(x)))


def attn_res_mix_autograd(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor, eps: float):
    """Formula twin of ``k3.attnres.attn_res_mix``: fp32 stacks [N+1, ..., d], autograd's backward."""
    v = torch.stack([s.float() for s in sources], dim=0)
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    alpha = torch.softmax((k * (gain.float() * query.float())).sum(-1), dim=0)
    return (alpha.unsqueeze(-1) * v).sum(0).to(sources[-1].dtype)
