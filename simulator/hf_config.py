"""A ``ModelSpec`` from a Hugging Face ``config.json`` (Llama/Qwen/DeepSeek/Kimi-Linear/K3 fields) or from any
object with those attribute names (``k3.K3Config``, a transformers ``PretrainedConfig``): every field checked,
a missing or ill-typed one named."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

from simulator.hf_families import (
    EXPERT_WIDTH_IS_INTERMEDIATE,
    GATED_ATTENTION,
    check_family,
    check_whole,
    dense_ffn_width,
    family_fixed,
    flatten,
    mamba_fields,
    mamba_layer_ids,
    model_name,
    moe_layer_ids,
)
from simulator.hf_layer_kinds import (
    check_mixers,
    kda_from_layer_types,
    layer_kinds,
    single_block_fields,
    single_blocks,
    windowed_layers,
    with_layer_count,
)
from simulator.modelspec import MAX_SIZE, ModelSpec


def from_hf_config(cfg: dict, name: str | None = None) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json`` dict (Llama/Qwen/DeepSeek/Kimi-Linear/K3 fields and the
    MoE families of ``simulator.hf_families``), named after the model (``_name_or_path`` or ``model_type`` +
    ``architectures``) unless ``name`` is given.

    A multimodal config's ``text_config`` is used when present. K3/Kimi-Linear ``linear_attn_config.kda_layers``
    are 1-based in the release and are converted to 0-based indices. A check that fails names the HF field.
    """
    c, get = _hf_text(cfg)
    fields = _fields(cfg, c, get, name or model_name(cfg))
    try:
        return ModelSpec(**fields)
    except ValueError as exc:
        raise ValueError(_hf_message(str(exc), c)) from None


