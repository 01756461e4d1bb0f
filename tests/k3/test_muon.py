"""Per-Head Muon and QK-Clip against their definitions."""
from __future__ import annotations

import torch

from k3 import K3Config
from k3.mla import GatedMLA
from k3.model import build_model
from k3.muon import PerHeadMuon, clip_head, newton_schulz, orthogonalize, param_groups


def test_newton_schulz_is_near_orthogonal():
    """NS5 pushes every singular value into roughly [0.7, 1.2] (the quintic's design band)."""
    torch.manual_seed(0)
    for shape in ((16, 48), (48, 16)):
        s = torch.linalg.svdvals(newton_schulz(torch.randn(*shape)))
        assert 0.6 < float(s.min()) and float(s.max()) < 1.25


def test_per_head_blocks_are_independent():
    """Each head block's update depends only on that block: would catch whole-matrix orthogonalisation."""
    torch.manual_seed(0)
    U = torch.randn(4 * 8, 32)
    O = orthogonalize(U, 4, 0)
    U2 = U.clone()
    U2[:8] *= 100.0                                   # a head with a huge momentum
    O2 = orthogonalize(U2, 4, 0)
    assert torch.allclose(O[8:], O2[8:], atol=1e-5)  # the other heads are unaffected
    assert torch.allclose(O[:8], O2[:8], atol=1e-4)  # NS is scale-invariant per block
    cols = orthogonalize(U.t().contiguous(), 4, 1)   # output projections split along input columns
    assert torch.allclose(cols, O.t(), atol=1e-5)


def test_groups_put_embeddings_router_norms_on_adamw():
    model = build_model(K3Config.preset("tiny"), seed=0)
    muon, adamw = param_groups(model)
    ids = {id(p) for p in adamw["params"]}
    for p in (model.embed_tokens.weight, model.lm_head.weight, model.layers[1].mlp.gate.weight,
              model.layers[1].attn_res.proj, model.norm.weight, model.layers[1].self_attn.A_log):
        assert id(p) in ids
    assert all(p.dim() >= 2 for p in muon["params"])
    assert id(model.layers[1].mlp.w1) in {id(p) for p in muon["params"]}


def test_optimizer_step_changes_params_and_follows_rms_rule():
    """A Muon step moves a [r, c] matrix by lr * 0.2 sqrt(max(r, c)) * (an orthogonal-ish factor)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 64))
    opt = PerHeadMuon([{"params": [w], "kind": "muon", "heads": [1], "axis": [0]}], lr=0.1, weight_decay=0.0)
    w.grad = torch.randn(16, 64)
    before = w.detach().clone()
    opt.step()
    rms = float((w.detach() - before).pow(2).mean().sqrt())
    expected = 0.1 * 0.2 * 8 * (16 / (16 * 64)) ** 0.5   # singular values ~1 over min(r, c) directions
    assert 0.5 * expected < rms < 1.5 * expected


def test_qk_clip_scales_head_logits_by_gamma():
    """Clipping head h by gamma multiplies exactly its logits by gamma (q_nope.k_nope by sqrt*sqrt, q_rope.k_rope
    by gamma*1) and leaves other heads unchanged."""
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny")
    layer = GatedMLA(cfg)
    x = torch.randn(1, 6, cfg.hidden_size)
    q, k, _ = layer.qkv(x)
    before = q @ k.transpose(-1, -2)
    with torch.no_grad():
        clip_head(layer, 1, 0.25)
    q, k, _ = layer.qkv(x)
    after = q @ k.transpose(-1, -2)
    assert torch.allclose(after[:, 1], 0.25 * before[:, 1], rtol=1e-4, atol=1e-6)
    assert torch.allclose(after[:, 0], before[:, 0])
