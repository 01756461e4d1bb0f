"""Which mixer and FFN each layer of an HF config runs (issue 27's "every HF MoE config read right"): transformers
5.x ``layer_types`` / ``mlp_layer_types`` read layer by layer, and every layer kind without a cost model (other
linear attentions, indexed sparse attention, convolutions, malformed single-block patterns, per-layer shapes) refused by
name instead of priced as softmax attention. The configs are transformers' own config classes (the real
package, installed by ``make test``) and published ``config.json`` fields."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import warnings

import pytest
import transformers  # the dev extra: make test installs it, so a missing install fails here instead of skipping

from moonep.console import main
from simulator import ParallelConfig, simulate
from simulator.feasibility import infeasible_reason
from simulator.hardware import load_hardware
from simulator.layers import param_counts
from simulator.specs import from_hf_config
from tests.simulator.hf_moe_config_data import JAMBA_V01, QWEN2_57B_A14B

pytestmark = pytest.mark.filterwarnings("ignore:HF config. expert fields not read")


def _default(model_type: str) -> dict:
    """transformers' default config of ``model_type`` as its ``config.json`` dict."""
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        return transformers.CONFIG_MAPPING[model_type]().to_dict()


def test_mlp_layer_types_price_the_dense_layers_dense():
    cfg = _default("glm4_moe_lite")
    spec = from_hf_config(cfg)
    moe = [i for i, (_, ffn) in enumerate(spec.layer_kinds()) if ffn == "moe"]
    assert moe == [i for i, kind in enumerate(cfg["mlp_layer_types"]) if kind == "sparse"] and 0 not in moe
    kinds = ["sparse"] * cfg["num_hidden_layers"]
    kinds[5] = "dense"
    spec = from_hf_config(cfg | {"mlp_layer_types": kinds})
    assert [ffn for _, ffn in spec.layer_kinds()][4:7] == ["moe", "dense", "moe"]


@pytest.mark.parametrize("model_type", ["afmoe", "lfm2_moe"])
def test_num_dense_layers_leads_with_dense_layers(model_type: str):
    cfg = _default(model_type)
    ffn = [f for _, f in from_hf_config(cfg).layer_kinds()]
    n = cfg["num_dense_layers"]
    assert n >= 1 and ffn[:n] == ["dense"] * n and set(ffn[n:]) == {"moe"}


def test_kimi_linear_in_transformers_5_form_is_kda_on_its_linear_layers():
    cfg = _default("kimi_linear")
    spec = from_hf_config(cfg)
    linear = tuple(i for i, kind in enumerate(cfg["layer_types"]) if kind == "linear_attention")
    assert spec.kda_layers == linear and spec.kda_heads == cfg["linear_num_heads"]
    released = cfg | {"linear_attn_config": {"kda_layers": [i + 1 for i in linear], "num_heads": 32, "head_dim": 128}}
    assert from_hf_config(released).kda_layers == linear


def test_llama4_chunked_attention_is_a_window_of_its_chunk():
    cfg = _default("llama4_text")
    spec = from_hf_config(cfg)
    chunked = tuple(i for i, kind in enumerate(cfg["layer_types"]) if kind == "chunked_attention")
    assert spec.sliding_window == cfg["attention_chunk_size"] and spec.sliding_window_layers == chunked


NEMOTRON_H_FIELDS = {
    "model_type": "nemotron_h",
    "num_hidden_layers": 8,
    "hybrid_override_pattern": "MEM*EMEM",
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
}
"""The fields a published Nemotron-H MoE ``config.json`` adds (each layer one block: M Mamba, E MoE, * attention;
read by ``simulator.hf_layer_kinds``)."""


