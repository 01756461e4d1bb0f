"""Per-Head Muon and QK-Clip against their definitions, and the batched / sharded optimizer against its loop twin.

Tolerance against the twin (``k3.reference``, the per-block loop): max |new - twin| <= TWIN_TOL * max |twin|,
fp32. The two differ only in rounding: the batched NS5 fuses ``b A + c A A`` and ``a X + B X`` into ``baddbmm``
and takes each block's Frobenius norm over a contiguous copy (the twin reduces strided column views in another
order); measured worst case about 6e-7 relative on an update. The sharded optimizer must equal the unsharded one
exactly: it runs the same batched NS5 on a subset of each stack.
"""

from __future__ import annotations

import copy
import zlib

import pytest
import torch

from collectives import launch
from k3 import K3Config
from k3.mla import GatedMLA
from k3.model import build_model
from k3.muon import PerHeadMuon, clip_head, newton_schulz, orthogonalize, orthogonalize_all, param_groups
from k3.reference import PerHeadMuonLoop, newton_schulz_loop, orthogonalize_loop, param_groups_by_name

TWIN_TOL = 1e-5
"""Relative to the largest entry: ~15x the worst difference measured (fused GEMMs, norm order), far below a bug."""


def _rel_err(new: torch.Tensor, ref: torch.Tensor) -> float:
    return float((new - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _seeded_grads(model, step: int, rank: int) -> None:
    """Grads drawn per parameter name and step; routed experts (``.w1/.w2/.w3``) also per rank (EP-local)."""
    for name, p in model.named_parameters():
        local = name.endswith((".w1", ".w2", ".w3"))
        seed = zlib.crc32(name.encode()) + 1000 * step + (100_000 * rank if local else 0)
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))


def _step_three(opt, model, rank: int = 0) -> None:
    for step in range(3):
        _seeded_grads(model, step, rank)
        opt.step()


def test_newton_schulz_is_near_orthogonal():
    """NS5 pushes every singular value into roughly [0.7, 1.2] (the quintic's design band)."""
    torch.manual_seed(0)
    for shape in ((16, 48), (48, 16)):
        s = torch.linalg.svdvals(newton_schulz(torch.randn(*shape)))
        assert float(s.min()) > 0.6 and float(s.max()) < 1.25


def test_per_head_blocks_are_independent():
    """Each head block's update depends only on that block: would catch whole-matrix orthogonalisation."""
    torch.manual_seed(0)
    U = torch.randn(4 * 8, 32)
    O = orthogonalize(U, 4, 0)
    U2 = U.clone()
    U2[:8] *= 100.0  # a head with a huge momentum
    O2 = orthogonalize(U2, 4, 0)
    assert torch.allclose(O[8:], O2[8:], atol=1e-5)  # the other heads are unaffected
    assert torch.allclose(O[:8], O2[:8], atol=1e-4)  # NS is scale-invariant per block
    cols = orthogonalize(U.t().contiguous(), 4, 1)  # output projections split along input columns
    assert torch.allclose(cols, O.t(), atol=1e-5)


def test_groups_put_embeddings_router_norms_on_adamw():
    model = build_model(K3Config.preset("tiny"), seed=0)
    muon, adamw = param_groups(model)
    ids = {id(p) for p in adamw["params"]}
    for p in (
        model.embed_tokens.weight,
        model.lm_head.weight,
        model.layers[1].mlp.gate.weight,
        model.layers[1].attn_res.proj,
        model.norm.weight,
        model.layers[1].self_attn.A_log,
    ):
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
    expected = 0.1 * 0.2 * 8 * (16 / (16 * 64)) ** 0.5  # singular values ~1 over min(r, c) directions
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


def test_batched_newton_schulz_equals_per_matrix_loop():
    """NS5 over a leading block dim gives each matrix's own NS5 (wide, tall and square): would catch a norm
    taken over the whole stack instead of per block, or a transpose of the wrong dims."""
    torch.manual_seed(0)
    for shape in ((6, 16, 64), (5, 64, 16), (3, 32, 32)):
        G = torch.randn(*shape)
        assert _rel_err(newton_schulz(G), torch.stack([newton_schulz_loop(g) for g in G])) <= TWIN_TOL


def test_orthogonalize_all_equals_per_block_loop():
    """Mixed items (row and column head splits, whole matrices, experts, shapes shared across items) through
    the stacked path give the loop twin's updates, in item order."""
    torch.manual_seed(0)
    items = [
        (torch.randn(32, 64), 2, 0, True),
        (torch.randn(64, 32), 2, 1, True),
        (torch.randn(16, 64), 1, 0, True),
        (torch.randn(4, 16, 64), 1, 0, False),
        (torch.randn(64, 16), 1, 0, True),
        (torch.randn(48, 8), 3, 0, True),
    ]
    out, ran = orthogonalize_all(items)
    assert ran == 2 + 2 + 1 + 4 + 1 + 3
    for (U, heads, axis, _), O in zip(items, out):
        assert O.shape == U.shape
        assert _rel_err(O, orthogonalize_loop(U, heads, axis)) <= TWIN_TOL
        assert torch.equal(O, orthogonalize(U, heads, axis))  # a block's NS5 does not depend on its stack-mates


