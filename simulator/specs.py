"""Model specs: ``ModelSpec``, presets as functions, HF ``config.json`` loading and a duck-typed K3Config adapter.

A ``ModelSpec`` describes the layer stack with the few numbers that cost and memory depend on. Each layer has an
attention kind (``mha`` incl. GQA, ``mla``, ``kda``) and an FFN kind (``dense`` or ``moe``); ``layer_kinds()``
lists them. Counting formulas live in ``simulator.layers``.

Presets (``PRESETS``): ``k3`` (released config, see ``k3_architecture.md`` section 3), ``k3-tiny`` and
``k3-small`` (the CPU presets ``moonep train`` runs), ``kimi-k2``,
``deepseek-v3``, ``llama3-405b``, ``gpt3-175b`` and the dense GPT models of Korthikanti et al. 2022
(``gpt-22b``, ``gpt-175b``, ``gpt-530b``, ``gpt-1t``; Megatron conventions: vocab 51200, learned positions,
LayerNorm, biases, dropout, tied embeddings).
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, fields, replace
from functools import lru_cache
from typing import Any, Callable

from k3.config import K3Config

ATTENTION_KINDS = ("mha", "mla")
MAX_SIZE = 2**31 - 1
"""Largest size a spec field takes (widths, counts, lengths): far above any model, far below float overflow."""


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """A decoder-only transformer (dense or MoE; softmax, MLA or KDA attention per layer)."""

    name: str
    """Label used in reports."""
    hidden: int
    """Model width H."""
    num_layers: int
    """Number of decoder layers L."""
    vocab: int
    """Vocabulary size V."""
    num_heads: int
    """Attention heads of the softmax (MHA/GQA/MLA) layers."""
    num_kv_heads: int = 0
    """Key/value heads for GQA; 0 means ``num_heads`` (MHA). Ignored by MLA."""
    head_dim: int = 0
    """Per-head width for MHA/GQA; 0 means ``hidden // num_heads``."""
    attention: str = "mha"
    """Softmax attention flavour of the non-KDA layers: ``mha`` (incl. GQA) or ``mla``."""
    q_lora_rank: int = 0
    """MLA query low-rank width (0: full-rank query projection)."""
    kv_lora_rank: int = 0
    """MLA compressed KV width (the cached latent)."""
    qk_nope_dim: int = 0
    """MLA per-head query/key width without position part."""
    qk_rope_dim: int = 0
    """MLA shared key/query slice per head (cached with the latent)."""
    v_head_dim: int = 0
    """MLA per-head value width."""
    attn_output_gate: bool = False
    """Full-rank sigmoid output gate on attention (K3 MLA and KDA): one extra H x (heads*dv) matrix."""
    kda_layers: tuple[int, ...] = ()
    """0-based indices of layers using KDA linear attention instead of ``attention``."""
    kda_heads: int = 0
    """KDA heads."""
    kda_head_dim: int = 0
    """KDA per-head key = value width."""
    kda_conv: int = 4
    """KDA short-convolution taps on q, k, v."""
    ffn_hidden: int = 0
    """Dense FFN width (the dense layers of an MoE model too)."""
    gated_ffn: bool = True
    """GLU-style FFN (3 matrices) rather than 2-matrix GeLU MLP."""
    num_experts: int = 0
    """Routed experts E per MoE layer (0: dense model)."""
    top_k: int = 0
    """Experts per token K."""
    moe_ffn_hidden: int = 0
    """Routed/shared expert width."""
    num_shared_experts: int = 0
    """Shared experts (fused into one MLP of width ``num_shared_experts * moe_ffn_hidden``)."""
    first_k_dense: int = 0
    """Leading layers with a dense FFN instead of MoE."""
    moe_latent_dim: int = 0
    """LatentMoE width: routed experts work in this latent (dispatch sends it); 0 = full width."""
    expert_groups: int = 0
    """Expert groups of group-limited routing (HF ``n_group``; 0: none)."""
    groups_per_token: int = 0
    """Groups a token's experts may come from (HF ``topk_group``; DeepSeek-V3: 4 of 8); 0: no limit."""
    router_bias: bool = False
    """Router carries a per-expert selection bias (aux-free balancing)."""
    bias: bool = False
    """Linear layers carry biases (GPT/Megatron)."""
    norm: str = "rmsnorm"
    """``rmsnorm`` (gain only) or ``layernorm`` (gain and bias)."""
    attn_res: bool = False
    """K3 Block AttnRes: 4 norms + 2 pseudo-queries per layer and 3 vectors at the output."""
    attn_res_block_size: int = 0
    """Layers per AttnRes block (sets how many sources each mix reads; 0 = one block)."""
    dropout: bool = False
    """Dropout after attention and MLP (saves a 1-byte mask each; Megatron GPT runs)."""
    tie_embeddings: bool = False
    """Input embedding and LM head share weights."""
    position_embeddings: int = 0
    """Rows of a learned absolute position table (0: none)."""
    sliding_window: int = 0
    """Keys a query attends to in the sliding-window layers (0: no sliding-window layers)."""
    sliding_window_layers: tuple[int, ...] = ()
    """0-based indices of softmax layers using the ``sliding_window`` (gpt-oss: every other layer)."""
    seq_len: int = 4096
    """Default training sequence length."""

    def __post_init__(self):
        _check_field_types(self)
        for f in ("hidden", "num_layers", "vocab", "num_heads"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ValueError(f"ModelSpec.{f} must be a positive integer, got {getattr(self, f)!r}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"ModelSpec.attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.attention == "mla" and min(self.kv_lora_rank, self.qk_nope_dim, self.v_head_dim) < 1:
            raise ValueError("ModelSpec.kv_lora_rank/qk_nope_dim/v_head_dim must be > 0 for MLA")
        if self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelSpec.num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}")
        if any(not 0 <= i < self.num_layers for i in self.kda_layers):
            raise ValueError("ModelSpec.kda_layers must be 0-based indices below num_layers")
        if self.kda_layers and min(self.kda_heads, self.kda_head_dim) < 1:
            raise ValueError("ModelSpec.kda_heads and kda_head_dim must be > 0 when kda_layers is set")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"ModelSpec.top_k must be in [1, num_experts], got {self.top_k}")
        if self.num_experts and self.moe_ffn_hidden < 1:
            raise ValueError("ModelSpec.moe_ffn_hidden must be > 0 for an MoE model")
        if (not self.num_experts or self.first_k_dense) and self.ffn_hidden < 1:
            raise ValueError("ModelSpec.ffn_hidden must be > 0 when any layer is dense")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"ModelSpec.norm must be rmsnorm or layernorm, got {self.norm!r}")
        if self.seq_len < 1:
            raise ValueError(f"ModelSpec.seq_len must be >= 1, got {self.seq_len}")
        if self.attn_res_block_size < 0:
            raise ValueError(f"ModelSpec.attn_res_block_size must be >= 0, got {self.attn_res_block_size}")
        if any(not 0 <= i < self.num_layers for i in self.sliding_window_layers):
            raise ValueError("ModelSpec.sliding_window_layers must be 0-based indices below num_layers")
        if self.sliding_window_layers and self.sliding_window < 1:
            raise ValueError("ModelSpec.sliding_window must be > 0 when sliding_window_layers is set")
        self._check_shapes()

    def _check_shapes(self) -> None:
        """Sizes that are each valid but impossible together (a head narrower than one unit, groups of no expert)."""
        if self.attention == "mha" and not self.head_dim and self.hidden < self.num_heads:
            raise ValueError(
                f"ModelSpec.num_heads {self.num_heads} > hidden {self.hidden}: the head width hidden // num_heads "
                "is 0 (set head_dim)"
            )
        if self.expert_groups and (self.expert_groups > self.num_experts or self.num_experts % self.expert_groups):
            raise ValueError(f"ModelSpec.expert_groups {self.expert_groups} must divide num_experts {self.num_experts}")
        if self.expert_groups and self.groups_per_token > self.expert_groups:
            raise ValueError(
                f"ModelSpec.groups_per_token {self.groups_per_token} must be <= expert_groups {self.expert_groups}"
            )
        if self.first_k_dense > self.num_layers:
            raise ValueError(f"ModelSpec.first_k_dense {self.first_k_dense} must be <= num_layers {self.num_layers}")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dhead(self) -> int:
        return self.head_dim or self.hidden // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        """``(attention kind, ffn kind)`` per layer, kinds in {mha, mla, kda} x {dense, moe} (cached)."""
        return _layer_kinds(self)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kda_layers"] = list(self.kda_layers)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        """A spec from a JSON object; a missing, unknown or ill-typed field is a ``ValueError`` naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"a ModelSpec JSON holds one object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelSpec field(s) {unknown}")
        missing = sorted(f.name for f in fields(cls) if f.default is MISSING and f.name not in data)
        if missing:
            raise ValueError(f"ModelSpec JSON is missing required field(s) {missing}")
        data = dict(data)
        for f in ("kda_layers", "sliding_window_layers"):
            if not isinstance(data.get(f, ()), (list, tuple)):
                raise ValueError(f"ModelSpec.{f} must be a list of layer indices, got {data[f]!r}")
            data[f] = tuple(data.get(f, ()))
        return cls(**data)


