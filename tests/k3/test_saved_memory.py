"""What K3 keeps for the backward: MLA on SDPA's mask-free causal path, AttnRes keeping its sources by reference,
per-token bytes flat in the sequence length, and ``moonep bench k3-memory``'s JSON."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from k3 import K3Config
from k3.attnres import attn_res_mix
from k3.mla import GatedMLA, causal_attention
from k3.reference import attn_res_mix_autograd
from k3.saved_memory import MODULES, build, measure, mix_sources, scaled_config

TINY = K3Config.preset("tiny")


def saved_storages(fn, *inputs) -> list[torch.Tensor]:
    """``fn(*inputs)`` under saved_tensors_hooks: one tensor per distinct storage it saved for the backward."""
    seen, out = set(), []

    def pack(t):
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            out.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_mla_keeps_no_square_tensor(dtype):
    """Catches a dense [T, T] mask handed to SDPA (kept by the fused kernel's backward), and a q/v width mismatch
    that sends SDPA to its math path (which keeps fp32 [B, h, T, T] probabilities)."""
    torch.manual_seed(0)
    layer = GatedMLA(TINY).to(dtype)
    T = 50  # no width of the tiny MLA is 50
    x = torch.randn(2, T, TINY.hidden_size, dtype=dtype, requires_grad=True)
    square = [tuple(t.shape) for t in saved_storages(layer, x) if sum(d == T for d in t.shape) >= 2]
    assert square == []


def test_causal_attention_after_an_offset_matches_the_masked_softmax():
    """The CP slice (queries are the last T_q of T_k keys) and the plain causal case against the formula; would
    catch a top-left aligned mask, or a zero-padded value width leaking into the output."""
    torch.manual_seed(0)
    for T_q, T_k in ((7, 7), (7, 21)):
        q, k, v = torch.randn(2, 3, T_q, 24), torch.randn(2, 3, T_k, 24), torch.randn(2, 3, T_k, 16)
        s = (q @ k.transpose(-1, -2)) * 0.3
        visible = torch.arange(T_k)[None, :] <= torch.arange(T_k - T_q, T_k)[:, None]
        ref = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ v
        out = causal_attention(q, k, v, 0.3)
        assert out.shape == ref.shape and rel(out, ref) < 1e-5


def _mix_grads(fn, sources, query, gain):
    leaves = [t.detach().clone().requires_grad_() for t in (*sources, query, gain)]
    out = fn(leaves[:-2], leaves[-2], leaves[-1], 1e-5)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_attn_res_backward_equals_autograd_on_the_formula(dtype, tol):
    """The hand-written backward vs autograd on the old fp32-stack formula: sources, query and gain grads; would
    catch a missing RMSNorm term (r_n s_n / d) or a softmax backward summed over the wrong axis."""
    torch.manual_seed(0)
    sources = [(torch.randn(2, 9, 32) * (n + 1)).to(dtype) for n in range(5)]
    query, gain = torch.randn(32).to(dtype), (torch.rand(32) + 0.5).to(dtype)
    out, grads = _mix_grads(attn_res_mix, sources, query, gain)
    ref, ref_grads = _mix_grads(attn_res_mix_autograd, sources, query, gain)
    assert torch.equal(out, ref)  # the same fp32 operations in the same order
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < tol


def test_attn_res_keeps_its_sources_by_reference():
    """The mix keeps the sources themselves and 3 fp32 numbers per token and source: at d = 64 and 5 sources
    the old fp32 stacks (2 x 5 x 64 x 4 = 2560 bytes per token) break the 16 bytes per token and source bound."""
    T, d, n = 64, 64, 5
    sources = [torch.randn(1, T, d, requires_grad=True) for _ in range(n)]
    query, gain = torch.randn(d, requires_grad=True), torch.ones(d, requires_grad=True)
    for fn, within in ((attn_res_mix, True), (attn_res_mix_autograd, False)):
        given = {t.untyped_storage().data_ptr() for t in (*sources, query, gain)}
        saved = saved_storages(fn, sources, query, gain, 1e-5)
        extra = sum(t.untyped_storage().nbytes() for t in saved if t.untyped_storage().data_ptr() not in given)
        assert (extra / T <= 16 * n) == within, (fn.__name__, extra / T)


def test_per_token_bytes_do_not_grow_with_the_sequence():
    """A real 8-layer K3 (MLA, KDA, MoE, dense, AttnRes) at two sequence lengths: equal bytes per token per
    layer in every module, and no [T, T] tensor kept; would catch a mask or score matrix kept per layer."""
    model = build(scaled_config(1), torch.bfloat16)
    short, long = measure(model, 40), measure(model, 72)
    assert short["square"] == [] and long["square"] == []
    # the schedule the K3 extrapolation averages AttnRes over is the one the model ran
    assert [n for _, n, _ in short["mixes"]] == [n for layer in mix_sources(model.cfg) for n in layer]
    for name in MODULES:
        a, b = short["bytes_per_token"][name], long["bytes_per_token"][name]
        assert a > 0 and abs(b - a) <= 0.01 * a, (name, a, b)


@pytest.mark.spawns
def test_memory_bench_json_quick(tmp_path, capsys):
    """``moonep bench k3-memory --quick --json``: the fields the bench promises, and AttnRes at K3 widths within
    two mixes of one bf16 partial sum each plus 16 bytes per source (the old fp32 stacks kept ~600 KB)."""
    from moonep.console import main

    path = tmp_path / "mem.json"
    assert main(["bench", "k3-memory", "--quick", "--json", str(path)], packages=["k3"]) == 0
    assert "K3 d=7168" in capsys.readouterr().out
    out = json.loads(path.read_text())
    assert out["config"] == {"widths": [1, 2], "seq_lens": [40, 72], "dtype": "bfloat16", "moe": "ep"}
    assert [(r["width"], r["seq_len"]) for r in out["runs"]] == [(1, 40), (1, 72), (2, 40), (2, 72)]
    for r in out["runs"]:
        assert set(r["bytes_per_token"]) == set(MODULES) and r["square"] == []
        assert all(len(m) == 3 for m in r["mixes"]) and isinstance(r["fixed_bytes"], dict)
    assert [r["seq_len"] for r in out["k3"]] == [40, 72]
    for r in out["k3"]:
        assert set(r) == {"seq_len", *MODULES, "mla_layer", "kda_layer"}
        assert r["mla_layer"] == pytest.approx(r["mla"] + r["moe"] + r["norms"] + r["attn_res"])
        assert 0 < r["attn_res"] <= 2 * (2 * 7168 + 16 * 10)
    # the simulator's K3 spec side by side (``moonep simulate saved-bytes``: the simulator reads the JSON, it may
    # not import the model code)
    from simulator.layers import layer_stats
    from simulator.specs import load_model

    table_path = tmp_path / "side.json"
    assert (
        main(["simulate", "saved-bytes", "--measured", str(path), "--json", str(table_path)], packages=["simulator"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "simulator k3" in printed and "measured/sim T=72" in printed
    table = json.loads(table_path.read_text())
    stats = layer_stats(load_model("k3"), ("mla", "moe"))
    assert table["simulator"]["mla_layer"] == stats.act_rep + stats.act_par + stats.act_attn_res
    assert table["simulator"]["attn_res"] == stats.act_attn_res > 0
    for got, ratio, want in zip(table["measured"], table["ratio"], out["k3"]):
        assert got == {m: want[m] for m in table["modules"]} | {"seq_len": want["seq_len"]}
        assert ratio["mla_layer"] == pytest.approx(want["mla_layer"] / table["simulator"]["mla_layer"])
        assert ratio["attn_res"] == pytest.approx(want["attn_res"] / table["simulator"]["attn_res"])


@pytest.mark.parametrize(
    "extra,named",
    [
        (["--widths", "2"], "--widths: give two or more different widths >= 1, got 2"),
        (["--widths", "2,x"], "--widths: 'x' is not a width"),
        (["--seq-lens", "1,8"], "--seq-lens: every sequence length must be >= 2, got 1,8"),
    ],
)
def test_memory_bench_refuses_bad_flags_in_one_line(capsys, extra, named):
    from moonep.console import main

    assert main(["bench", "k3-memory", *extra], packages=["k3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named}") and err.count("\n") == 1, err


def test_causal_attention_pads_only_the_narrower_width():
    """v wider than q/k (not K3's shape) still goes through: q and k get the zero columns instead."""
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 12)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    assert rel(causal_attention(q, k, v, 0.5), ref) < 1e-5
