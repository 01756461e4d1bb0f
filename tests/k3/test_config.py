"""K3Config presets, JSON round trip, validation and parameter counts (arithmetic and meta-device model)."""

from __future__ import annotations

import json

import pytest

from k3 import K3Config, count_model_parameters, count_parameters
from k3.config import LinearAttnConfig

FULL_TOTAL, FULL_ACTIVE = 2_779_484_476_000, 104_189_612_640  # k3_architecture.md 3.2


def test_full_counts_by_arithmetic_and_meta_model():
    """Would catch a wrong block formula or a missing/extra parameter in the model (e.g. a norm or a bias)."""
    cfg = K3Config.preset("full")
    assert count_parameters(cfg) == {"total": FULL_TOTAL, "active": FULL_ACTIVE}
    assert count_model_parameters(cfg) == {"total": FULL_TOTAL, "active": FULL_ACTIVE}


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_small_presets_meta_matches_arithmetic(name):
    cfg = K3Config.preset(name)
    assert count_model_parameters(cfg) == count_parameters(cfg)


def test_full_schedule():
    cfg = K3Config.preset("full")
    kinds = [cfg.layer_kind(i) for i in range(93)]
    assert kinds.count("kda") == 69 and kinds.count("mla") == 24
    assert kinds[91] == kinds[92] == "mla" and kinds[0] == "kda"
    assert not cfg.is_moe(0) and all(cfg.is_moe(i) for i in range(1, 93))


def test_tiny_keeps_every_structural_switch():
    """Would catch a tiny preset that silently drops a feature the full model has."""
    c = K3Config.preset("tiny")
    L = c.num_hidden_layers
    assert c.layer_kind(L - 1) == c.layer_kind(L - 2) == "mla"  # extra final MLA
    assert {c.layer_kind(i) for i in range(L)} == {"kda", "mla"}
    assert not c.is_moe(0) and c.is_moe(1)  # dense first layer
    assert L % c.attn_res_block_size != 0  # partial tail block
    assert c.num_shared_experts > 0 and c.num_experts_per_token < c.num_experts
    assert c.routed_expert_hidden_size < c.hidden_size  # latent experts


def test_json_round_trip_nested(tmp_path):
    cfg = K3Config.preset("tiny")
    path = tmp_path / "config.json"
    cfg.to_json(path)
    data = json.loads(path.read_text())
    assert data["model_type"] == "kimi_k3" and "text_config" in data
    assert data["text_config"]["linear_attn_config"]["full_attn_layers"] == [4, 8, 9]
    assert K3Config.from_json(path) == cfg


def test_from_hf_layout_with_vision_and_top_level_ids(tmp_path):
    """A released-style config: nested text_config, ids at top level, extra vision/quantisation keys ignored."""
    text = K3Config.preset("full").to_dict()["text_config"]
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        del text[k]
    data = {
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "text_config": text,
        "vision_config": {"vt_hidden_size": 1024},
        "quantization_config": {"format": "mxfp4"},
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    assert K3Config.from_json(path) == K3Config.preset("full")


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_experts_per_token": 8, "num_experts": 8}, "num_experts_per_token"),
        ({"hidden_act": "silu"}, "hidden_act"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
        ({"first_k_dense_replace": 99}, "first_k_dense_replace"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ],
)
def test_invalid_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        K3Config(**change)


def test_invalid_schedule_names_the_field():
    with pytest.raises(ValueError, match="kda_layers"):
        K3Config(
            num_hidden_layers=9,
            linear_attn_config=LinearAttnConfig(full_attn_layers=[4, 8], kda_layers=[1, 2, 3, 5, 6, 7]),
        )
    with pytest.raises(ValueError, match="gate_lower_bound"):
        LinearAttnConfig(gate_lower_bound=1.0)


def test_unknown_preset():
    with pytest.raises(ValueError, match="preset"):
        K3Config.preset("huge")
