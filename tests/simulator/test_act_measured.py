"""Issue 27: the simulator's saved bytes per token per layer agree term by term with what stand-in layers keep
under ``saved_tensors_hooks`` (fused-kernel saved sets, ``simulator.calibrate_activations``), measured at small
widths, fitted linearly and checked at a third width; the MoE expert output only with probabilities at the combine;
fp8 storage, recompute and the E5M6 cache remove the terms they really remove; MTP on the last stage; K3's AttnRes
mixes measured from the real ``k3.attnres`` code."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from k3.attnres import attn_res_mix
from simulator.calibrate_activations import CHECKPOINTED_FFN, SavedCounter, fit, measure_layer, scaled
from simulator.hardware import load_hardware
from simulator.layers import layer_stats
from simulator.memory import mtp_act_bytes, rank_memory, saved_bytes_per_token
from simulator.parallel import ParallelConfig
from simulator.saved_bytes import format_terms
from simulator.specs import from_hf_config, load_model
from tests.simulator.hf_moe_config_data import NEMOTRON_3_NANO

# (model, layer kind, base): widths m / base of the real ones (base keeps every scaled width an integer)
CASES = [
    ("llama3-405b", ("mha", "dense"), 8),
    ("deepseek-v3", ("mla", "moe"), 32),
    ("deepseek-v3", ("mla", "dense"), 32),
    ("k3", ("mla", "moe"), 32),
    ("k3", ("mla", "dense"), 32),
    ("k3", ("kda", "moe"), 32),
    ("k3", ("kda", "dense"), 32),
]
PAR = ParallelConfig(seq_len=4096, global_batch_tokens=4096 * 8, recompute="none")


def simulated_terms(spec, kind, probs="swiglu") -> dict[str, float]:
    out: dict[str, float] = {}
    for t in layer_stats(spec, kind).act_terms:
        if t.when != "combine" or probs == "combine":
            out[t.name] = out.get(t.name, 0.0) + t.nbytes
    return {k: v for k, v in out.items() if v}


@pytest.fixture(scope="module")
def fits():
    return {(m, k): fit(load_model(m), k, base=b) for m, k, b in CASES}


@pytest.mark.parametrize("model,kind,base", CASES)
def test_every_term_matches_the_measurement_at_real_widths(fits, model, kind, base):
    measured, worst = fits[model, kind]
    assert worst < 0.01, f"not linear in the width at the third width: {worst:.3%}"
    sim = simulated_terms(load_model(model), kind)
    assert set(measured) == set(sim), (sorted(measured), sorted(sim))
    for name, nbytes in sim.items():
        assert measured[name] == pytest.approx(nbytes, rel=0.05), name


@pytest.mark.parametrize("model,kind,base", CASES)
def test_saved_bytes_per_token_is_the_measured_layer(fits, model, kind, base):
    """TP 1, bf16, flash, no recompute: the memory model's per-layer number is the measured sum (the compressed
    MLA KV is its own memory item)."""
    spec, measured = load_model(model), fits[model, kind][0]
    st = layer_stats(spec, kind)
    total = saved_bytes_per_token(spec, PAR, st, flash=True) - st.act_attn_res + st.mla_kv
    assert total == pytest.approx(sum(measured.values()), rel=0.01)


def test_llama_layer_is_the_issue_number(fits):
    """The issue's Llama-3 405B layer: 520,712 B/token measured at TP 1 (q, k, v, o, lse, norm inputs + rstd)."""
    assert sum(fits["llama3-405b", ("mha", "dense")][0].values()) == pytest.approx(520_712, abs=1)


def test_expert_output_is_kept_only_with_probabilities_at_the_combine():
    spec = scaled(load_model("deepseek-v3"), 2, 32)
    kind = ("mla", "moe")
    at_combine = measure_layer(spec, kind, moe_probs="combine")
    assert "expert_out" not in measure_layer(spec, kind)
    sim = simulated_terms(spec, kind, "combine")
    assert at_combine["expert_out"] == pytest.approx(sim["expert_out"], rel=0.05)
    st = layer_stats(spec, kind)
    diff = saved_bytes_per_token(spec, replace(PAR, moe_probs="combine"), st, True) - saved_bytes_per_token(
        spec, PAR, st, True
    )
    assert diff == pytest.approx(2 * spec.top_k * spec.hidden)