@pytest.mark.parametrize(
    ("model_type", "change", "named"),
    [
        ("minimax", {}, "linear_attention"),  # lightning attention
        ("minimax", {"layer_types": None}, "linear_attention"),  # transformers' alternating default
        ("qwen3_next", {"layer_types": None, "full_attention_interval": 0}, "full_attention_interval"),
        ("bailing_hybrid", {}, "linear_attention"),  # linear attention without Gated DeltaNet's key / value heads
        ("falcon_h1", {}, "'falcon_h1' is not expressible"),  # attention and Mamba-2 side by side
        ("longcat_flash", {}, "'longcat_flash' is not expressible"),  # was "'num_hidden_layers' is missing"
        ("recurrent_gemma", {}, "block_types kinds ['recurrent']"),  # was priced as all softmax attention
        ("deepseek_v32", {}, "indexed_attention"),
        ("deepseek_v32", {"layer_types": None}, "index_topk"),  # a published file: no layer_types
        ("lara_mini", {"layer_types": None}, "linear_num_key_heads"),  # linear fields, no placement
        ("deepseek_v4", {}, "no cost model"),
        ("dots3_note", {}, "per_layer_config"),
        ("lfm2", {"full_attn_idxs": [0, 3], "layer_types": None}, "conv"),
        ("lfm2_moe", {"layer_types": ["conv", "conv", "full_attention"] * 8 + ["conv"] * 8}, "conv"),
        ("qwen3_moe", NEMOTRON_H_FIELDS | {"layer_types": None, "hybrid_override_pattern": "MEM*XMEM"}, "pattern"),
        ("qwen3_moe", NEMOTRON_H_FIELDS | {"layer_types": None, "num_hidden_layers": 9}, "block pattern lists 8"),
        ("qwen3_moe", {"layers_block_type": ["conv", "moe"] * 24, "layer_types": None}, "layers_block_type"),
        ("qwen3_moe", NEMOTRON_H_FIELDS | {"layer_types": None, "mamba_head_dim": None}, "mamba_head_dim"),
        ("qwen3_moe", {"mamba_num_heads": 64, "mamba_head_dim": 64, "layer_types": None}, "mamba_num_heads"),
    ],
)
def test_layers_without_a_cost_model_are_refused_by_name(model_type: str, change: dict, named: str):
    with pytest.raises(ValueError) as err:
        from_hf_config(_default(model_type) | change)
    msg = str(err.value)
    assert named in msg and msg.startswith("HF config") and "\n" not in msg, msg


def test_a_refused_hybrid_is_exit_2_on_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    bad = NEMOTRON_H_FIELDS | {"hybrid_override_pattern": "MEM*EMEM?"}  # a block this reader does not know
    path.write_text(json.dumps(QWEN2_57B_A14B | bad | {"num_hidden_layers": 9}))
    assert main(["simulate", "run", "--model", str(path), "--gpus", "8", "--hardware", "h100"]) == 2
    err = capsys.readouterr().err.strip()
    assert "hybrid_override_pattern" in err and len(err.splitlines()) == 1, err


def test_mlp_layer_types_that_disagree_with_first_k_dense_are_refused():
    cfg = _default("deepseek_v32") | {"layer_types": None, "index_topk": None}
    assert from_hf_config(cfg).first_k_dense == cfg["first_k_dense_replace"]
    with pytest.raises(ValueError, match="mlp_layer_types and first_k_dense_replace=2 disagree"):
        from_hf_config(cfg | {"first_k_dense_replace": 2})


QWEN3_NEXT_80B_A3B = {
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "vocab_size": 151936,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
}
"""Qwen/Qwen3-Next-80B-A3B-Instruct ``config.json`` (cost fields): no ``layer_types``, a full-attention interval."""


