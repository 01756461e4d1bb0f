"""Presets read from published Hugging Face ``config.json`` files (the fields that size each model), through the
same reader as a user's file (``simulator.hf_config.from_hf_config``): the Nemotron 3 hybrids, which the
out-of-sample checks (``simulator.out_of_sample``) price."""

from __future__ import annotations

from dataclasses import replace

from simulator.hf_config import from_hf_config
from simulator.modelspec import ModelSpec

NEMOTRON_3_NANO = {
    "model_type": "nemotron_h",
    "architectures": ["NemotronHForCausalLM"],
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "num_hidden_layers": 52,
    "hidden_size": 2688,
    "vocab_size": 131072,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "n_routed_experts": 128,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "n_shared_experts": 1,
    "intermediate_size": 1856,
    "mlp_hidden_act": "relu2",
    "max_position_embeddings": 262144,
}
"""NVIDIA-Nemotron-3-Nano-30B-A3B's published ``config.json`` (the fields that size it; Megatron-Bridge's
``recipes/nemotronh/h100/nemotron_3_nano.py`` states the same architecture)."""

NEMOTRON_3_SUPER = NEMOTRON_3_NANO | {
    "hybrid_override_pattern": "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*"
    "EMEMEMEME",
    "num_hidden_layers": 88,
    "hidden_size": 4096,
    "mamba_num_heads": 128,
    "n_routed_experts": 512,
    "num_experts_per_tok": 22,
    "moe_intermediate_size": 2688,
    "moe_latent_size": 1024,
    "moe_shared_expert_intermediate_size": 5376,
    "intermediate_size": 2688,
    "num_nextn_predict_layers": 1,
    "mtp_hybrid_override_pattern": "*E",
}
"""NVIDIA-Nemotron-3-Super-120B-A12B-BF16's published ``config.json`` (the fields that size it; the rest are
Nano's values): LatentMoE (512 experts of width 2688 behind a 1024-wide projection, 22 per token) and one MTP
module of an attention and an MoE block."""


def nemotron_3_nano() -> ModelSpec:
    """Nemotron 3 Nano (30B-A3B): 23 Mamba-2, 23 MoE and 6 attention layers."""
    return replace(from_hf_config(NEMOTRON_3_NANO), name="nemotron-3-nano")


def nemotron_3_super() -> ModelSpec:
    """Nemotron 3 Super (120B-A12B): 40 Mamba-2, 40 LatentMoE and 8 attention layers, one MTP module."""
    return replace(from_hf_config(NEMOTRON_3_SUPER), name="nemotron-3-super")