@pytest.mark.parametrize("modules", [(), ("moe_act",), ("layernorm",), ("moe_act", "shared_experts", "layernorm")])
def test_fp8_and_recompute_remove_each_term_once(modules):
    """fp8 storage changes a term to its fp8 bytes; a recomputed term is gone whatever its dtype: the total is the
    plain sum over the terms left (no term subtracted twice, the MoE norm output never halved)."""
    spec = load_model("deepseek-v3")
    st = layer_stats(spec, ("mla", "moe"))
    par = replace(PAR, precision="fp8", recompute_modules=modules)
    left = [t for t in st.act_terms if t.when in ("", "flash") and not set(t.removed_by) & set(modules)]
    assert saved_bytes_per_token(spec, par, st, True) == pytest.approx(sum(t.fp8 for t in left))
    terms = {t.name: t for t in st.act_terms}
    assert terms["ffn_norm_out"].fp8 == terms["ffn_norm_out"].nbytes  # the router's bf16 GEMM keeps it
    assert terms["expert_act_in"].fp8 == terms["expert_act_in"].nbytes  # SwiGLU runs in bf16


@pytest.mark.parametrize(
    "model,kind,base",
    [("deepseek-v3", ("mla", "moe"), 32), ("llama3-405b", ("mha", "dense"), 8), ("k3", ("kda", "moe"), 32)],
)
def test_a_checkpointed_ffn_block_keeps_only_its_input(model, kind, base):
    """Megatron's ``moe`` / ``mlp`` recompute modules checkpoint the whole FFN block (``tensor_parallel.checkpoint``:
    its input saved, its forward run without autograd): measured that way, the terms that disappear are exactly
    the ones the simulator drops for the module, the rest keep their bytes, and the layer's total is the measured
    one."""
    module = CHECKPOINTED_FFN[kind[1]]
    spec = load_model(model)
    plain, _ = fit(spec, kind, base=base)
    kept, worst = fit(spec, kind, base=base, recompute_modules=(module,))
    assert worst < 0.01
    st = layer_stats(spec, kind)
    dropped = {t.name for t in st.act_terms if module in t.removed_by and t.when in ("", "flash") and t.nbytes}
    assert {n for n, b in plain.items() if b} - {n for n, b in kept.items() if b} == dropped
    assert all(kept[n] == pytest.approx(plain[n]) for n in kept if kept[n])
    par = replace(PAR, recompute_modules=(module,))
    total = saved_bytes_per_token(spec, par, st, flash=True) - st.act_attn_res + st.mla_kv
    assert total == pytest.approx(sum(kept.values()), rel=0.01)
    assert total < saved_bytes_per_token(spec, PAR, st, flash=True) - st.act_attn_res + st.mla_kv


def test_mamba2_mixer_is_what_megatrons_fused_path_keeps():
    """Nemotron 3 Nano's Mamba-2 block as Megatron trains it (in-projection, mamba_ssm's fused conv + scan + gate,
    the grouped RMSNorm, out-projection): the terms, each within 5%, and the layer's total at TP 1 and bf16; in fp8
    only the out-projection's input halves; no recompute mode removes a term (the fused kernel already recomputes
    the convolution)."""
    spec, kind = from_hf_config(NEMOTRON_3_NANO), ("mamba", "none")
    measured, worst = fit(spec, kind, base=64)
    assert worst < 0.01
    sim = simulated_terms(spec, kind)
    assert set(measured) == set(sim)
    assert all(measured[n] == pytest.approx(b, rel=0.05) for n, b in sim.items())
    st = layer_stats(spec, kind)
    assert saved_bytes_per_token(spec, PAR, st, flash=True) == pytest.approx(sum(measured.values()), rel=0.01)
    fp8 = saved_bytes_per_token(spec, replace(PAR, precision="fp8"), st, flash=True)
    assert sum(measured.values()) - fp8 == pytest.approx(spec.hidden + spec.mamba_inner)  # norm output, out_proj in
    for mode in ("selective", "selective+act"):
        kept = saved_bytes_per_token(spec, replace(PAR, recompute=mode), st, flash=True)
        assert kept == saved_bytes_per_token(spec, PAR, st, flash=True)


