"""A ``ModelSpec`` from a Hugging Face ``config.json`` (Llama/Qwen/DeepSeek/Kimi-Linear/K3 fields) or from any
object with those attribute names (``k3.K3Config``, a transformers ``PretrainedConfig``): every field checked,
a missing or ill-typed one named."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

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
    moe = _moe_fields(c, get, hidden)
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
        **moe,
        sliding_window=int(get("sliding_window") or 0) if swa else 0,
        sliding_window_layers=swa,
        attn_res=bool(get("attn_res_block_size")),
        attn_res_block_size=int(get("attn_res_block_size") or 0),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", get("tie_word_embeddings", False))),
        seq_len=min(int(get("max_position_embeddings") or 4096), 8192),
    )


EXPERT_COUNT = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
"""Names of the routed-expert count (DeepSeek/Kimi, Qwen-MoE, Mixtral, ERNIE-4.5), first present wins."""
TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk")
SHARED = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
READ_MOE = frozenset(
    EXPERT_COUNT
    + TOP_K
    + SHARED
    + ("moe_intermediate_size", "shared_expert_intermediate_size", "first_k_dense_replace")
    + ("routed_expert_hidden_size", "topk_method", "n_group", "topk_group", "decoder_sparse_step", "mlp_only_layers")
    + ("moe_layer_freq", "moe_layer_start_index", "num_expert_group", "moe_layer_interval", "moe_layer_end_index")
)
"""Expert fields this reader uses (or checks are at their no-op values)."""
NO_COST = frozenset(
    ("router_aux_loss_coef", "output_router_logits", "router_z_loss_coef", "norm_topk_prob", "routed_scaling_factor")
    + ("scoring_func", "aux_loss_alpha", "seq_aux", "ep_size", "router_jitter_noise", "moe_gate", "moe_use_aux_free")
    + ("use_qk_norm_in_moe", "moe_router_bias_update_rate", "moe_renormalize", "moe_router_activation_func")
)
"""Expert fields that change the loss or the routing rule, not the step's FLOPs, memory or traffic."""


def _first(get: Callable[..., Any], names: tuple[str, ...]) -> tuple[str | None, int]:
    return next(((n, int(get(n))) for n in names if get(n)), (None, 0))


def _moe_fields(c: dict, get: Callable[..., Any], hidden: int) -> dict:
    """The ``ModelSpec`` expert fields of an HF config, under any of the known spellings (``EXPERT_COUNT``,
    ...). Raises naming the HF fields when the config is MoE but cannot be read as such; warns about expert
    fields it does not read, since they may change the cost."""
    moe_keys = sorted(k for k in c if _looks_moe(k) and c[k] not in (None, 0, False, [], {}))
    count_name, experts = _first(get, EXPERT_COUNT)
    if not experts:
        if moe_keys:
            raise ValueError(
                f"HF config: expert fields {moe_keys} but no expert count under a known name "
                f"({', '.join(EXPERT_COUNT)}): refusing to read an MoE model as dense"
            )
        return {}
    unread = [k for k in moe_keys if k not in READ_MOE and k not in NO_COST]
    if unread:
        warnings.warn(f"HF config: expert fields not read (their cost is not modelled): {unread}", stacklevel=3)
    _, top_k = _first(get, TOP_K)
    width = int(get("moe_intermediate_size") or get("intermediate_size") or 0)  # Mixtral: the expert's own width
    if not top_k or not width:
        missing = "top-k (" + "/".join(TOP_K) + ")" if not top_k else "expert width (moe_intermediate_size)"
        raise ValueError(f"HF config: an MoE config ({count_name}={experts}) without its {missing}")
    _check_every_layer_moe(c, get)
    return {
        "num_experts": experts,
        "top_k": top_k,
        "moe_ffn_hidden": width,
        "num_shared_experts": _shared_experts(get, width),
        "first_k_dense": int(get("first_k_dense_replace") or get("moe_layer_start_index") or 0),
        "moe_latent_dim": int(get("routed_expert_hidden_size") or 0)
        if get("routed_expert_hidden_size") not in (None, hidden)
        else 0,
        "router_bias": get("topk_method") == "noaux_tc",
        **_expert_groups(get),
    }


def _expert_groups(get: Callable[..., Any]) -> dict:
    """Group-limited routing (DeepSeek ``n_group``, Kimi ``num_expert_group``); one group is no limit."""
    groups = _first(get, ("n_group", "num_expert_group"))[1]
    return {"expert_groups": groups if groups > 1 else 0, "groups_per_token": int(get("topk_group") or 0)}


def _looks_moe(key: str) -> bool:
    low = key.lower()
    return "expert" in low or low.startswith("moe_") or low.startswith("router_")


def _shared_experts(get: Callable[..., Any], width: int) -> int:
    """Shared experts as a count of routed-width MLPs: Qwen-MoE gives one shared MLP's width instead."""
    count = _first(get, SHARED)[1]
    shared_width = int(get("shared_expert_intermediate_size") or 0)
    if not shared_width:
        return count
    if count or shared_width % width:
        raise ValueError(
            f"HF config: shared_expert_intermediate_size={shared_width} is not a whole number of expert widths "
            f"({width}){' and a shared-expert count is given too' if count else ''}: not expressible"
        )
    return shared_width // width


def _check_every_layer_moe(c: dict, get: Callable[..., Any]) -> None:
    """Dense layers other than the first k are not expressible: refuse rather than price them as MoE."""
    every = {k: int(get(k) or 1) for k in ("decoder_sparse_step", "moe_layer_freq", "moe_layer_interval")}
    dense = c.get("mlp_only_layers") or []
    last = get("moe_layer_end_index")
    tail = last is not None and int(last) < int(get("num_hidden_layers")) - 1
    if any(v != 1 for v in every.values()) or dense or tail:
        said = ", ".join(f"{k}={v}" for k, v in every.items() if v != 1)
        said += f"{', ' if said else ''}mlp_only_layers={dense}" if dense else ""
        said += f"{', ' if said else ''}moe_layer_end_index={last}" if tail else ""
        raise ValueError(
            f"HF config: MoE on only some layers ({said}) is not expressible (ModelSpec has first_k_dense only)"
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


_HF_OTHER = ("linear_attn_config", "topk_method", "layer_types", "mlp_only_layers")
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