def test_gated_deltanet_hybrids_are_read_from_either_form():
    """Qwen3-Next as published (``full_attention_interval``) and as transformers 5.x writes it (``layer_types``)
    give one spec: Gated DeltaNet on three layers of four, gated full attention on the fourth; 80B total and
    about 3B active (the card's "80B-A3B", embedding and head aside)."""
    hub = from_hf_config(QWEN3_NEXT_80B_A3B)
    five = from_hf_config(_default("qwen3_next") | {"intermediate_size": 5120, "_name_or_path": hub.name})
    assert hub == five and hub.kda_layers == tuple(i for i in range(48) if (i + 1) % 4)
    assert hub.kda_gate == "head" and (hub.kda_heads, hub.kda_key_heads) == (32, 16) and hub.attn_output_gate
    c = param_counts(hub)
    assert abs(c.total / 80e9 - 1) < 0.01 and abs((c.active - hub.vocab * hub.hidden) / 3e9 - 1) < 0.1


def test_mamba2_hybrids_price_mamba_where_their_config_puts_it():
    granite = _default("granitemoehybrid")
    kinds = ["linear_attention"] * granite["num_hidden_layers"]
    kinds[3] = kinds[9] = "full_attention"
    spec = from_hf_config(granite | {"layer_types": kinds})
    assert spec.mamba_heads == granite["mamba_n_heads"] and 3 not in spec.mamba_layers and 4 in spec.mamba_layers
    assert [m for m, _ in spec.layer_kinds()].count("mamba") == len(kinds) - 2
    hub = granite | {"layer_types": None, "layers_block_type": ["mamba", "attention"] * 16}
    assert from_hf_config(hub).mamba_layers == tuple(range(0, 32, 2))  # Granite-4's published spelling
    bamba = from_hf_config(_default("bamba") | {"attn_layer_indices": [5, 10]})
    assert set(range(32)) - set(bamba.mamba_layers) == {5, 10} and bamba.num_experts == 0
    with pytest.raises(ValueError, match="mamba_n_heads=128 x mamba_d_head=32 is not the Mamba inner width"):
        from_hf_config(_default("bamba") | {"mamba_d_head": 32})


def test_layer_types_must_name_every_layer():
    with pytest.raises(ValueError, match="'layer_types' must list one kind per layer"):
        from_hf_config(QWEN2_57B_A14B | {"layer_types": ["full_attention"] * 3})
    assert from_hf_config(JAMBA_V01).mamba_layers  # Jamba's own placement fields still price its Mamba layers


@pytest.mark.parametrize("model_type", ["qwen3_next", "granitemoehybrid", "bamba", "kimi_linear"])
def test_recurrent_hybrids_run_on_both_engines(model_type: str):
    """A Gated DeltaNet, Mamba-2 or KDA hybrid prices its recurrent layers (the recurrent-kernel time is
    nonzero) and runs through the analytic and the event engine alike."""
    spec = from_hf_config(_default(model_type))
    ep = 8 if spec.num_experts and spec.num_experts % 8 == 0 else 1
    par = ParallelConfig(dp=64, ep=ep, seq_len=4096, global_batch_tokens=128 * 4096, zero_stage=1)
    fast, events = simulate(spec, "gb200", par, 64), simulate(spec, "gb200", par, 64, engine="event")
    assert fast.feasible and events.feasible, (fast.reason, events.reason)
    assert fast.breakdown["kda"] > 0 and fast.tokens_per_s_per_gpu > 0 and events.tokens_per_s_per_gpu > 0


def test_tensor_parallel_must_split_recurrent_heads():
    qwen = from_hf_config(_default("qwen3_next"))  # 32 value heads, 16 q/k heads
    granite = from_hf_config(_default("granitemoehybrid"))  # 128 Mamba-2 heads
    par, h100 = ParallelConfig(tp=8, dp=1, seq_len=4096, global_batch_tokens=8 * 4096), load_hardware("h100")
    assert infeasible_reason(qwen, h100, par, 8) is None
    odd = dataclasses.replace(qwen, kda_key_heads=12)
    assert "(12 q/k) are not divisible by TP 8" in (infeasible_reason(odd, h100, par, 8) or "")
    assert "Mamba-2 heads" in (infeasible_reason(dataclasses.replace(granite, mamba_heads=4), h100, par, 8) or "")