_TYPES = {"int": int, "bool": bool, "str": str, "tuple[int, ...]": tuple}


def _check_field_types(spec: "ModelSpec") -> None:
    """Each field has its annotated type (``bool`` is not an ``int``) and integer sizes are >= 0."""
    for f in fields(spec):
        v, want = getattr(spec, f.name), _TYPES[f.type]
        ok = isinstance(v, want) and (want is bool or not isinstance(v, bool))
        if want is tuple and ok:
            ok = all(isinstance(i, int) and not isinstance(i, bool) for i in v)
        if not ok:
            raise ValueError(f"ModelSpec.{f.name} must be of type {f.type}, got {v!r}")
        if want is int and not 0 <= v <= MAX_SIZE:
            raise ValueError(f"ModelSpec.{f.name} must be in [0, {MAX_SIZE}], got {v!r}")


@lru_cache(maxsize=64)
def _layer_kinds(spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    kda = set(spec.kda_layers)
    moe = spec.is_moe
    return tuple(
        ("kda" if i in kda else spec.attention, "moe" if moe and i >= spec.first_k_dense else "dense")
        for i in range(spec.num_layers)
    )


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


def gpt_oss_120b() -> ModelSpec:
    """gpt-oss-120b: 36 layers, H 2880, 64 heads of 64 (8 KV), 128 experts top-4 of width 2880, every other layer
    a 128-token sliding window (HF ``layer_types``), biases on attention and experts."""
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
    "gpt3-175b": gpt3_175b,
    "gpt-22b": lambda: _megatron_gpt("gpt-22b", 48, 6144, 64),
    "gpt-175b": lambda: _megatron_gpt("gpt-175b", 96, 12288, 96),
    "gpt-530b": lambda: _megatron_gpt("gpt-530b", 105, 20480, 128),
    "gpt-1t": lambda: _megatron_gpt("gpt-1t", 128, 25600, 160),
}


