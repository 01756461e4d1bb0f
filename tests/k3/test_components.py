"""Each component against a naive formula implementation (fp32 unless noted), and the full tiny model."""

from __future__ import annotations

import math

import torch

from k3 import K3Config
from k3.attnres import AttnResQuery, attn_res_mix
from k3.balance import max_violation, qb_bias, qb_histogram
from k3.kda import KDALayer
from k3.layers import situ_glu
from k3.mla import GatedMLA
from k3.model import build_model, token_loss_sum
from k3.moe import LatentMoE
from k3.naive import moe_routed_naive
from k3.reference import kda_layer_naive, mla_naive, qb_exact

TINY = K3Config.preset("tiny")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: fp32 kernels vs formula twins agree to ~1e-6 (1e-5 leaves room for sums)."""
    return float((a - b).abs().max().detach() / b.abs().max().detach().clamp_min(1e-30))


def test_situ_glu_formula_and_bound():
    """Would catch swapped betas, a missing sigmoid, or SiLU in place of the tanh-bounded branches."""
    g, v = torch.randn(1000) * 50, torch.randn(1000) * 50
    ref = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(v / 25)
    assert rel(situ_glu(g, v), ref) < 1e-6
    assert situ_glu(g, v).abs().max() < 100
    small = torch.randn(100) * 1e-3
    swiglu = torch.nn.functional.silu(small) * small
    assert rel(situ_glu(small, small), swiglu) < 1e-3  # first-order equal to SwiGLU near 0


def test_attn_res_matches_loop_and_is_mean_at_init():
    """Would catch normalising the values (not only the keys), a softmax over d instead of depth, or a bias."""
    torch.manual_seed(0)
    srcs = [torch.randn(2, 5, 16) * (i + 1) for i in range(4)]
    q = AttnResQuery(16, 1e-5)
    assert rel(q(srcs[:-1], srcs[-1]), torch.stack(srcs).mean(0)) < 1e-6
    w, gamma = torch.randn(16), torch.rand(16) + 0.5
    out = attn_res_mix(srcs, w, gamma, 1e-5)
    ref = torch.zeros(2, 5, 16)
    for b in range(2):
        for t in range(5):
            s = [float((v[b, t] / math.sqrt(float(v[b, t].pow(2).mean()) + 1e-5) * gamma * w).sum()) for v in srcs]
            a = torch.softmax(torch.tensor(s), 0)
            ref[b, t] = sum(a[n] * srcs[n][b, t] for n in range(4))
    assert rel(out, ref) < 1e-5


def _grads(module, fn, x):
    x = x.clone().requires_grad_()
    module.zero_grad()
    y = fn(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_kda_layer_matches_naive_recurrence():
    """Chunked cp_kda path vs token loop: would catch a wrong gate, conv tap order, q scale or norm/gate order."""
    torch.manual_seed(0)
    layer = KDALayer(TINY)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer.reset_special(torch.Generator().manual_seed(1))
    x = torch.randn(2, 70, TINY.hidden_size)  # > one 64-token chunk
    y, gx, gp = _grads(layer, layer, x)
    y2, gx2, gp2 = _grads(layer, lambda u: kda_layer_naive(layer, u), x)
    assert rel(y, y2) < 1e-5 and rel(gx, gx2) < 1e-5
    for n in gp:
        assert rel(gp[n], gp2[n]) < 1e-4, n


def test_mla_matches_naive_and_has_no_position():
    """Would catch a causal-mask error, a wrong softmax scale, or any positional term (NoPE: shifting a
    prefix of identical tokens leaves outputs permutation-equivariant)."""
    torch.manual_seed(0)
    layer = GatedMLA(TINY)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 12, TINY.hidden_size)
    y, gx, gp = _grads(layer, layer, x)
    y2, gx2, gp2 = _grads(layer, lambda u: mla_naive(layer, u), x)
    assert rel(y, y2) < 1e-5 and rel(gx, gx2) < 1e-5
    for n in gp:
        assert rel(gp[n], gp2[n]) < 1e-4, n
    same = x[:, :1].expand(2, 6, -1)  # identical tokens: with no positions every output is identical
    out = layer(same)
    assert rel(out[:, 1:], out[:, :1].expand_as(out[:, 1:])) < 1e-5


def _moe_reference(moe: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """The Stable LatentMoE formula written out: router, latent, weighted sum, norm, up, shared."""
    s = torch.sigmoid(x @ moe.gate.weight.t())
    idx = torch.topk(s + moe.gate.e_score_correction_bias, moe.K, dim=-1).indices
    p = s.gather(1, idx)
    p = p / p.sum(-1, keepdim=True)
    u = moe_routed_naive(moe.routed_expert_down_proj(x), idx, p, moe.w1, moe.w3, moe.w2, moe.acts)
    u = u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + 1e-5) * moe.routed_expert_norm.weight
    return moe.routed_expert_up_proj(u) + moe.shared_experts(x)


def test_latent_moe_on_moonep_matches_formula(comm1):
    """moonep dispatch/combine + grouped SiTU-GLU (world size 1, the multi-rank code path) vs the formula;
    would catch weights applied twice, a norm per expert instead of on the sum, or the bias in the weights."""
    import moonep

    torch.manual_seed(0)
    moe = LatentMoE(TINY)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.gate.e_score_correction_bias.normal_(std=0.1)
    x = torch.randn(3, 7, TINY.hidden_size)
    ref, gx_ref, gp_ref = _grads(moe, lambda u: _moe_reference(moe, u.reshape(-1, u.shape[-1])).view_as(u), x)
    moe.attach(moonep.Buffer(comm1, S=21, H=TINY.routed_expert_hidden_size, K=moe.K, E=moe.E))
    out, gx, gp = _grads(moe, moe, x)
    moe.attach(None)
    assert rel(out, ref) < 1e-5 and rel(gx, gx_ref) < 1e-5
    for n in gp_ref:
        assert rel(gp[n], gp_ref[n]) < 1e-5, n


def test_quantile_balancing_histogram_vs_exact():
    """1000-bin estimate within ~one bin of the exact sorted quantile; would catch a wrong quantile side."""
    torch.manual_seed(0)
    E, K = 8, 2
    scores = torch.sigmoid(torch.randn(4000, E) + torch.linspace(-1, 1, E))  # skewed experts
    bias = torch.zeros(E)
    est = qb_bias(qb_histogram(scores, bias, K), bias, K)
    exact = qb_exact(scores, bias, K)
    assert float((est - exact).abs().max()) < 3 * 2 / 1000

    def load(b: torch.Tensor) -> torch.Tensor:
        return torch.bincount(torch.topk(scores + b, K, -1).indices.flatten(), minlength=E)[None]

    assert max_violation(load(est))[0] < 0.5 * max_violation(load(bias))[0]
    for _ in range(5):  # coordinate steps on the dual: a few iterations on the same batch nearly balance it
        est = qb_bias(qb_histogram(scores, est, K), est, K)
    assert max_violation(load(est))[0] < 0.05


def test_tiny_model_forward_backward_and_ep_independent_init():
    """Full tiny model: finite loss near ln(256) at init, every used parameter gets a gradient, and the
    expert init of rank 1 of 2 equals the matching slice of the EP=1 model."""
    torch.manual_seed(0)
    model = build_model(TINY, seed=3)
    tok = torch.randint(0, 256, (2, 33))
    loss = token_loss_sum(model, tok[:, :-1], tok[:, 1:]) / 64
    assert abs(float(loss.detach()) - math.log(256)) < 0.2
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == ["layers.0.attn_res.proj", "layers.0.attn_res.norm"]  # layer 0 reads the embedding only
    half = build_model(TINY, seed=3, ep_size=2, ep_rank=1)
    assert torch.equal(half.layers[1].mlp.w2, model.layers[1].mlp.w2[4:])
    assert torch.equal(half.layers[1].mlp.gate.weight, model.layers[1].mlp.gate.weight)


def test_meta_model_allocates_nothing():
    from k3.model import K3Model

    model = K3Model(K3Config.preset("full"), device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert all(moe.buffer is None for moe in model.moe_layers())  # no EP group touched
