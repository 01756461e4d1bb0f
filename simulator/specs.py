"""Model specs by name or file: presets as functions (``PRESETS``), ``load_model`` and ``with_overrides``.

``ModelSpec`` itself lives in ``simulator.modelspec`` and the HF ``config.json`` / K3Config loaders in
``simulator.hf_config``; both are importable from here too.

Presets (``PRESETS``): ``k3`` (released config, see ``k3_architecture.md`` section 3), ``k3-tiny`` and
``k3-small`` (the CPU presets ``moonep train`` runs), ``kimi-k2``,
``deepseek-v3``, ``llama3-405b``, ``gpt3-175b``, ``nemotron-3-nano`` and ``nemotron-3-super`` (their published
``config.json`` fields, ``simulator.hf_presets``) and the dense GPT models of Korthikanti et al. 2022
(``gpt-22b``, ``gpt-175b``, ``gpt-530b``, ``gpt-1t``; Megatron conventions: vocab 51200, learned positions,
LayerNorm, biases, dropout, tied embeddings).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from k3.config import K3Config
from simulator.hf_config import from_config_object, from_hf_config
from simulator.hf_presets import nemotron_3_nano, nemotron_3_super
from simulator.modelspec import ModelSpec

__all__ = [
    "PRESETS",
    "ModelSpec",
    "from_config_object",
    "from_hf_config",
    "load_model",
    "with_overrides",
]


# ----------------------------------------------------------------------------------------------- presets
def k3() -> ModelSpec:
    """Kimi K3 text model: 93 layers (69 KDA + 24 gated NoPE MLA), 896 experts top-16, LatentMoE 3584.

    Built from ``k3.K3Config.preset("full")``, the one place the released config lives (k3.config is pure
    Python: no torch), through the same adapter any K3Config-like object takes.
    """
    return from_config_object(K3Config.preset("full"), name="k3")


def k3_preset(name: str) -> Callable[[], ModelSpec]:
    """``k3-tiny`` / ``k3-small``: the CPU presets of ``k3.K3Config`` (what ``moonep train --preset`` trains),
    at the training job's sequence length."""

    def build() -> ModelSpec:
        # seq 64 = k3.train.TrainConfig.seq_len (k3.train is not imported here: it pulls in torch)
        return replace(from_config_object(K3Config.preset(name), name=f"k3-{name}"), seq_len=64)

    return build


def kimi_k2() -> ModelSpec:
    """Kimi K2: 61 MLA layers, 64 heads, 384 experts top-8, 1 shared, first layer dense (about 1.04T / 32.6B)."""
    return ModelSpec(
        name="kimi-k2",
        hidden=7168,
        num_layers=61,
        vocab=163840,
        num_heads=64,
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
        ffn_hidden=18432,
        num_experts=384,
        top_k=8,
        moe_ffn_hidden=2048,
        num_shared_experts=1,
        first_k_dense=1,
        router_bias=True,
        seq_len=4096,
    )


def deepseek_v3() -> ModelSpec:
    """DeepSeek-V3 (main model, no MTP): 61 MLA layers, 256 experts top-8, 3 dense layers (671B / 37B)."""
    return ModelSpec(
        name="deepseek-v3",
        hidden=7168,
        num_layers=61,
        vocab=129280,
        num_heads=128,
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
        ffn_hidden=18432,
        num_experts=256,
        top_k=8,
        moe_ffn_hidden=2048,
        num_shared_experts=1,
        first_k_dense=3,
        expert_groups=8,
        groups_per_token=4,
        router_bias=True,
        seq_len=4096,
    )


def llama3_405b() -> ModelSpec:
    """Llama 3 405B: 126 layers, H 16384, FFN 53248, 128 heads, 8 KV heads, vocab 128256."""
    return ModelSpec(
        name="llama3-405b",
        hidden=16384,
        num_layers=126,
        vocab=128256,
        num_heads=128,
        num_kv_heads=8,
        ffn_hidden=53248,
        seq_len=8192,
    )


def llama3(name: str, layers: int, hidden: int, heads: int, ffn: int, seq: int = 8192) -> ModelSpec:
    """Llama 3 / 3.1 (GQA with 8 KV heads, SwiGLU, vocab 128256, untied head)."""
    return ModelSpec(
        name=name,
        hidden=hidden,
        num_layers=layers,
        vocab=128256,
        num_heads=heads,
        num_kv_heads=8,
        ffn_hidden=ffn,
        seq_len=seq,
    )


def qwen3_moe(name: str, layers: int, hidden: int, heads: int, moe_ffn: int) -> ModelSpec:
    """Qwen3 MoE (HF ``Qwen3MoeForCausalLM``): GQA 4 KV heads of 128, 128 experts top-8, no shared expert."""
    return ModelSpec(
        name=name,
        hidden=hidden,
        num_layers=layers,
        vocab=151936,
        num_heads=heads,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        top_k=8,
        moe_ffn_hidden=moe_ffn,
        seq_len=4096,
    )


