"""A ``ModelSpec`` from a Hugging Face ``config.json`` (Llama/Qwen/DeepSeek/Kimi-Linear/K3 fields) or from any
object with those attribute names (``k3.K3Config``, a transformers ``PretrainedConfig``): every field checked,
a missing or ill-typed one named."""

from __future__ import annotations

from typing import Any, Callable

from simulator.modelspec import MAX_SIZE, ModelSpec


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