# ----------------------------------------------------------------------------------------------- loaders
def from_hf_config(cfg: dict, name: str = "hf") -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json`` dict (Llama/Qwen/DeepSeek/Kimi-Linear/K3 fields).

    A multimodal config's ``text_config`` is used when present. K3/Kimi-Linear ``linear_attn_config.kda_layers``
    are 1-based in the release and are converted to 0-based indices.
    """
    c, get = _hf_text(cfg)
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    mla = get("kv_lora_rank") is not None
    lin = get("linear_attn_config") or {}
    if not isinstance(lin, dict):
        raise ValueError(f"HF config: field 'linear_attn_config' must be an object, got {lin!r}")
    types = get("layer_types") or []
    swa = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention") if isinstance(types, list) else ()
    lget = _hf_getter(lin)
    kda_ids = lin.get("kda_layers", ())
    if not isinstance(kda_ids, (list, tuple)) or not all(isinstance(i, int) and i >= 1 for i in kda_ids):
        raise ValueError(f"HF config: 'linear_attn_config.kda_layers' must be 1-based layer numbers, got {kda_ids!r}")
    kda = tuple(i - 1 for i in kda_ids)
    experts = int(get("n_routed_experts") or get("num_experts") or get("num_local_experts") or 0)
    return ModelSpec(
        name=name,
        hidden=hidden,
        num_layers=int(get("num_hidden_layers")),
        vocab=int(get("vocab_size")),
        num_heads=heads,
        num_kv_heads=0 if mla else int(get("num_key_value_heads") or heads),
        head_dim=0 if mla else int(get("head_dim") or hidden // heads),
        attention="mla" if mla else "mha",
        q_lora_rank=int(get("q_lora_rank") or 0),
        kv_lora_rank=int(get("kv_lora_rank") or 0),
        qk_nope_dim=int(get("qk_nope_head_dim") or 0),
        qk_rope_dim=int(get("qk_rope_head_dim") or 0),
        v_head_dim=int(get("v_head_dim") or 0),
        attn_output_gate=bool(get("mla_use_output_gate", False)),
        kda_layers=kda,
        kda_heads=int(lget("num_heads", 0)),
        kda_head_dim=int(lget("head_dim", 0)),
        kda_conv=int(lget("short_conv_kernel_size", 4)),
        ffn_hidden=int(get("intermediate_size") or 0),
        num_experts=experts,
        top_k=int(get("num_experts_per_tok") or get("num_experts_per_token") or 0) if experts else 0,
        moe_ffn_hidden=int(get("moe_intermediate_size") or 0) if experts else 0,
        num_shared_experts=int(get("n_shared_experts") or get("num_shared_experts") or 0) if experts else 0,
        first_k_dense=int(get("first_k_dense_replace") or 0) if experts else 0,
        moe_latent_dim=int(get("routed_expert_hidden_size") or 0)
        if get("routed_expert_hidden_size") not in (None, hidden)
        else 0,
        router_bias=get("topk_method") == "noaux_tc",
        expert_groups=int(get("n_group") or 0) if experts else 0,
        groups_per_token=int(get("topk_group") or 0) if experts else 0,
        sliding_window=int(get("sliding_window") or 0) if swa else 0,
        sliding_window_layers=swa,
        attn_res=bool(get("attn_res_block_size")),
        attn_res_block_size=int(get("attn_res_block_size") or 0),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", get("tie_word_embeddings", False))),
        seq_len=min(int(get("max_position_embeddings") or 4096), 8192),
    )


def _hf_text(cfg: Any) -> tuple[dict, Callable[..., Any]]:
    """The text model's fields (``text_config`` when present) and their checked getter; required fields present."""
    if not isinstance(cfg, dict) or not isinstance(cfg.get("text_config", cfg), dict):
        raise ValueError("an HF config.json holds one JSON object (its text_config too)")
    c = cfg.get("text_config", cfg)
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if c.get(key) is None:
            raise ValueError(f"HF config: required field {key!r} is missing")
    return c, _hf_getter(c)