@pytest.mark.parametrize("cache,per_elem", [("e5m6", 1.5), ("fp8", 1.0)])
def test_attention_output_cache(cache, per_elem):
    """DeepSeek-V3's E5M6 cache: one copy of the out-proj input serves flash and the GEMM."""
    spec = load_model("deepseek-v3")
    st = layer_stats(spec, ("mla", "moe"))
    par = replace(PAR, precision="fp8")
    elems = spec.num_heads * spec.v_head_dim
    base = saved_bytes_per_token(spec, par, st, True)
    cached = saved_bytes_per_token(spec, replace(par, attn_out_cache=cache), st, True)
    assert base - cached == pytest.approx(3 * elems - per_elem * elems)


def test_mtp_adds_one_layer_and_its_projection_on_the_last_stage():
    spec, hw = load_model("deepseek-v3"), load_hardware("h800")
    par = ParallelConfig(pp=4, ep=8, dp=8, seq_len=4096, global_batch_tokens=4096 * 64, recompute="selective")
    with_mtp = replace(spec, mtp_layers=1)
    last = par.pp - 1
    assert rank_memory(with_mtp, hw, par, 0)["activations"] == rank_memory(spec, hw, par, 0)["activations"]
    diff = rank_memory(with_mtp, hw, par, last)["activations"] - rank_memory(spec, hw, par, last)["activations"]
    st = layer_stats(spec, spec.layer_kinds()[-1])
    layer = saved_bytes_per_token(spec, par, st, True) + st.mla_kv
    per_token = mtp_act_bytes(with_mtp, par, True)
    assert per_token == pytest.approx(layer + 8 * spec.hidden + 8)
    live = min(par.micro_batches, par.pp - last)
    assert diff == pytest.approx(par.seq_len * (per_token * live + spec.vocab * 6.0))


def _mix_bytes(h: int, n: int, tokens: int = 8) -> float:
    """Bytes per token a second AttnRes mix over the same completed blocks adds (a new partial sum)."""
    gen = torch.Generator().manual_seed(n)
    blocks = [torch.randn(tokens, h, generator=gen, dtype=torch.bfloat16, requires_grad=True) for _ in range(n - 1)]
    q, g = torch.nn.Parameter(torch.randn(h)), torch.nn.Parameter(torch.ones(h))
    with SavedCounter([q, g]) as saved:
        attn_res_mix([*blocks, torch.randn(tokens, h, dtype=torch.bfloat16, requires_grad=True)], q, g, 1e-5)
        before = sum(saved.bytes.values())
        attn_res_mix([*blocks, torch.randn(tokens, h, dtype=torch.bfloat16, requires_grad=True)], q, g, 1e-5)
    return (sum(saved.bytes.values()) - before) / tokens


@pytest.mark.parametrize("n", [2, 5, 9])
def test_attn_res_mix_is_what_k3_code_keeps(n):
    """k3.attnres keeps its sources by reference: a mix adds the new partial sum (bf16) and three fp32 numbers per
    source, the per-mix formula of ``layers.attn_res_bytes``; linear in the width (two widths, checked at a third)."""
    got = {h: _mix_bytes(h, n) for h in (64, 128, 192)}
    assert got[192] == pytest.approx(2 * got[128] - got[64], rel=0.01)
    for h, b in got.items():
        assert b == pytest.approx(2 * h + 12 * n, rel=0.05)


def test_readme_term_table_is_the_code_output():
    readme = (Path(__file__).parents[2] / "simulator" / "README.md").read_text()
    assert format_terms({m: load_model(m) for m in ("k3", "deepseek-v3")}) in readme
