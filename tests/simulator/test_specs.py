"""Model specs and counting: the K3 arithmetic of k3_architecture.md section 3.2 must come out exactly."""

import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.layers import layer_stats, model_flops_per_token, param_counts
from simulator.specs import PRESETS, ModelSpec, from_config_object, from_hf_config, load_model


def test_k3_totals_match_reference():
    """Catches any drift in the per-layer formulas (KDA, gated MLA, LatentMoE, AttnRes vectors, untied head)."""
    counts = param_counts(load_model("k3"))
    assert counts.total == 2_779_484_476_000
    assert counts.active == 104_189_612_640


def test_k3_per_block_counts():
    spec = load_model("k3")
    assert (
        layer_stats(spec, ("kda", "moe")).dense_params - layer_stats(spec, ("mla", "moe")).dense_params
        == 443_740_384 - 232_196_096
    )
    moe = layer_stats(spec, ("mla", "moe"))
    assert moe.expert_params == 29_595_009_024
    assert layer_stats(spec, ("kda", "dense")).dense_params == 443_740_384 + 726_663_168 + 6 * 7168
    kinds = spec.layer_kinds()
    assert sum(k[0] == "kda" for k in kinds) == 69 and sum(k[0] == "mla" for k in kinds) == 24
    assert kinds[91] == ("mla", "moe") and kinds[92] == ("mla", "moe") and kinds[0] == ("kda", "dense")


@pytest.mark.parametrize(
    "name,total,active,tol",
    [("deepseek-v3", 671e9, 37e9, 0.02), ("llama3-405b", 405e9, None, 0.01), ("gpt3-175b", 175e9, None, 0.01)],
)
def test_published_sizes(name, total, active, tol):
    c = param_counts(load_model(name))
    assert abs(c.total / total - 1) < tol
    if active:
        assert abs(c.active / active - 1) < 0.03


def test_megatron_flops_formula():
    """Model FLOPs follow 72 B s L h^2 (1 + s/6h + V/12hL) for the GPT presets (the MFU convention)."""
    for name, (L, h) in {"gpt-22b": (48, 6144), "gpt-1t": (128, 25600)}.items():
        s, V = 2048, 51200
        ref = 72 * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
        assert model_flops_per_token(load_model(name), s) == pytest.approx(ref, rel=1e-9)


def _k3_hf_config() -> dict:
    text = {
        "vocab_size": 163840,
        "hidden_size": 7168,
        "num_hidden_layers": 93,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "linear_attn_config": {
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "kda_layers": [i for i in range(1, 92) if i % 4],
            "full_attn_layers": [*range(4, 94, 4), 93],
        },
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "intermediate_size": 33792,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "topk_method": "noaux_tc",
        "attn_res_block_size": 12,
        "max_position_embeddings": 1048576,
    }
    return {"model_type": "kimi_k3", "tie_word_embeddings": False, "text_config": text}


def test_hf_config_json(tmp_path):
    path = tmp_path / "k3" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(_k3_hf_config()))
    spec = load_model(str(path))
    assert param_counts(spec).total == param_counts(load_model("k3")).total
    assert spec.layer_kinds() == load_model("k3").layer_kinds()


def test_duck_typed_k3config_adapter():
    """A K3Config-like object (attribute names as in the released config) goes through the adapter."""
    cfg = _k3_hf_config()["text_config"]
    obj = SimpleNamespace(
        **{k: v for k, v in cfg.items() if k != "linear_attn_config"},
        linear_attn_config=SimpleNamespace(**cfg["linear_attn_config"]),
        tie_word_embeddings=False,
    )
    assert param_counts(from_config_object(obj)).active == 104_189_612_640


def test_spec_json_round_trip(tmp_path):
    spec = load_model("deepseek-v3")
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec.to_dict()))
    assert load_model(str(path)) == spec


@pytest.mark.parametrize("field,value", [("hidden", 0), ("attention", "linear"), ("top_k", 0), ("norm", "batch")])
def test_bad_spec_names_field(field, value):
    base = PRESETS["kimi-k2"]().to_dict()
    base[field] = value
    with pytest.raises(ValueError, match=field):
        ModelSpec.from_dict(base)


def test_unknown_model_is_a_value_error():
    with pytest.raises(ValueError, match="neither a preset"):
        load_model("no-such-model")
    assert (
        from_hf_config(
            {
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "vocab_size": 100,
                "num_attention_heads": 4,
                "intermediate_size": 128,
            }
        ).ffn_hidden
        == 128
    )


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_max_maxvio_is_the_skew_of_the_worst_routing_and_no_routing_exceeds_it(data):
    """The bound ``infeasible_reason`` holds ``--maxvio`` to: the routing that sends each token's copies to rank 0's
    experts first reaches it, and random routings of any shape stay at or under it."""
    ep = data.draw(st.sampled_from([2, 4, 8]))
    experts = ep * data.draw(st.integers(1, 6))
    k = data.draw(st.integers(1, experts))
    spec = replace(load_model("qwen3-30b-a3b"), num_experts=experts, top_k=k)
    per_rank = experts // ep

    def skew(choices) -> float:
        load = np.bincount(np.asarray(choices).ravel() // per_rank, minlength=ep)
        return float(load.max() / load.mean() - 1)

    worst = [list(range(k))] * 5  # experts 0.. k-1: rank 0 first, then the next ranks
    assert skew(worst) == pytest.approx(spec.max_maxvio(ep), abs=1e-12)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    for _ in range(20):
        routing = [rng.choice(experts, size=k, replace=False) for _ in range(data.draw(st.integers(1, 6)))]
        assert skew(routing) <= spec.max_maxvio(ep) + 1e-12
