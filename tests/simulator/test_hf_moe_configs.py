"""Hugging Face MoE configs read right or refused by name (issue 28, with the simulator issue): Mixtral (the expert
width is ``intermediate_size``), Qwen-MoE's shared expert (``shared_expert_intermediate_size``), ERNIE-4.5's
``moe_*`` names; an MoE config under names we do not know is an error naming its fields, never a dense model;
expert fields we do not read are warned about. Field values are those of the published ``config.json`` files."""

from __future__ import annotations

import json
import warnings

import pytest

from simulator.layers import param_counts
from simulator.specs import from_hf_config, load_model

MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}
QWEN2_57B_A14B = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "decoder_sparse_step": 1,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 2560,
    "norm_topk_prob": False,
    "num_attention_heads": 28,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 20480,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
ERNIE_45_21B_A3B = {
    "architectures": ["Ernie4_5_MoeForCausalLM"],
    "hidden_size": 2560,
    "intermediate_size": 12288,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1536,
    "moe_k": 6,
    "moe_layer_interval": 1,
    "moe_layer_start_index": 1,
    "moe_num_experts": 64,
    "moe_num_shared_experts": 2,
    "num_attention_heads": 20,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": True,
    "vocab_size": 103424,
}


def _load(cfg: dict, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return load_model(str(path))


def test_mixtral_reads_its_expert_width_from_intermediate_size(tmp_path):
    spec = _load(MIXTRAL_8X7B, tmp_path)
    assert (spec.num_experts, spec.top_k, spec.moe_ffn_hidden, spec.num_shared_experts) == (8, 2, 14336, 0)
    counts = param_counts(spec)  # Mistral's numbers: 46.7B total, 12.9B active
    assert 46.0e9 < counts.total < 47.5e9 and 12.5e9 < counts.active < 13.2e9, counts


def test_qwen2_moe_keeps_its_shared_expert(tmp_path):
    spec = _load(QWEN2_57B_A14B, tmp_path)
    assert spec.num_shared_experts * spec.moe_ffn_hidden == 20480
    active = param_counts(spec).active  # Qwen's own: 14B active ("A14B"); without the shared expert 7.5B
    assert 13.5e9 < active < 14.8e9, active


def test_ernie_moe_names_are_read(tmp_path):
    spec = _load(ERNIE_45_21B_A3B, tmp_path)
    assert (spec.num_experts, spec.top_k, spec.num_shared_experts, spec.first_k_dense) == (64, 6, 2, 1)
    counts = param_counts(spec)  # Baidu's "21B-A3B" (rounded: 64 + 2 shared experts of 1536 over 27 layers)
    assert 20.0e9 < counts.total < 22.5e9 and 2.7e9 < counts.active < 3.6e9, counts


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"num_routed_exps": 16, "exps_per_token": 2, "expert_ffn": 512}, "expert_ffn"),
        ({"moe_experts_total": 32, "moe_topk_n": 4}, "moe_experts_total"),
    ],
)
def test_an_moe_config_under_unknown_names_is_refused_not_read_as_dense(fields: dict, named: str):
    base = {k: MIXTRAL_8X7B[k] for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")}
    with pytest.raises(ValueError, match="no expert count under a known name") as err:
        from_hf_config(base | {"intermediate_size": 1024} | fields)
    assert named in str(err.value)


def test_unread_expert_fields_are_warned_about():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from_hf_config(MIXTRAL_8X7B | {"moe_capacity_factor": 1.25, "expert_dropout": 0.1})
    said = " ".join(str(w.message) for w in caught)
    assert "moe_capacity_factor" in said and "expert_dropout" in said and "router_aux_loss_coef" not in said, said


@pytest.mark.parametrize(
    "change, named",
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"mlp_only_layers": [3, 7]}, "mlp_only_layers=[3, 7]"),
        ({"shared_expert_intermediate_size": 3000}, "shared_expert_intermediate_size=3000"),
        ({"num_experts_per_tok": 0}, "without its top-k"),
    ],
)
def test_moe_layouts_that_cannot_be_expressed_are_refused(change: dict, named: str):
    with pytest.raises(ValueError) as err:
        from_hf_config(QWEN2_57B_A14B | change)
    assert named in str(err.value)