def _fields(cfg: dict, c: dict, get: Callable[..., Any], name: str) -> dict:
    """The ``ModelSpec`` keyword arguments of a text config ``c`` (``cfg`` is the whole file)."""
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    layers = int(get("num_hidden_layers"))
    mla = get("kv_lora_rank") is not None
    blocks = single_blocks(c)  # Nemotron-H: one block per layer (hf_layer_kinds)
    single = single_block_fields(c, get, blocks) if blocks else {}
    types = None if blocks else layer_kinds(c, layers)
    lin, kda = _linear_attention(c, get, types)
    lget = _hf_getter(lin)
    window, windowed = windowed_layers(get, types or [])
    moe = _moe_fields(c, get, hidden, layers)
    mamba = single["mamba_layers"] if blocks else mamba_layer_ids(c, get, layers, types)
    check_mixers(c, types, kda, mamba)
    dense_width = _dense_width_name(c)
    read = dict(
        name=name,
        hidden=hidden,
        num_layers=layers,
        vocab=int(get("vocab_size")),
        num_heads=heads,
        num_kv_heads=0 if mla else int(get("num_key_value_heads") or heads),
        head_dim=0 if mla else int(get("head_dim") or (hidden // heads if heads else 0)),  # heads 0: named below
        attention="mla" if mla else "mha",
        q_lora_rank=int(get("q_lora_rank") or 0),
        kv_lora_rank=int(get("kv_lora_rank") or 0),
        qk_nope_dim=int(get("qk_nope_head_dim") or 0),
        qk_rope_dim=int(get("qk_rope_head_dim") or 0),
        v_head_dim=int(get("v_head_dim") or 0),
        attn_output_gate=bool(get("mla_use_output_gate", False)) or c.get("model_type") in GATED_ATTENTION,
        kda_layers=kda,
        kda_heads=int(lget("num_heads", 0)),
        kda_head_dim=int(lget("head_dim", 0)),
        kda_conv=int(lget("short_conv_kernel_size", 4)),
        kda_gate=str(lin.get("gate", "channel")),
        kda_key_heads=int(lget("key_heads", 0)),
        kda_key_dim=int(lget("key_dim", 0)),
        ffn_hidden=dense_ffn_width(c, int(get(dense_width) or 0)),
        **moe,
        mamba_layers=mamba,
        **(mamba_fields(c, get) if mamba and not blocks else {}),
        bias=bool(c.get("attention_bias") or c.get("use_bias")),
        sliding_window=window,
        sliding_window_layers=windowed,
        attn_res=bool(get("attn_res_block_size")),
        attn_res_block_size=int(get("attn_res_block_size") or 0),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", get("tie_word_embeddings", False))),
        seq_len=min(int(get("max_position_embeddings") or 4096), 8192),
        mtp_layers=int(get("num_nextn_predict_layers") or 0),
    )
    return read | single  # a single-block hybrid's layer placement and block shapes win


def _linear_attention(c: dict, get: Callable[..., Any], types: list[str] | None) -> tuple[dict, tuple[int, ...]]:
    """K3 / Kimi-Linear's ``linear_attn_config`` (or the one transformers 5.x fields give) and its KDA layers,
    0-based (the release numbers them from 1)."""
    lin = get("linear_attn_config") or kda_from_layer_types(c, get, types)
    if not isinstance(lin, dict):
        raise ValueError(f"HF config: field 'linear_attn_config' must be an object, got {lin!r}")
    kda_ids = lin.get("kda_layers", ())
    if not isinstance(kda_ids, (list, tuple)) or not all(isinstance(i, int) and i >= 1 for i in kda_ids):
        raise ValueError(f"HF config: 'linear_attn_config.kda_layers' must be 1-based layer numbers, got {kda_ids!r}")
    return lin, tuple(i - 1 for i in kda_ids)


EXPERT_COUNT = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
"""Names of the routed-expert count (DeepSeek/Kimi, Qwen-MoE/Jamba, Mixtral/gpt-oss/Llama-4/DBRX, ERNIE-4.5)."""
TOP_K = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_k", "moe_topk")
SHARED = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
SHARED_WIDTH = ("shared_expert_intermediate_size", "share_expert_dim", "shared_experts_intermediate_size")
SHARED_WIDTH += ("moe_shared_expert_intermediate_size", "shared_intermediate_size")
"""Names of the always-active shared MLP's width (Qwen-MoE, Step-3.x, dots, Nemotron-H, Granite)."""
LATENT = ("routed_expert_hidden_size", "moe_hidden_size", "moe_latent_size")
"""Names of the width routed experts run at behind a down/up projection (K3's LatentMoE, Muse Spark, Nemotron-H)."""
READ_MOE = frozenset(
    EXPERT_COUNT
    + TOP_K
    + SHARED
    + SHARED_WIDTH
    + LATENT
    + ("moe_intermediate_size", "first_k_dense_replace", "moe_layers")
    + ("topk_method", "n_group", "topk_group", "decoder_sparse_step", "mlp_only_layers")
    + ("moe_layer_freq", "moe_layer_start_index", "num_expert_group", "moe_layer_interval", "moe_layer_end_index")
    + ("expert_layer_period", "expert_layer_offset")
)
"""Expert fields this reader uses."""
NO_COST = frozenset(
    ("router_aux_loss_coef", "output_router_logits", "router_z_loss_coef", "norm_topk_prob", "routed_scaling_factor")
    + ("scoring_func", "aux_loss_alpha", "seq_aux", "ep_size", "router_jitter_noise", "moe_gate", "moe_use_aux_free")
    + ("use_qk_norm_in_moe", "moe_router_bias_update_rate", "moe_renormalize", "moe_router_activation_func")
    + ("moe_norm_min", "moe_routed_scaling_factor", "router_scaling_factor", "moe_router_scaling_factor")
    + ("moe_shared_expert_overlap",)
)
"""Expert fields that change the loss or the routing rule, not the step's FLOPs, memory or traffic."""
SIZE_WORDS = frozenset(("size", "dim", "intermediate", "width", "num", "n", "count", "hidden", "rank"))
"""Words of an expert field name that make it a size: unread, it would misprice the experts (an error)."""


def _one_of(get: Callable[..., Any], names: tuple[str, ...], what: str) -> tuple[str | None, int]:
    """(field, value) of the one nonzero field among ``names``; two that disagree are ambiguous: an error."""
    given = [(n, int(get(n))) for n in names if get(n)]
    if len({v for _, v in given}) > 1:
        said = " and ".join(f"{n}={v}" for n, v in given)
        raise ValueError(f"HF config: {said} both give the {what} and disagree")
    return given[0] if given else (None, 0)


def _moe_fields(c: dict, get: Callable[..., Any], hidden: int, layers: int) -> dict:
    """The ``ModelSpec`` expert fields of an HF config, under any of the known spellings (``EXPERT_COUNT``,
    ...). Raises naming the HF fields when the config is MoE but cannot be read as such; warns about expert
    fields it does not read, since they may change the cost."""
    moe_keys = sorted(k for k in c if _looks_moe(k) and c[k] not in (None, 0, False, [], {}))
    count_name, experts = _one_of(get, EXPERT_COUNT, "routed-expert count")
    if not experts:
        if moe_keys:
            raise ValueError(
                f"HF config: expert fields {moe_keys} but no expert count under a known name "
                f"({', '.join(EXPERT_COUNT)}): refusing to read an MoE model as dense"
            )
        return {}
    unread = [k for k in moe_keys if k not in READ_MOE and k not in NO_COST]
    sized = [k for k in unread if SIZE_WORDS & set(k.lower().rpartition(".")[2].split("_"))]
    if sized:
        raise ValueError(f"HF config: expert size fields {sized} are not read, so the experts would be priced wrong")
    if unread:
        warnings.warn(f"HF config: expert fields not read (their cost is not modelled): {unread}", stacklevel=4)
    k_name, top_k = _one_of(get, TOP_K, "experts per token")
    if not top_k:
        raise ValueError(f"HF config: an MoE config ({count_name}={experts}) without its top-k ({'/'.join(TOP_K)})")
    if top_k > experts:
        raise ValueError(f"HF config: {k_name}={top_k} experts per token is more than {count_name}={experts}")
    w_name = "moe_intermediate_size" if get("moe_intermediate_size") is not None else "intermediate_size"
    width = int(get(w_name) or 0)  # Mixtral, Jamba, gpt-oss, Llama-4, DBRX: intermediate_size is the expert's
    if not width:
        raise ValueError(f"HF config: an MoE config ({count_name}={experts}) needs its expert width {w_name} > 0")
    kind = c.get("model_type")
    if w_name == "intermediate_size" and kind not in EXPERT_WIDTH_IS_INTERMEDIATE:
        warnings.warn(
            f"HF config: model_type {kind!r} is not a family the loader knows and has no moe_intermediate_size: "
            f"its routed experts are priced intermediate_size={width} wide, as Mixtral's and OLMoE's mean it",
            stacklevel=4,
        )
    fixed = family_fixed(c)
    latent = _one_of(get, LATENT, "routed experts' hidden width")[1]
    ids, _ = moe_layer_ids(c, get, layers)
    first = ids[0] if ids == tuple(range(ids[0], layers)) else 0
    dense = _dense_width_name(c)
    if len(ids) < layers and not get(dense):
        raise ValueError(f"HF config: {layers - len(ids)} dense (non-MoE) layers need their width {dense} > 0")
    return {
        "num_experts": experts,
        "top_k": top_k,
        "moe_ffn_hidden": width,
        **(_shared_experts(get, width) if "num_shared_experts" not in fixed else {}),
        "first_k_dense": first,
        "moe_layers": () if first or len(ids) == layers else ids,
        "moe_latent_dim": latent if latent != hidden else 0,
        "glu_clamp": _glu_clamp(get),
        "router_bias": get("topk_method") == "noaux_tc" or fixed.pop("router_bias", False),
        **fixed,
        **_expert_groups(get),
    }


DENSE_WIDTH = ("intermediate_size_mlp", "first_dense_intermediate_size", "mlp_only_intermediate_size")
"""Names of the dense MLP's width in MoE families where ``intermediate_size`` is absent or the experts' (Llama-4,
and the families whose dense layers come first or are listed in ``mlp_only_layers``)."""


def _dense_width_name(c: dict) -> str:
    """The field holding the dense MLP's width: the first ``DENSE_WIDTH`` name present, else ``intermediate_size``."""
    return next((k for k in DENSE_WIDTH if c.get(k) is not None), "intermediate_size")


def _glu_clamp(get: Callable[..., Any]) -> float:
    """gpt-oss' ``swiglu_limit``: the experts' activation inputs are clamped to it (absent or null: none)."""
    value = get("swiglu_limit")
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"HF config: swiglu_limit={value!r} must be a finite number >= 0")
    return float(value)


def _expert_groups(get: Callable[..., Any]) -> dict:
    """Group-limited routing (DeepSeek ``n_group``, Kimi ``num_expert_group``); one group is no limit."""
    groups = _one_of(get, ("n_group", "num_expert_group"), "expert group count")[1]
    return {"expert_groups": groups if groups > 1 else 0, "groups_per_token": int(get("topk_group") or 0)}


def _looks_moe(key: str) -> bool:
    low = key.lower().rpartition(".")[2]
    return "expert" in low or low.startswith("moe_") or low.startswith("router_")


def _shared_experts(get: Callable[..., Any], width: int) -> dict:
    """The ``ModelSpec`` shared-expert field: a count of routed-width MLPs (DeepSeek), or the width that Qwen-MoE /
    Step-3.x / Granite give for one shared MLP (Nemotron-H: a count and each one's width), as a count when it is a
    whole number of expert widths (same FLOPs and weights) and as ``shared_ffn_hidden`` when it is not."""
    count = _one_of(get, SHARED, "shared-expert count")[1]
    shared_width = _one_of(get, SHARED_WIDTH, "shared experts' width")[1]
    if not shared_width:
        return {"num_shared_experts": count}
    total = (count or 1) * shared_width  # a count with a width: that many shared MLPs of that width (Nemotron-H)
    return {"num_shared_experts": total // width} if total % width == 0 else {"shared_ffn_hidden": total}


_SPEC_TO_HF = {
    "hidden": "hidden_size",
    "num_layers": "num_hidden_layers",
    "vocab": "vocab_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "qk_nope_dim": "qk_nope_head_dim",
    "qk_rope_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "ffn_hidden": "intermediate_size",
    "num_experts": "/".join(EXPERT_COUNT),
    "top_k": "/".join(TOP_K),
    "moe_ffn_hidden": "moe_intermediate_size",
    "num_shared_experts": "/".join(SHARED),
    "first_k_dense": "first_k_dense_replace",
    "expert_groups": "n_group",
    "groups_per_token": "topk_group",
    "seq_len": "max_position_embeddings",
    "mtp_layers": "num_nextn_predict_layers",
    "mtp_repeated": "mtp_use_repeated_layer",
    "kda_layers": "linear_attn_config.kda_layers/layer_types/full_attention_interval",
    "kda_heads": "linear_attn_config.num_heads/linear_num_value_heads/linear_num_heads",
    "kda_head_dim": "linear_attn_config.head_dim/linear_value_head_dim/linear_head_dim",
    "kda_key_heads": "linear_num_key_heads",
    "kda_key_dim": "linear_key_head_dim",
    "sliding_window": "sliding_window/attention_chunk_size",
    "sliding_window_layers": "layer_types",
    "mamba_layers": "attn_layer_period/attn_layer_offset",
    "mamba_d_state": "mamba_d_state",
    "mamba_d_conv": "mamba_d_conv",
    "mamba_expand": "mamba_expand",
    "mamba_heads": "mamba_n_heads/mamba_num_heads",
    "mamba_groups": "mamba_n_groups/n_groups",
    "mixer_only_layers": "hybrid_override_pattern/layers_block_type",
    "ffn_only_layers": "hybrid_override_pattern/layers_block_type",
}
"""The HF field behind each ``ModelSpec`` field, for messages about an HF config (the first present of several)."""


def _hf_message(msg: str, c: dict) -> str:
    """A ``ModelSpec`` check's message with the spec's field names replaced by the HF fields they came from."""

    def hf(m: re.Match) -> str:
        names = _SPEC_TO_HF.get(m.group(1), m.group(1)).split("/")
        present = [n for n in names if n in c] or names
        return f"HF field {present[0]!r}"

    out = re.sub(r"ModelSpec\.(\w+)", hf, msg)
    out = re.sub(r"\b(" + "|".join(_SPEC_TO_HF) + r")\b(?!')", lambda m: hf(m), out)
    return out if out.startswith("HF config") else f"HF config: {out}"


def _hf_text(cfg: Any) -> tuple[dict, Callable[..., Any]]:
    """The text model's fields (``text_config`` when present) and their checked getter: an expressible family,
    required fields present."""
    if not isinstance(cfg, dict) or not isinstance(cfg.get("text_config", cfg), dict):
        raise ValueError("an HF config.json holds one JSON object (its text_config too)")
    c = flatten(cfg.get("text_config", cfg))
    c = with_layer_count(c, single_blocks(c))
    check_family(c)  # before the required fields: a family that names them otherwise is refused for what it is
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
        check_whole(key, v)
        if not 0 <= v <= MAX_SIZE:
            raise ValueError(f"HF config: field {key!r} must be in [0, {MAX_SIZE}], got {v!r}")
        return v

    return get


_HF_OTHER = ("linear_attn_config", "topk_method", "layer_types", "mlp_only_layers", "moe_layers", "mamba_dt_rank")
_HF_OTHER += ("mlp_layer_types", "layers_block_type", "hybrid_override_pattern")
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