def _hf_getter(c: dict) -> Callable[..., Any]:
    """``c.get`` whose numeric fields are checked: a value that is not a whole number >= 0 raises naming it."""

    def get(key: str, default: Any = None) -> Any:
        v = c.get(key, default)
        if v is None or key in _HF_OTHER or (isinstance(v, bool) and key in _HF_BOOL):
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
            raise ValueError(f"HF config: field {key!r} must be a whole number, got {v!r}")
        if not 0 <= v <= MAX_SIZE:
            raise ValueError(f"HF config: field {key!r} must be in [0, {MAX_SIZE}], got {v!r}")
        return v

    return get


_HF_OTHER = ("linear_attn_config", "topk_method", "layer_types")
_HF_BOOL = ("mla_use_output_gate", "tie_word_embeddings")


def from_config_object(obj: Any, name: str = "k3config") -> ModelSpec:
    """Duck-typed adapter: any object whose attributes use HF / ``k3.K3Config`` names (``hidden_size``, ...).

    Reads the attributes into a dict and goes through ``from_hf_config``, so a future ``k3.K3Config`` (or a
    transformers ``PretrainedConfig``) works as long as it keeps the released field names.
    """
    if hasattr(obj, "to_dict"):
        data = obj.to_dict()
    else:
        data = {k: getattr(obj, k) for k in dir(obj) if not k.startswith("_") and not callable(getattr(obj, k))}
    if "linear_attn_config" in data and not isinstance(data["linear_attn_config"], dict):
        lin = data["linear_attn_config"]
        data["linear_attn_config"] = lin.to_dict() if hasattr(lin, "to_dict") else vars(lin)
    return from_hf_config(data, name=name)


def load_model(name_or_path: str | os.PathLike | ModelSpec | Any) -> ModelSpec:
    """A preset name, a path to an HF ``config.json`` or a ``ModelSpec`` JSON, or a K3Config-like object."""
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    if not isinstance(name_or_path, (str, os.PathLike)):
        return from_config_object(name_or_path)
    key = os.fspath(name_or_path)
    if key.lower() in PRESETS:
        return PRESETS[key.lower()]()
    if not os.path.exists(key):
        raise ValueError(f"model {key!r} is neither a preset ({', '.join(PRESETS)}) nor an existing file")
    with open(key) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"model file {key}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"model file {key}: expected one JSON object, got {type(data).__name__}")
    if "hidden" in data or "num_layers" in data:
        return ModelSpec.from_dict(data)
    return from_hf_config(data, name=os.path.basename(os.path.dirname(os.path.abspath(key))) or "hf")


def with_overrides(spec: ModelSpec, **changes: Any) -> ModelSpec:
    """A copy of ``spec`` with fields changed (validated again)."""
    return replace(spec, **changes)