@pytest.mark.parametrize("preset,ep_size", [("tiny", 1), ("tiny", 2), ("small", 4)])
def test_groups_by_module_type_equal_the_name_rule(preset: str, ep_size: int):
    """The module-type split picks exactly the parameters, order, head counts and axes of the old name-string
    rule; only the routed experts are rank-local."""
    model = build_model(K3Config.preset(preset), seed=0, ep_size=ep_size)
    new, old = param_groups(model), param_groups_by_name(model)
    for a, b in zip(new, old):
        assert [id(p) for p in a["params"]] == [id(p) for p in b["params"]]
    assert new[0]["heads"] == old[0]["heads"] and new[0]["axis"] == old[0]["axis"]
    experts = (
        {id(m.w1) for m in model.moe_layers()}
        | {id(m.w2) for m in model.moe_layers()}
        | {id(m.w3) for m in model.moe_layers()}
    )
    assert [not r for r in new[0]["replicated"]] == [id(p) in experts for p in new[0]["params"]]


def test_step_equals_loop_twin_on_tiny():
    """Three Muon + AdamW steps on the tiny model (lr 1e-2, random grads): parameters and momenta match the
    per-block loop optimizer (param displacement and momentum within TWIN_TOL)."""
    model = build_model(K3Config.preset("tiny"), seed=0)
    twin_model = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    opt, twin = PerHeadMuon(param_groups(model), lr=1e-2), PerHeadMuonLoop(param_groups_by_name(twin_model), lr=1e-2)
    _step_three(opt, model)
    _step_three(twin, twin_model)
    for p0, p, q in zip(start, model.parameters(), twin_model.parameters()):
        assert _rel_err(p.detach() - p0, q.detach() - p0) <= TWIN_TOL
        for k, v in twin.state[q].items():
            assert torch.equal(opt.state[p][k], v)  # momenta / moments: elementwise, no NS in them


def _sharded_job(comm) -> dict:
    """On each rank: the tiny model at EP = world size, three steps with the communicator (sharded NS5), without
    it (local) and with the loop twin; then hand-made stacks whose block counts do not divide the world size."""
    model = build_model(K3Config.preset("tiny"), seed=0, ep_size=comm.world_size, ep_rank=comm.rank)
    local_model, twin_model = copy.deepcopy(model), copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    sharded = PerHeadMuon(param_groups(model), lr=1e-2, comm=comm)
    local = PerHeadMuon(param_groups(local_model), lr=1e-2)
    twin = PerHeadMuonLoop(param_groups_by_name(twin_model), lr=1e-2)
    for opt, m in ((sharded, model), (local, local_model), (twin, twin_model)):
        _step_three(opt, m, comm.rank)
    worst = 0.0
    for p0, p, q, r in zip(start, model.parameters(), local_model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q), "the sharded step must equal the unsharded one exactly"
        worst = max(worst, _rel_err(p.detach() - p0, r.detach() - p0))
    assert worst <= TWIN_TOL, worst
    torch.manual_seed(1)  # the same items on every rank: stacks of 1 and 3 + 2 [8, 8] blocks pad with zero blocks
    items = [(torch.randn(8, 24), 1, 0, True), (torch.randn(24, 8), 3, 0, True), (torch.randn(8, 16), 2, 1, True)]
    mine, ran = orthogonalize_all(items, comm)
    assert all(torch.equal(a, b) for a, b in zip(mine, orthogonalize_all(items)[0]))
    return {"ns_sharded": sharded.ns_blocks, "ns_local": local.ns_blocks, "twin_err": worst, "ran": ran}


@pytest.mark.spawns
def test_sharded_step_on_two_gloo_ranks():
    """Two real gloo ranks (replicated grads equal, experts different per rank): the sharded optimizer's params
    equal the unsharded one's bit for bit, match the loop twin within TWIN_TOL, and each rank runs NS5 on about
    half of the replicated blocks (would catch a rank skipping its share, a wrong gather order or padding)."""
    out = launch(_sharded_job, 2, timeout=60, job_timeout=240)
    experts = 3 * 8 * 4  # tiny at EP 2: 8 MoE layers x w1/w2/w3 x 4 local experts
    replicated = out["ns_local"] - experts
    assert experts + replicated / 2 <= out["ns_sharded"] <= experts + replicated / 2 + 13  # <= 1 pad per stack
    assert out["ran"] == 1 + 3  # ceil(1/2) + ceil(5/2) blocks on this rank


@pytest.mark.spawns
def test_muon_bench_schema():
    """``python -m k3.bench``'s function at one rank, one timed step: both optimizers timed on the same model,
    block counts, and the two ending within fp32 noise of each other."""
    from k3.bench import run_muon_bench

    (row,) = run_muon_bench(("tiny",), (1,), steps=1)["results"]
    assert {"old_step_s", "new_step_s", "speedup", "old_min_s", "new_min_s"} <= set(row)
    assert row["ns_blocks_old"] == row["ns_blocks_new"] == 349 and row["max_param_diff"] < 1e-5