def nemotron4_15b() -> ModelSpec:
    """Nemotron-4 15B (arXiv 2402.16819, section 2): 32 layers, H 6144, 48 heads with 8 KV heads, a squared-ReLU
    MLP of 24576 (not gated), vocab 256000, untied embeddings, no biases: 3.2B embedding and 12.5B other
    parameters."""
    return ModelSpec(
        name="nemotron4-15b",
        hidden=6144,
        num_layers=32,
        vocab=256000,
        num_heads=48,
        num_kv_heads=8,
        ffn_hidden=24576,
        gated_ffn=False,
        norm="layernorm",
        seq_len=4096,
    )


def gpt_oss_120b() -> ModelSpec:
    """gpt-oss-120b: 36 layers, H 2880, 64 heads of 64 (8 KV), 128 experts top-4 of width 2880, every other layer
    a 128-token sliding window (HF ``layer_types``), biases on attention and experts, activation inputs clamped
    to 7 (HF ``swiglu_limit``)."""
    return ModelSpec(
        name="gpt-oss-120b",
        hidden=2880,
        num_layers=36,
        vocab=201088,
        num_heads=64,
        num_kv_heads=8,
        head_dim=64,
        num_experts=128,
        top_k=4,
        moe_ffn_hidden=2880,
        bias=True,
        expert_bias=True,
        glu_clamp=7.0,
        sliding_window=128,
        sliding_window_layers=tuple(range(0, 36, 2)),
        seq_len=4096,
    )


def _megatron_gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200) -> ModelSpec:
    return ModelSpec(
        name=name,
        hidden=hidden,
        num_layers=layers,
        vocab=vocab,
        num_heads=heads,
        ffn_hidden=4 * hidden,
        gated_ffn=False,
        bias=True,
        norm="layernorm",
        dropout=True,
        tie_embeddings=True,
        position_embeddings=2048,
        seq_len=2048,
    )


def gpt3_175b() -> ModelSpec:
    """GPT-3 175B (96 layers, H 12288, 96 heads, GPT-2 vocab 50257, seq 2048)."""
    return _megatron_gpt("gpt3-175b", 96, 12288, 96, vocab=50257)


PRESETS: dict[str, Callable[[], ModelSpec]] = {
    "k3": k3,
    "k3-tiny": k3_preset("tiny"),
    "k3-small": k3_preset("small"),
    "kimi-k2": kimi_k2,
    "deepseek-v3": deepseek_v3,
    "llama3-405b": llama3_405b,
    "llama3-8b": lambda: llama3("llama3-8b", 32, 4096, 32, 14336),
    "llama3-70b": lambda: llama3("llama3-70b", 80, 8192, 64, 28672),
    "qwen3-30b-a3b": lambda: qwen3_moe("qwen3-30b-a3b", 48, 2048, 32, 768),
    "qwen3-235b-a22b": lambda: qwen3_moe("qwen3-235b-a22b", 94, 4096, 64, 1536),
    "gpt-oss-120b": gpt_oss_120b,
    "nemotron4-15b": nemotron4_15b,
    "nemotron-3-nano": nemotron_3_nano,
    "nemotron-3-super": nemotron_3_super,
    "gpt3-175b": gpt3_175b,
    "gpt-22b": lambda: _megatron_gpt("gpt-22b", 48, 6144, 64),
    "gpt-175b": lambda: _megatron_gpt("gpt-175b", 96, 12288, 96),
    "gpt-530b": lambda: _megatron_gpt("gpt-530b", 105, 20480, 128),
    "gpt-1t": lambda: _megatron_gpt("gpt-1t", 128, 25600, 160),
}


def load_model(name_or_path: str | os.PathLike | ModelSpec | Any) -> ModelSpec:
    """A preset name, a path to an HF ``config.json`` (or to the model folder that holds it, as a downloaded HF
    model is laid out) or a ``ModelSpec`` JSON, or a K3Config-like object."""
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    if not isinstance(name_or_path, (str, os.PathLike)):
        return from_config_object(name_or_path)
    key = os.fspath(name_or_path)
    if key.lower() in PRESETS:
        return PRESETS[key.lower()]()
    if not os.path.exists(key):
        raise ValueError(f"model {key!r} is neither a preset ({', '.join(PRESETS)}) nor an existing file")
    if os.path.isdir(key):
        if not os.path.isfile(os.path.join(key, "config.json")):
            raise ValueError(f"model folder {key!r} holds no config.json (give the config file or an HF model folder)")
        key = os.path.join(key, "config.json")
    with open(key) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"model file {key}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"model file {key}: expected one JSON object, got {type(data).__name__}")
    if "hidden" in data or "num_layers" in data:
        return ModelSpec.from_dict(data)
    return from_hf_config(data)  # named after the model's own fields, not the folder


def with_overrides(spec: ModelSpec, **changes: Any) -> ModelSpec:
    """A copy of ``spec`` with fields changed (validated again)."""
    return replace(spec, **changes)
