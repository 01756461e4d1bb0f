"""``K3Config``: the Kimi K3 text model configuration with the released ``config.json`` field names.

Presets (``K3Config.preset(name)``): ``full`` (the released values, k3_architecture.md section 3.1), ``tiny``
(every structural switch, trains on CPU in minutes) and ``small`` (a wider/deeper CPU-sized model).
Layer lists in ``linear_attn_config`` are 1-based, as released; ``layer_kind(i)`` takes 0-based indices.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from moonep_base import write_json

# Top-level keys of the multimodal config.json that sit next to ``text_config``.
_TOP_LEVEL = ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id", "tie_word_embeddings")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


@dataclass(kw_only=True, slots=True)
class LinearAttnConfig:
    """``text_config.linear_attn_config``: the KDA layers and where the MLA layers sit."""

    num_heads: int = 96
    """KDA heads h."""
    head_dim: int = 128
    """KDA per-head key = value width d_k = d_v."""
    short_conv_kernel_size: int = 4
    """Taps W of the causal depthwise convolution on q, k, v."""
    gate_lower_bound: float = -5.0
    """Lower bound of the per-channel log decay: g = lb * sigmoid(exp(A_log) (f + dt_bias))."""
    use_full_rank_gate: bool = True
    """Output gate is a full-rank hidden -> h*d_v projection (K3); False (low-rank, Kimi Linear) is unsupported."""
    full_attn_layers: list[int] = field(default_factory=lambda: [*range(4, 93, 4), 93])
    """1-based indices of the gated MLA layers."""
    kda_layers: list[int] = field(default_factory=lambda: [i for i in range(1, 92) if i % 4])
    """1-based indices of the KDA layers (the complement of ``full_attn_layers``)."""

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "short_conv_kernel_size"):
            _positive(f"linear_attn_config.{name}", getattr(self, name))
        if not self.gate_lower_bound < 0:
            raise ValueError(f"linear_attn_config.gate_lower_bound: must be negative, got {self.gate_lower_bound}")
        if not self.use_full_rank_gate:
            raise ValueError("linear_attn_config.use_full_rank_gate: only the full-rank K3 gate is implemented")
        self.full_attn_layers = [int(i) for i in self.full_attn_layers]
        self.kda_layers = [int(i) for i in self.kda_layers]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(kw_only=True, slots=True)
class K3Config:
    """Kimi K3 text model (``text_config`` of the release plus the top-level token ids)."""

    vocab_size: int = 163840
    """Vocabulary V (input embedding and untied LM head)."""
    hidden_size: int = 7168
    """Model width d."""
    num_hidden_layers: int = 93
    """Decoder layers L."""
    num_attention_heads: int = 96
    """MLA heads."""
    num_key_value_heads: int = 96
    """MLA key/value heads (equal to the heads: MLA decompresses per head)."""
    q_lora_rank: int = 1536
    """MLA query compression width."""
    kv_lora_rank: int = 512
    """MLA key/value latent width (cached)."""
    qk_nope_head_dim: int = 128
    """MLA per-head query/key width."""
    qk_rope_head_dim: int = 64
    """MLA shared key slice per head; NOT rotated (NoPE), kept as an extra shared key/query slice."""
    v_head_dim: int = 128
    """MLA per-head value width."""
    mla_use_nope: bool = True
    """No positional encoding anywhere (the only supported value)."""
    mla_use_output_gate: bool = True
    """MLA output multiplied by sigmoid(g_proj(x)) before o_proj."""
    linear_attn_config: LinearAttnConfig = field(default_factory=LinearAttnConfig)
    """KDA settings and the layer schedule."""
    first_k_dense_replace: int = 1
    """Leading layers with a dense SiTU-GLU MLP instead of MoE."""
    moe_layer_freq: int = 1
    """Every ``moe_layer_freq``-th layer after the dense ones is MoE (1 in K3: all of them)."""
    intermediate_size: int = 33792
    """Dense MLP width."""
    num_experts: int = 896
    """Routed experts E per MoE layer."""
    num_experts_per_token: int = 16
    """Top-k K."""
    num_shared_experts: int = 2
    """Shared experts, fused into one MLP of width ``num_shared_experts * moe_intermediate_size``."""
    moe_intermediate_size: int = 3072
    """Routed (and each shared) expert width F."""
    routed_expert_hidden_size: int = 3584
    """LatentMoE latent width: routed experts read and write this (d -> latent before dispatch)."""
    latent_moe_use_norm: bool = True
    """RMSNorm on the weighted sum of expert outputs, before the up-projection."""
    moe_router_activation_func: str = "sigmoid"
    """Router score function (only sigmoid)."""
    topk_method: str = "noaux_tc"
    """Selection on score + bias, bias absent from the weights (only noaux_tc)."""
    use_grouped_topk: bool = True
    """Released flag; with one group it is plain top-k."""
    num_expert_group: int = 1
    """Expert groups (1: no group limit)."""
    topk_group: int = 1
    """Groups a token may use (1)."""
    moe_renormalize: bool = True
    """Weights renormalised over the selected experts."""
    routed_scaling_factor: float = 1.0
    """Multiplier of the routing weights."""
    hidden_act: str = "situ"
    """Activation of every MLP: SiTU-GLU."""
    activation_situ_beta: float = 4.0
    """SiTU gate bound beta1."""
    activation_situ_linear_beta: float = 25.0
    """SiTU up-branch bound beta2."""
    attn_res_block_size: int = 12
    """Layers per Block Attention Residual block."""
    rms_norm_eps: float = 1e-5
    """RMSNorm eps (layer, AttnRes, latent, KDA output norms; MLA LoRA norms use 1e-6)."""
    max_position_embeddings: int = 1048576
    """Context length (no positional parameters depend on it)."""
    num_nextn_predict_layers: int = 0
    """MTP layers in the released config (0)."""
    initializer_range: float = 0.02
    """Std of the normal init of linear and embedding weights."""
    tie_word_embeddings: bool = False
    """Input embedding and LM head are separate matrices (False in K3)."""
    bos_token_id: int = 163584
    """Beginning-of-sequence id."""
    eos_token_id: int = 163586
    """End-of-sequence id."""
    pad_token_id: int = 163839
    """Padding id."""

    def __post_init__(self) -> None:
        if isinstance(self.linear_attn_config, dict):
            self.linear_attn_config = LinearAttnConfig(**self.linear_attn_config)
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "intermediate_size",
            "num_experts",
            "num_experts_per_token",
            "moe_intermediate_size",
            "routed_expert_hidden_size",
            "attn_res_block_size",
            "moe_layer_freq",
        ):
            _positive(name, getattr(self, name))
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"num_key_value_heads: must equal num_attention_heads ({self.num_attention_heads})")
        if not self.mla_use_nope:
            raise ValueError("mla_use_nope: K3 has no positional encoding; only True is supported")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace: must be in [0, {self.num_hidden_layers}]")
        if not self.num_experts_per_token < self.num_experts:
            raise ValueError(
                f"num_experts_per_token: must be < num_experts={self.num_experts} (balancing uses the (k+1)-th score)"
            )
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts: must be >= 0, got {self.num_shared_experts}")
        checks = (
            ("hidden_act", "situ"),
            ("moe_router_activation_func", "sigmoid"),
            ("topk_method", "noaux_tc"),
            ("num_expert_group", 1),
            ("topk_group", 1),
            ("moe_renormalize", True),
            ("latent_moe_use_norm", True),
            ("tie_word_embeddings", False),
        )
        for name, want in checks:
            if getattr(self, name) != want:
                raise ValueError(f"{name}: only {want!r} is supported, got {getattr(self, name)!r}")
        for name in (
            "activation_situ_beta",
            "activation_situ_linear_beta",
            "rms_norm_eps",
            "routed_scaling_factor",
            "initializer_range",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        self._check_schedule()

    def _check_schedule(self) -> None:
        lin, L = self.linear_attn_config, self.num_hidden_layers
        mla, kda = set(lin.full_attn_layers), set(lin.kda_layers)
        if len(mla) != len(lin.full_attn_layers) or len(kda) != len(lin.kda_layers):
            raise ValueError("linear_attn_config.full_attn_layers: duplicate layer indices")
        if mla & kda:
            raise ValueError(f"linear_attn_config.kda_layers: layers {sorted(mla & kda)} are also full_attn_layers")
        if mla | kda != set(range(1, L + 1)):
            raise ValueError(f"linear_attn_config.kda_layers: with full_attn_layers must cover 1..{L} exactly")

    # ------------------------------------------------------------------ structure
    def layer_kind(self, i: int) -> str:
        """``"kda"`` or ``"mla"`` for 0-based layer ``i``."""
        return "mla" if i + 1 in self.linear_attn_config.full_attn_layers else "kda"

    def is_moe(self, i: int) -> bool:
        """Whether 0-based layer ``i`` has the LatentMoE FFN (else the dense SiTU-GLU MLP)."""
        return i >= self.first_k_dense_replace and (i - self.first_k_dense_replace) % self.moe_layer_freq == 0

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """The HF layout: top-level ids and ``tie_word_embeddings`` beside a nested ``text_config``."""
        text = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"]}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            text[f.name] = v.to_dict() if isinstance(v, LinearAttnConfig) else v
        top = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"]}
        top.update({k: text[k] for k in _TOP_LEVEL if k in text})
        top["text_config"] = text
        return top

    def to_json(self, path: str | os.PathLike) -> None:
        """Write an HF-style ``config.json`` (atomic)."""
        write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> K3Config:
        """From an HF config dict (nested ``text_config`` or flat); unknown keys (vision, quantisation) ignored."""
        text = dict(data.get("text_config", data))
        for k in _TOP_LEVEL:  # top-level values win where the release puts them there
            if k in data and k != "text_config":
                text.setdefault(k, data[k])
        names = {f.name for f in dataclasses.fields(cls)}
        if "num_experts_per_tok" in text:  # DeepSeek spelling used by some ports
            text.setdefault("num_experts_per_token", text["num_experts_per_tok"])
        return cls(**{k: v for k, v in text.items() if k in names})

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> K3Config:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def preset(cls, name: str) -> K3Config:
        """``full`` (released), ``tiny`` (CPU minutes, every switch kept) or ``small``."""
        if name not in PRESETS:
            raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
        return PRESETS[name]()


def _full() -> K3Config:
    return K3Config()


def _tiny() -> K3Config:
    """9 layers: KDA except MLA at 4, 8 and the extra final 9; dense layer 0; blocks of 4 (tail block of 1)."""
    return K3Config(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=9,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        linear_attn_config=LinearAttnConfig(
            num_heads=2, head_dim=16, full_attn_layers=[4, 8, 9], kda_layers=[1, 2, 3, 5, 6, 7]
        ),
        intermediate_size=128,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=2,
        moe_intermediate_size=32,
        routed_expert_hidden_size=32,
        attn_res_block_size=4,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _small() -> K3Config:
    """18 layers (MLA at 4, 8, 12, 16 and 18), 16 experts top-4, blocks of 6 (three full blocks)."""
    return K3Config(
        vocab_size=256,
        hidden_size=256,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        linear_attn_config=LinearAttnConfig(
            num_heads=4, head_dim=32, full_attn_layers=[4, 8, 12, 16, 18], kda_layers=[i for i in range(1, 18) if i % 4]
        ),
        intermediate_size=512,
        num_experts=16,
        num_experts_per_token=4,
        num_shared_experts=2,
        moe_intermediate_size=64,
        routed_expert_hidden_size=128,
        attn_res_block_size=6,
        max_position_embeddings=65536,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


PRESETS = {"full": _full, "tiny": _tiny, "small": _small}

__all__ = ["K3Config", "LinearAttnConfig", "PRESETS"]
